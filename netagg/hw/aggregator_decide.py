"""The aggregator's decide stage: what a packet does to its slot, exactly once.

Takes each looked-up packet (`i`) with its slot's state (`copies`, read by the lookup stage:
for each of the slot's two versions, the shadow copies of SwitchML, its contributors, their
number, how many brought data, the payload length, the message number of its use and the
tick it began at) and
decides: start a new use (overwrite) for a later message, add to the use in progress, send a
completed use's result again to the one worker (replay, for a message of the use's length),
or drop a duplicate or a stale message; a use completes at the job's quorum of
contributions, or closes short when a duplicate (a retransmission) finds it at least the
job's DEADLINE ticks old (`now` minus the tick it began at, modulo 2**DEADLINE_BITS): its
result goes to every worker, as a completion's does. It writes the slot's new state
(`state`), queues a command for the payload stages (`command`, when `decided`) and gives the
packet's events (`port_event`, `job_event`), among them each drop: a packet the lookup stage
judged bad, a message other than its copy's use (stale), a duplicate contribution to a use
in progress, or a contribution of another length than the use's (in progress or completed).
A control request that is not served (a bad length) is `unserved`: its barrier lifts. On a
leaf, a spine's frame (`_parent`) completes a use gone up with the spine's result, or
answers a pull with the copy's partial or final.

Latency: none of its own (combinational: the command is written to the queue in the cycle
the packet is decided); the stage moves with the lookup stage when `go` (the command queue
has room).
"""

import contextlib
import dataclasses

from amaranth import Array, Const, Module, Mux, Signal, Value, signed
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from netagg.contract import regmap as R

from . import headers as H
from .aggregator_command import Action, command, slot_state
from .aggregator_lookup import Look, looked_up
from .control import JOB_EVENTS, PORT_EVENTS, JobTable
from .fabric import NO_FABRIC, UPLINK, Fabric

# The counter of each verdict of the lookup stage that drops the packet.
DROPPED = {
    Look.UNHANDLED: "drop_unhandled", Look.BAD_PAYLOAD: "drop_bad_payload",
    Look.BAD_JOB: "drop_bad_job", Look.BAD_WORKER: "drop_bad_worker",
    Look.BAD_KEY: "drop_bad_key",
    Look.BAD_SLOT: "drop_bad_slot", Look.BAD_CREDIT: "drop_credit",
}


def state_write(slots: int, max_workers: int, fabric: Fabric = NO_FABRIC):
    """A write of the slots' state: the slot (`addr`), its new state, and whether to write
    it (`en`)."""
    return data.StructLayout(
        {"addr": range(slots), "data": slot_state(max_workers, fabric), "en": 1})


@dataclasses.dataclass(frozen=True)
class SpineFrame:
    """A spine's contribution as the decide stage reads it: its PARTIAL (BTH.psn) and, for
    a job that takes partials, whether it is a final, a re-send, and whether it gives up the
    use in progress of its copy for a later one (`abandon`)."""
    part: data.View
    final: Value
    resent: Value
    abandon: Value


@dataclasses.dataclass(frozen=True)
class LeafFrame:
    """A contribution at a leaf as the decide stage reads it: whether its job has a parent,
    whether it has a parent or takes partials (`fabric`), whether its copy's use went up
    (UPSTREAM), the uplink of its slot (`found`: one is up), and the replay or completion it
    makes (`replaying`, `completing`)."""
    parent: Value
    fabric: Value
    upstream: Value
    uplink: Value
    found: Value
    replaying: Value
    completing: Value


class Decide(wiring.Component):
    def __init__(self, *, ports: int, jobs: int, max_workers: int, slots: int,
                 fabric: Fabric = NO_FABRIC):
        self.ports, self.jobs, self.max_workers, self.slots = ports, jobs, max_workers, slots
        self.fabric = fabric
        more = {} if not fabric.any else {
            "fabric_event": Out(max(len(fabric.events), 1)),    # with `decided`
        }
        if fabric.uplinks:
            more |= {"uplinks": In(UPLINK).array(fabric.uplinks),    # a leaf's uplink table
                     "uplink_down": In(fabric.uplinks)}
        super().__init__({
            **more,
            "i": In(stream.Signature(looked_up(ports, slots, fabric))),
            "go": In(1),                  # the command queue has room: take `i`
            "copies": In(slot_state(max_workers, fabric)),   # the state of `i`'s slot
            "now": In(R.DEADLINE_BITS),   # the switch's tick count
            "table": In(JobTable(jobs, max_workers, fabric)),
            "state": Out(state_write(slots, max_workers, fabric)),
            "command": Out(command(ports, slots, max_workers, fabric)),
            "decided": Out(1),            # a packet decided, its command queued
            "unserved": Out(1),           # a control request dropped
            "port_event": Out(len(PORT_EVENTS)),    # with `decided`
            "job_event": Out(len(JOB_EVENTS)),
        })

    def elaborate(self, platform):
        m = Module()
        P, MW, J = self.ports, self.max_workers, self.jobs
        b, b_look, b_imm = self.i.payload.header, self.i.payload.look, self.i.payload.imm
        m.d.comb += self.i.ready.eq(self.go)

        version = b_imm.version
        va = H.CONTRIBUTION_VA(b.reth.va)        # the message's number and its chunk's offset
        mine = self.copies[version]
        bit = Signal(MW)
        m.d.comb += bit.eq(Const(1, MW) << b_imm.rank)
        new_count = Signal(7)
        m.d.comb += new_count.eq(mine.count + 1)
        finishes = new_count >= self.i.payload.quorum  # a quorum written lower meanwhile: now
        new_data = Signal(6)
        m.d.comb += new_data.eq(Mux(mine.count == 0, 0, mine.data) + ~b.null)
        # The credit limit a result carries: the job's completed uses (this one included)
        # plus its credits, as a running total.
        b_job = Array(self.table.job)[b_imm.job[: max(1, (J - 1).bit_length())]]
        limit = Signal(24)
        m.d.comb += limit.eq(b_job.completed + b_job.credits + finishes)
        cmd = self.command
        desc = cmd.desc
        m.d.comb += [
            cmd.port.eq(b.port), cmd.index.eq(self.i.payload.index), cmd.null.eq(b.null),
            cmd.has_payload.eq((b.payload_length != 0)
                               & (~b.null | (cmd.action != Action.DRAIN))),
            desc.job.eq(b_imm.job), desc.slot.eq(b_imm.slot), desc.version.eq(version),
            desc.count.eq(new_data), desc.exponent.eq(b_imm.exponent),
            desc.offset.eq(va.offset), desc.length.eq(b.payload_length),
            desc.psn.eq(Mux(b_look == Look.CONTROL, b.bth.psn, limit)),
            cmd.action.eq(Action.DRAIN),
        ]
        new_state = Signal(slot_state(MW, self.fabric))
        m.d.comb += new_state.eq(self.copies)
        update = Signal()
        distance = self._distance(m, b_job, mine, va)

        spine = leaf = None
        if self.fabric.spine:
            spine = self._spine(m, b_job, mine, distance, new_count, new_data, va)
        if self.fabric.uplinks:
            leaf = self._leaf(m, b_job, b_imm, mine)
        self._up = leaf
        verdicts = contextlib.nullcontext()
        if leaf is not None:
            with m.If(self.i.payload.parent):
                self._parent(m, mine, new_state[version], distance, b_job, limit, update)
            verdicts = m.Else()
        with verdicts, m.Switch(b_look):
            for look, counter in DROPPED.items():
                with m.Case(look):
                    m.d.comb += self._count(counter)
            with m.Case(Look.CONTROL):
                m.d.comb += [
                    self._count("control"), cmd.action.eq(Action.CONTROL), cmd.emit.eq(1),
                    desc.control.eq(1), cmd.ports.eq(Const(1, P) << b.port),
                ]
            with m.Case(Look.AGGREGATE):
                self._aggregate(m, mine, new_state[version], bit, distance, new_count,
                                new_data, finishes, limit, b_job, update, va.msn, spine)
                if leaf is not None:
                    self._leaf_use(m, new_state[version], update, leaf)
        decided = self.decided
        m.d.comb += [
            decided.eq(self.go & self.i.valid),
            self.state.addr.eq(self.i.payload.index), self.state.data.eq(new_state),
            self.state.en.eq(decided & update),
            self.unserved.eq(decided & H.is_control(b.bth) & (b_look != Look.CONTROL)),
        ]
        return m

    def _distance(self, m, b_job, mine, va):
        """d, of this message from its copy's use: signed16 of the msns' low 16 bits; on a
        switch that takes partials, a spine's job's (CONFIG.partials) signed32 of the whole
        msns, which its copies keep."""
        near = Signal(signed(16), name="distance" if not self.fabric.spine else "near")
        if not self.fabric.spine:
            m.d.comb += near.eq(va.msn[:16] - mine.msn)
            return near
        far, distance = Signal(signed(32)), Signal(signed(32))
        m.d.comb += [near.eq(va.msn[:16] - mine.msn[:16]), far.eq(va.msn - mine.msn),
                     distance.eq(Mux(b_job.partials, far, near))]
        return distance

    def _count(self, name):
        """The packet's event `name`, of its port or of its job (a fabric switch's too)."""
        if name in PORT_EVENTS:
            return self.port_event[PORT_EVENTS.index(name)].eq(1)
        if name in self.fabric.events:
            return self.fabric_event[self.fabric.events.index(name)].eq(1)
        return self.job_event[JOB_EVENTS.index(name)].eq(1)

    def _event(self, name):
        """A replay's or a completion's event: counted at once on a switch without uplinks;
        on a leaf, noted (`LeafFrame`), for `_leaf_use` to count it or send a partial up."""
        if self._up is None:
            return self._count(name)
        return {"replays": self._up.replaying, "completed": self._up.completing}[name].eq(1)

    def _leaf(self, m, b_job, b_imm, mine):
        """What a leaf's job with a parent (PARENT.enable) changes: its `LeafFrame` (the
        copy gone up, the uplink of the slot: its SPRAY entry, or the next one up)."""
        N = self.fabric.uplinks
        entry = Signal(R.SPRAY_BITS)
        m.d.comb += entry.eq(b_job.spray.word_select(b_imm.slot[:4], R.SPRAY_BITS))
        chosen, found = Signal(range(max(N, 2))), Signal()
        with m.Switch(entry):
            for e in range(1 << R.SPRAY_BITS):
                with m.Case(e):
                    for k in reversed(range(N)):
                        with m.If(~self.uplink_down[(e + k) % N]):
                            m.d.comb += [chosen.eq((e + k) % N), found.eq(1)]
        parent = b_job.parent[R.PARENT.bits("enable")[0]]
        return LeafFrame(parent=parent, fabric=b_job.partials | parent,
                         upstream=(b_job.partials | parent) & mine.upstream, uplink=chosen,
                         found=found, replaying=Signal(name="replaying"),
                         completing=Signal(name="completing"))

    def _leaf_use(self, m, new, update, leaf):
        """A leaf's replay and completion: a retransmission to a use gone up re-sends its
        partial, marked `resent` (`resends`); a parent job's use that completes here goes up
        (UPSTREAM: its partial to the slot's uplink, `upstream`, or none up, `no_uplink`),
        and is not complete for its workers (COMPLETED does not move)."""
        count = self._count
        with m.If(leaf.replaying):
            with m.If(leaf.upstream):
                m.d.comb += count("resends")
                self._send_up(m, leaf, resent=1)
            with m.Else():
                m.d.comb += count("replays")
        with m.If(leaf.completing):
            with m.If(leaf.parent):
                self._send_up(m, leaf, resent=0)
            with m.Else():
                m.d.comb += count("completed")
        with m.If(update & leaf.fabric):
            # a job with neither a parent nor partials leaves the marks as they were
            m.d.comb += [new.upstream.eq(leaf.completing & leaf.parent),
                         new.done.eq(leaf.completing & ~leaf.parent)]

    def _parent(self, m, mine, new, distance, b_job, limit, update):
        """A spine's frame that passed the lookup's checks (`parent_ok`): a result of the use
        its copy sent up (UPSTREAM, the use's msn, the use's length) makes the copy DONE with
        the result's sums, count, exponent and overflow as they are, COMPLETED + 1, and goes
        to every local worker (`parent_results`); a pull (no payload) of the copy's use,
        UPSTREAM or DONE, is answered (`pulled`); anything else is `drop_parent`."""
        MW = self.max_workers
        b, cmd, count = self.i.payload.header, self.command, self._count
        desc, result = cmd.desc, H.RESULT_IMM(b.immdt.data)
        ours = (mine.bitmap != 0) & (mine.count == 0) & (distance == 0)
        with m.If(self.i.payload.parent_ok & ours & mine.upstream & (b.payload_length != 0)
                  & (b.payload_length == mine.length)):
            m.d.comb += [
                update.eq(1), new.upstream.eq(0), new.done.eq(1), new.data.eq(result.count),
                count("parent_results"), count("completed"),
                cmd.action.eq(Action.OVERWRITE), cmd.emit.eq(1),
                desc.count.eq(result.count), desc.overflow.eq(result.overflow),
                desc.dests.eq((Const(1, MW + 1) << self.i.payload.workers) - 1),
                cmd.ports.eq(self.i.payload.completion_ports),
                limit.eq(b_job.completed + b_job.credits + 1),
            ]
        with m.Elif(self.i.payload.parent_ok & ours & (b.payload_length == 0)
                    & (mine.upstream | mine.done)):
            # a pull: the copy's partial, or its final marked `final`, up the uplink the
            # pull came by, its rows read as a replay's from zeros of the copy's length
            port = Array(self.uplinks)[b.uplink].port
            m.d.comb += [
                count("pulled"), count("upstream"), cmd.emit.eq(1),
                cmd.action.eq(Action.REPLAY), cmd.null.eq(1), cmd.has_payload.eq(1),
                desc.length.eq(mine.length), desc.count.eq(mine.data),
                desc.up.eq(1), desc.uplink.eq(b.uplink), desc.resent.eq(0),
                desc.final.eq(~mine.upstream), desc.dests.eq(1),
                cmd.ports.eq((Const(1, self.ports) << port)[:self.ports]),
            ]
        with m.Else():
            m.d.comb += count("drop_parent")

    def _send_up(self, m, leaf, resent):
        """The command sends the copy's sums up the slot's uplink as a partial (one frame,
        from the uplink table's header template), or nothing when every uplink is down."""
        P = self.ports
        cmd, desc = self.command, self.command.desc
        with m.If(leaf.found):
            port = Array(self.uplinks)[leaf.uplink].port
            m.d.comb += [
                self._count("upstream"), cmd.emit.eq(1), desc.up.eq(1),
                desc.uplink.eq(leaf.uplink), desc.resent.eq(resent), desc.dests.eq(1),
                cmd.ports.eq((Const(1, P) << port)[:P]),
            ]
        with m.Else():
            m.d.comb += [self._count("no_uplink"), cmd.emit.eq(0)]

    def _spine(self, m, b_job, mine, distance, new_count, new_data, va):
        """What a spine's job (CONFIG.partials) changes: a contribution is a leaf's partial
        (BTH.psn `PARTIAL`), whose count the data count adds and whose overflow the sums
        take; a later use of a copy in progress gives that use up (`abandon`) and begins;
        results carry the use's CONTRIBUTION_VA. Its `SpineFrame`."""
        b = self.i.payload.header
        part = H.PARTIAL(b.bth.psn)
        partials = b_job.partials
        abandon = Signal()
        m.d.comb += abandon.eq(partials & (mine.count != 0) & (distance > 0))
        with m.If(abandon):
            m.d.comb += new_count.eq(1)
        m.d.comb += new_data.eq(Mux((mine.count == 0) | abandon, 0, mine.data)
                                + Mux(partials, part.count, ~b.null))
        desc = self.command.desc
        m.d.comb += [desc.fabric_va.eq(partials), desc.msn.eq(va.msn),
                     desc.overflow.eq(partials & part.overflow)]
        with m.If(desc.pull & (self.command.action == Action.DRAIN)):
            m.d.comb += self.command.has_payload.eq(b.payload_length != 0)
        return SpineFrame(part=part, final=partials & part.final,
                          resent=partials & part.resent, abandon=abandon)

    def _aggregate(self, m, mine, new, bit, distance, new_count, new_data, finishes, limit,
                   b_job, update, msn, spine):
        """A contribution that passed the lookup's checks, against its copy (`mine`): a
        replay, a drop, or a contribution that updates the copy (`new`) and may complete
        the use; on a spine (`spine`, a `SpineFrame`), a partial."""
        MW = self.max_workers
        b = self.i.payload.header
        cmd = self.command
        desc = cmd.desc
        count = self._count
        seen = (mine.bitmap & bit).any()
        idle = mine.count == 0              # no use in progress: the last one completed
        fresh = mine.bitmap == 0            # never used since the job's slots were cleared
        new_use = idle & (fresh | (distance > 0))
        if self._up is not None:
            # a use gone up: its copy's next use waits for the parent's result (stale)
            new_use = idle & (fresh | ((distance > 0) & ~self._up.upstream))
        if spine is not None:
            # a final of the use's length is no duplicate: it completes the use as it is
            seen = seen & ~(spine.final & (mine.length == self.i.payload.header.payload_length))
            new_use = new_use | spine.abandon
        age = Signal(R.DEADLINE_BITS)
        m.d.comb += age.eq(self.now - mine.begun)
        late = (b_job.deadline != 0) & (age >= b_job.deadline)
        with m.If(idle & ~new_use & (distance == 0)):
            # The result's rows go out with the request's payload beats: a request of another
            # length than the use's would send a part of the sums, or rows beyond them.
            with m.If(mine.length != b.payload_length):
                m.d.comb += count("drop_bad_length")
            with m.Else():
                m.d.comb += [
                    self._event("replays"), cmd.action.eq(Action.REPLAY), cmd.emit.eq(1),
                    desc.dests.eq(bit), cmd.ports.eq(self.i.payload.worker_port),
                    desc.count.eq(mine.data), limit.eq(b_job.completed + b_job.credits),
                ]
        with m.Elif(~new_use & (distance != 0)):
            m.d.comb += count("drop_stale")
        with m.Elif(~new_use & seen & late & (mine.length == b.payload_length)):
            # A retransmission past the job's deadline: the use closes with what it has, and
            # its result, read from the sums, goes to every worker.
            m.d.comb += [
                update.eq(1), new.count.eq(0),
                count("closed_late"), self._event("completed"),
                cmd.action.eq(Action.CLOSE), cmd.emit.eq(1), desc.count.eq(mine.data),
                desc.dests.eq((Const(1, MW + 1) << self.i.payload.workers) - 1),
                cmd.ports.eq(self.i.payload.completion_ports),
                limit.eq(b_job.completed + b_job.credits + 1),
            ]
        with m.Elif(~new_use & seen):
            m.d.comb += count("duplicates")
            if spine is not None:
                with m.If(spine.resent):
                    self._pull(m, mine.bitmap, b_job, limit)
        with m.Elif(~new_use & (mine.length != b.payload_length)):
            m.d.comb += count("drop_bad_length")
        with m.Else():
            m.d.comb += [
                update.eq(1), count("contributions"),
                cmd.action.eq(Mux(new_use, Action.OVERWRITE, Action.ADD)),
                new.bitmap.eq(Mux(new_use, bit, mine.bitmap | bit)),
                new.count.eq(Mux(finishes, 0, new_count)),
                new.data.eq(new_data),
                new.length.eq(b.payload_length),
                new.msn.eq(msn[:len(new.msn)]),
                new.begun.eq(Mux(new_use, self.now, mine.begun)),
            ]
            with m.If(finishes):
                m.d.comb += [
                    self._event("completed"), cmd.emit.eq(1),
                    desc.dests.eq((Const(1, MW + 1) << self.i.payload.workers) - 1),
                    cmd.ports.eq(self.i.payload.completion_ports),
                ]
            if spine is not None:
                self._spine_use(m, mine, new, bit, new_use, finishes, limit, b_job, spine)

    def _spine_use(self, m, mine, new, bit, new_use, finishes, limit, b_job, spine):
        """A spine's partial taken into its copy (`new`): one that gives a use up counts
        `abandoned`; a final completes the use with its sums, count, exponent and overflow
        as they are (`finals`); a resent partial that leaves the use in progress pulls the
        leaves missing from it."""
        MW = self.max_workers
        cmd, desc, count = self.command, self.command.desc, self._count
        with m.If(spine.abandon):
            m.d.comb += count("abandoned")
        with m.If(spine.final):
            m.d.comb += [
                count("finals"), self._event("completed"), cmd.emit.eq(1),
                cmd.action.eq(Action.OVERWRITE), new.count.eq(0),
                new.data.eq(spine.part.count), desc.count.eq(spine.part.count),
                new.bitmap.eq(Mux(new_use, bit, mine.bitmap | bit)),
                desc.dests.eq((Const(1, MW + 1) << self.i.payload.workers) - 1),
                cmd.ports.eq(self.i.payload.completion_ports),
                limit.eq(b_job.completed + b_job.credits + 1),
            ]
        with m.Elif(spine.resent & ~finishes):
            self._pull(m, new.bitmap, b_job, limit)

    def _pull(self, m, bitmap, b_job, limit):
        """A spine's pulls of the use to every leaf of the job whose bit is clear in
        `bitmap`: one payload-less result frame each, from the packet's last beat."""
        MW = self.max_workers
        cmd, desc = self.command, self.command.desc
        m.d.comb += [
            cmd.emit.eq(1), desc.pull.eq(1), desc.count.eq(0),
            desc.dests.eq(((Const(1, MW + 1) << self.i.payload.workers) - 1) & ~bitmap),
            cmd.ports.eq(self.i.payload.completion_ports),
            limit.eq(b_job.completed + b_job.credits),
        ]
