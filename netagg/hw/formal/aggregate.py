"""The aggregation properties (1 to 4), on the aggregator's lookup and decide stages.

`AggregateHarness` wraps the real `hw.aggregator_lookup.Lookup` and
`hw.aggregator_decide.Decide`, connected as `hw.aggregator.Aggregator` connects them, with
small parameters (2 ports, 2 jobs, 3 ranks, 2 slots, payloads of up to 16 bytes). What the
aggregator around them does is left free or modelled:

- every header entry is a free input (any opcode, job, rank, key, slot, version, message
  number, length, null mark), taken whenever the lookup stage takes one: so every
  duplicate, replay, reordering and stray packet is among the inputs;
- `go` (the command queue has room), the barrier and the deadlines' tick are free;
- the slots' state is the harness's registers (`state`), read as the aggregator's
  transparent read port reads its memory: the state after every earlier decided packet;
- the job table is a free configuration (`config`), constant, each enabled job's slot range
  inside the switch's slots and shared with no other enabled job's (property 5 proves that
  the control path keeps it so); COMPLETED is counted here as `hw.control.Control` counts it,
  from the decide stage's completions.

The harness keeps a model of each slot copy's use (`Use`: the ranks whose contributions
went into its sums since the use began, how many of them brought data, its message number,
the tick it began at, whether it is complete), updated from the commands the decide stage
queues for the sums (OVERWRITE begins a use, ADD adds to it, a completion or CLOSE ends
it), and asserts the properties against it when a packet is decided:

1. `EXACTLY_ONCE`: an ADD comes from a rank not yet in the use, into a use in progress; an
   OVERWRITE begins a use only over a complete one or a copy never used;
2. `COMPLETE`: a result to every worker leaves exactly when the use's ranks reach the job's
   quorum (every worker when it has none), or on CLOSE at least DEADLINE ticks after the use
   began, and carries the use's count of data contributions; a replay answers only a
   complete use's message, to its one worker, with the same count; a drained packet sends
   nothing (what the sums stage sends for these commands, the result's rows, is proven on
   it by `hw.formal.sums`);
3. `NOT_STALE`: an ADD carries the use's message number; an OVERWRITE a later one than the
   copy's last use; a contribution that changes a sum is within the job's credits of its
   COMPLETED;
4. `ISOLATION`: a contribution changes only a slot of its own job's range and sends only its
   own job's result to its own job's workers; another job's slots are never written; a
   contribution whose key is not its job's KEY changes no state, sends nothing, and raises
   one event, a drop counter.

For k-induction the harness also asserts, with `invariants`, that the state agrees with the
model (`_invariants`): these are what makes the properties inductive, and each is proven
with them. Covers show that each property's states are reached: a use completed by its
quorum, a duplicate dropped, a replay, a close at the deadline, a stale message dropped, a
message beyond the credits dropped, a wrong key dropped, a second use of a copy, a use of
every rank completed and one of several ranks replayed.

A use is named by its message number modulo 2**16, as a slot copy keeps it on a single
switch (`hw.fabric.msn_bits`): the properties hold of the message numbers' low 16 bits.

Planted bugs (`Bug`) change one signal a stage reads, in this harness's wiring: the stages'
code stays as it is, and each fault is one a wiring or a read-port error would make.
"""

import enum

from amaranth import Array, Cat, Const, Module, Mux, Signal, signed
from amaranth.hdl import Assert, Assume, Cover, ResetSignal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In

from netagg.contract import headers as C
from netagg.contract import regmap as R

from .. import headers as H
from ..aggregator_command import Action, slot_state
from ..aggregator_decide import Decide
from ..aggregator_lookup import Look, Lookup
from ..control import JOB_EVENTS, PORT_EVENTS
from ..ingress import ingress_header


class Property(enum.Enum):
    EXACTLY_ONCE = 1
    COMPLETE = 2
    NOT_STALE = 3
    ISOLATION = 4


class Bug(enum.Enum):
    """A fault planted in the harness's wiring of the real stages."""
    BITMAP_IGNORED = "the decide stage reads each slot copy's bitmap as empty"
    KEY_UNCHECKED = "the lookup stage reads each job's KEY as the packet's own R_Key"
    STALE_MSN_TAKEN = "the decide stage reads each slot copy's msn as the packet's"


# A job's configuration as the harness gives it: the job table's entry less COMPLETED and
# EPOCH, which the stages do not read.
CONFIG = data.StructLayout({
    "enable": 1, "workers": 6, "slot_base": 16, "slot_count": 16, "credits": 16,
    "quorum": 6, "key": 32, "deadline": R.DEADLINE_BITS,
})

# What the model keeps of a slot copy's use.
USE = data.StructLayout({
    "used": 1,          # a use has begun since reset
    "ranks": 8,         # the ranks whose contributions are in its sums
    "data": 6,          # how many of them brought data
    "msn": 16,          # its message number, as the copy keeps it
    "begun": R.DEADLINE_BITS,
    "complete": 1,      # its result went to every worker
})

# The events that count a packet dropped.
DROPS = ("drop_unhandled", "drop_bad_job", "drop_bad_payload", "drop_bad_worker",
         "drop_bad_key", "drop_bad_slot", "drop_credit", "drop_stale", "drop_bad_length",
         "duplicates")


def popcount(value):
    """The number of bits set in `value`."""
    return sum((value[i] for i in range(len(value))), Const(0, 4))


class AggregateHarness(wiring.Component):
    def __init__(self, *, properties=frozenset(Property), invariants: bool = True,
                 bug: Bug | None = None, ports: int = 2, jobs: int = 2, max_workers: int = 3,
                 slots: int = 2, max_payload: int = 16):
        if not 1 <= max_workers <= 8:
            raise ValueError(f"the model keeps up to 8 ranks, not {max_workers}")
        self.properties, self.invariants, self.bug = frozenset(properties), invariants, bug
        self.ports, self.jobs, self.max_workers = ports, jobs, max_workers
        self.slots, self.max_payload = slots, max_payload
        super().__init__({
            "header": In(stream.Signature(ingress_header(ports))),
            "go": In(1),
            "barrier": In(1),
            "tick": In(1),
            "config": In(CONFIG).array(jobs),
            "worker_port": In(4).array(jobs * max_workers),
            "worker_ip": In(32).array(jobs * max_workers),
        })

    def elaborate(self, platform):
        m = Module()
        P, J, MW, S = self.ports, self.jobs, self.max_workers, self.slots
        m.submodules.lookup = lookup = Lookup(ports=P, jobs=J, max_workers=MW, slots=S,
                                              max_payload=self.max_payload)
        m.submodules.decide = decide = Decide(ports=P, jobs=J, max_workers=MW, slots=S)
        m.d.comb += Assume(~ResetSignal())

        # The environment: a constant configuration whose enabled ranges fit and are disjoint.
        config = self.config
        started = Signal()
        m.d.sync += started.eq(1)
        for j in range(J):
            held = Signal(CONFIG, name=f"config{j}_held")
            m.d.sync += held.eq(config[j])
            m.d.comb += Assume(~started | (config[j].as_value() == held.as_value()))
            m.d.comb += Assume(config[j].workers <= MW)
            with m.If(config[j].enable):
                m.d.comb += Assume(config[j].slot_base + config[j].slot_count <= S)
            for k in range(j + 1, J):
                m.d.comb += Assume(~(config[j].enable & config[k].enable
                                     & (config[j].slot_base < config[k].slot_base
                                        + config[k].slot_count)
                                     & (config[k].slot_base < config[j].slot_base
                                        + config[j].slot_count)))
        completed = [Signal(32, name=f"job{j}_completed") for j in range(J)]
        now = Signal(R.DEADLINE_BITS)
        with m.If(self.tick):
            m.d.sync += now.eq(now + 1)

        # The stages, connected as the aggregator connects them.
        a_rkey = Signal(32)         # the R_Key of the packet in the lookup's first stage
        with m.If(lookup.o.ready):
            m.d.sync += a_rkey.eq(self.header.payload.reth.rkey)
        for table in (lookup.table, decide.table):
            for j in range(J):
                c, t = config[j], table.job[j]
                m.d.comb += [t.enable.eq(c.enable), t.workers.eq(c.workers),
                             t.slot_base.eq(c.slot_base), t.slot_count.eq(c.slot_count),
                             t.credits.eq(c.credits), t.quorum.eq(c.quorum),
                             t.key.eq(c.key), t.deadline.eq(c.deadline),
                             t.completed.eq(completed[j])]
                if self.bug is Bug.KEY_UNCHECKED and table is lookup.table:
                    m.d.comb += t.key.eq(a_rkey)
            for i in range(J * MW):
                m.d.comb += [table.worker_port[i].eq(self.worker_port[i]),
                             table.worker_ip[i].eq(self.worker_ip[i])]
        wiring.connect(m, wiring.flipped(self.header), lookup.header)
        wiring.connect(m, lookup.o, decide.i)
        o = lookup.o.payload
        decided = decide.decided
        completes = decide.job_event[JOB_EVENTS.index("completed")]
        m.d.comb += [
            lookup.barrier.eq(self.barrier), decide.go.eq(self.go), decide.now.eq(now),
            lookup.completing.eq(decided & completes),
            lookup.completing_job.eq(o.imm.job),
        ]
        for j in range(J):
            with m.If(decided & completes & (o.imm.job == j)):
                m.d.sync += completed[j].eq(completed[j] + 1)

        layout = slot_state(MW)
        words = [Signal(layout.size, name=f"slot{s}_state") for s in range(S)]
        state = [layout(word) for word in words]
        copies = Signal(layout)
        m.d.comb += copies.eq(Array(words)[o.index])
        va = H.CONTRIBUTION_VA(o.header.reth.va)
        m.d.comb += decide.copies.eq(copies)
        for v in range(2):
            if self.bug is Bug.BITMAP_IGNORED:
                m.d.comb += decide.copies[v].bitmap.eq(0)
            if self.bug is Bug.STALE_MSN_TAKEN:
                m.d.comb += decide.copies[v].msn.eq(va.msn[:16])
        with m.If(decide.state.en):
            m.d.sync += Array(words)[decide.state.addr].eq(decide.state.data)

        self._model(m, decide, o, va, config, completed, now, state)
        return m

    def _model(self, m, decide, o, va, config, completed, now, state):
        """The model of each copy's use, and the properties asserted against it."""
        J, MW, S = self.jobs, self.max_workers, self.slots
        uses = [[Signal(USE, name=f"slot{s}_use{v}") for v in range(2)] for s in range(S)]
        imm, header, cmd = o.imm, o.header, decide.command
        rank, version, index = imm.rank, imm.version, o.index
        decided = decide.decided
        job = Array(config)[imm.job[:max(1, (J - 1).bit_length())]]
        job_known = imm.job < J
        completed_now = Array(completed)[imm.job[:max(1, (J - 1).bit_length())]]

        def effective_quorum(c):
            return Mux((c.quorum == 0) | (c.quorum >= c.workers), c.workers, c.quorum)

        def workers_mask(c):
            return ((Const(1, MW + 1) << c.workers) - 1)[:MW]

        def in_range(c, slot):
            return c.enable & (slot >= c.slot_base) & (slot < c.slot_base + c.slot_count)

        use = Signal(USE)               # the use of the decided packet's copy
        for s in range(S):
            for v in range(2):
                with m.If((index == s) & (version == v)):
                    m.d.comb += use.eq(uses[s][v])
        bit = Signal(8)
        m.d.comb += bit.eq(Const(1, 8) << rank)
        msn = va.msn[:16]
        action = cmd.action
        adds = decided & (action == Action.ADD)
        overwrites = decided & (action == Action.OVERWRITE)
        sums_change = adds | overwrites
        after = Signal(USE)             # the use once the command is carried out
        m.d.comb += after.eq(use)
        with m.If(overwrites):
            m.d.comb += [after.used.eq(1), after.ranks.eq(bit), after.data.eq(~header.null),
                         after.msn.eq(msn), after.begun.eq(now), after.complete.eq(cmd.emit)]
        with m.If(adds):
            m.d.comb += [after.ranks.eq(use.ranks | bit), after.data.eq(use.data + ~header.null),
                         after.complete.eq(cmd.emit)]
        with m.If(decided & (action == Action.CLOSE)):
            m.d.comb += after.complete.eq(1)
        for s in range(S):
            for v in range(2):
                with m.If(decided & (index == s) & (version == v)):
                    m.d.sync += uses[s][v].eq(after)

        checks = []

        def check(prop, test, name):
            if prop in self.properties:
                checks.append(Assert(test, name, src_loc_at=1))

        # 1. exactly once
        check(Property.EXACTLY_ONCE, ~adds | (use.used & ~use.complete & ~(use.ranks & bit).any()),
              "an ADD comes from a rank not yet in a use in progress")
        check(Property.EXACTLY_ONCE, ~overwrites | ~use.used | use.complete,
              "an OVERWRITE begins a use only over a complete one")
        # 2. complete
        all_workers = workers_mask(job)
        quorum = effective_quorum(job)
        finishing = sums_change & cmd.emit
        check(Property.COMPLETE, ~finishing | ((popcount(after.ranks) == quorum)
                                               & (cmd.desc.dests == all_workers)
                                               & (cmd.desc.count == after.data)),
              "a result leaves at the quorum, to every worker, with the use's count")
        check(Property.COMPLETE, ~sums_change | cmd.emit | (popcount(after.ranks) < quorum),
              "a use at its quorum completes")
        age = Signal(R.DEADLINE_BITS)
        m.d.comb += age.eq(now - use.begun)
        closes = decided & (action == Action.CLOSE)
        check(Property.COMPLETE, ~closes | (use.used & ~use.complete & (job.deadline != 0)
                                            & (age >= job.deadline)
                                            & (cmd.desc.count == use.data)
                                            & (cmd.desc.dests == all_workers)),
              "a use closes short only past its deadline, with its count, to every worker")
        replays = decided & (action == Action.REPLAY)
        check(Property.COMPLETE, ~replays | (use.complete & (msn == use.msn)
                                             & (cmd.desc.count == use.data)
                                             & (cmd.desc.dests == bit[:MW])),
              "a replay answers a complete use's message, to its one worker")
        check(Property.COMPLETE, ~(decided & (action == Action.DRAIN) & cmd.emit),
              "a drained packet sends nothing")
        # 3. nothing stale, nothing beyond the credits
        check(Property.NOT_STALE, ~adds | (msn == use.msn),
              "an ADD carries its use's message number")
        later = Signal(signed(16))
        m.d.comb += later.eq(msn - use.msn)
        check(Property.NOT_STALE, ~overwrites | ~use.used | (later > 0),
              "an OVERWRITE begins a later message than the copy's last")
        ahead = Signal(32)
        m.d.comb += ahead.eq(va.msn - completed_now)
        check(Property.NOT_STALE, ~sums_change | (job.credits == 0) | ahead[-1]
              | (ahead < job.credits), "a contribution that changes a sum is within credits")
        # 4. isolation
        touches = decided & (decide.state.en | (action != Action.DRAIN) | cmd.emit)
        contribution = header.bth.opcode == C.OP_CONTRIBUTION
        check(Property.ISOLATION, ~(touches & contribution)
              | (job_known & in_range(job, index) & (index < S)
                 & (decide.state.addr == index) & (cmd.index == index)
                 & (cmd.desc.job == imm.job) & ((cmd.desc.dests & ~all_workers) == 0)),
              "a contribution changes only its own job's slot and result")
        for k in range(J):
            check(Property.ISOLATION, ~(decided & decide.state.en & (imm.job != k)
                                        & in_range(config[k], decide.state.addr)),
                  f"no other job's contribution writes job {k}'s slots")
        events = Cat(decide.port_event, decide.job_event)
        drops = Cat(*(Const(int(name in DROPS), 1) for name in (*PORT_EVENTS, *JOB_EVENTS)))
        wrong_key = decided & contribution & job_known & (header.reth.rkey != job.key)
        check(Property.ISOLATION, ~wrong_key | (~decide.state.en & (action == Action.DRAIN)
                                                & ~cmd.emit & (popcount(events) == 1)
                                                & ((events & ~drops) == 0)),
              "a wrong key changes nothing but its drop counter")
        m.d.comb += checks

        if self.invariants:
            self._invariants(m, o, uses, state, config, completed, decide)
        self._covers(m, decide, use, after, overwrites)

    def _invariants(self, m, o, uses, state, config, completed, decide):
        """The state agrees with the model: each used copy's bitmap is its use's ranks, its
        count the number of them while the use is in progress (below its job's quorum), 0
        once complete; its data count, msn and start are the use's; an unused copy is empty.
        A slot outside every enabled job's range is never used. The lookup stage's second
        register holds what it judged of its packet with the configuration it has now."""
        J, MW, S = self.jobs, self.max_workers, self.slots
        for s in range(S):
            owner = [config[j].enable & (s >= config[j].slot_base)
                     & (s < config[j].slot_base + config[j].slot_count) for j in range(J)]
            quorum = Signal(6, name=f"slot{s}_quorum")
            workers = Signal(6, name=f"slot{s}_workers")
            for j in range(J):
                c = config[j]
                with m.If(owner[j]):
                    m.d.comb += [quorum.eq(Mux((c.quorum == 0) | (c.quorum >= c.workers),
                                               c.workers, c.quorum)),
                                 workers.eq(c.workers)]
            for v in range(2):
                copy, use = state[s][v], uses[s][v]
                mask = ((Const(1, MW + 1) << workers) - 1)[:MW]
                m.d.comb += Assert(use.used == (copy.bitmap != 0))
                m.d.comb += Assert(use.used | (copy.as_value() == 0))
                m.d.comb += Assert(~use.used | Cat(*owner).any())
                with m.If(use.used):
                    m.d.comb += [
                        Assert(copy.bitmap == use.ranks[:MW]),
                        Assert(use.ranks[MW:] == 0),
                        Assert((copy.bitmap & ~mask) == 0),
                        Assert(copy.msn == use.msn),
                        Assert(copy.begun == use.begun),
                        Assert(copy.data == use.data),
                        Assert(use.data <= popcount(copy.bitmap)),
                        Assert(use.complete == (copy.count == 0)),
                        Assert(use.complete | ((copy.count == popcount(copy.bitmap))
                                               & (copy.count < quorum))),
                        Assert(~use.complete | (popcount(copy.bitmap) >= 1)),
                    ]
        # The packet in decide was judged with the configuration and COMPLETED it meets.
        contribution = o.header.bth.opcode == C.OP_CONTRIBUTION
        m.d.comb += [
            Assert(o.look <= max(Look)),
            Assert(~contribution | ((o.look != Look.CONTROL) & (o.look != Look.UNHANDLED))),
            Assert((o.look != Look.CONTROL) | H.is_control(o.header.bth)),
        ]
        with m.If(o.look == Look.AGGREGATE):
            job = Array(config)[o.imm.job[:max(1, (J - 1).bit_length())]]
            c_completed = Array(completed)[o.imm.job[:max(1, (J - 1).bit_length())]]
            ahead = Signal(32)
            m.d.comb += ahead.eq(H.CONTRIBUTION_VA(o.header.reth.va).msn - c_completed)
            m.d.comb += [
                Assert(o.imm.job < J), Assert(job.enable),
                Assert(o.header.reth.rkey == job.key),
                Assert(o.imm.rank < job.workers),
                Assert(o.imm.slot < job.slot_count),
                Assert(o.index == job.slot_base + o.imm.slot),
                Assert(o.index < S),
                Assert((job.credits == 0) | ahead[-1] | (ahead < job.credits)),
                Assert(o.header.bth.opcode == C.OP_CONTRIBUTION),
                Assert(o.workers == job.workers),
                Assert(o.quorum == Mux((job.quorum == 0) | (job.quorum >= job.workers),
                                       job.workers, job.quorum)),
                Assert((o.header.payload_length >= 4)
                       & (o.header.payload_length <= self.max_payload)),
            ]

    def _covers(self, m, decide, use, after, overwrites):
        """Each property's states, reached."""
        decided, cmd = decide.decided, decide.command
        MW = self.max_workers

        def event(name):
            return decided & decide.job_event[JOB_EVENTS.index(name)]

        m.d.comb += [
            Cover(decided & cmd.emit & (cmd.action == Action.ADD), "a use completes"),
            Cover(decided & cmd.emit & (cmd.action == Action.ADD)
                  & (after.ranks == (1 << MW) - 1), f"a use of {MW} ranks completes"),
            Cover(event("replays") & (popcount(use.ranks) > 1),
                  "a use of several ranks is replayed"),
            Cover(event("duplicates"), "a duplicate is dropped"),
            Cover(event("replays"), "a complete use is replayed"),
            Cover(event("closed_late"), "a use closes at its deadline"),
            Cover(event("drop_stale"), "a stale message is dropped"),
            Cover(event("drop_credit"), "a message beyond the credits is dropped"),
            Cover(event("drop_bad_key"), "a wrong key is dropped"),
            Cover(overwrites & use.used, "a copy begins its next use"),
        ]
