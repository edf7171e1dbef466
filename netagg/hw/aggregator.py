"""Aggregator: the slot pool, exactly-once aggregation, and the control path.

Takes committed packets one after another (header entry from the arbiter, then the payload,
wide beats of `width` bits, from the packet's ingress port) and gives the egress ports the
result packets' payloads, each with a descriptor on its last beat and the mask of the ports
that send it. Its parts, one a file:

- lookup (`hw.aggregator_lookup.Lookup`; 2 cycles: the header, then its verdict):
  classifies the packet (contribution, control request, or unhandled), checks its payload
  length, job, rank and source IP, key (RETH.rkey, the job's KEY), slot, and credit (its
  message number, the top half of RETH.va, below the job's completed uses, the one the
  packet in decide completes included, plus its credits), and reads the slot's state;
- decide (`hw.aggregator_decide.Decide`; combinational, its command queue adds a cycle):
  with the slot's state (for each of its two versions: bitmap, count, data contributions,
  length, the message number of its use and the tick it began at) decides: start a new use
  (overwrite) for a later message, add to the use in progress, send a completed use's result
  again to the one worker (replay, for a message of the use's length), or drop a duplicate
  or a stale message; a use completes at the job's quorum of contributions, or closes short
  when a retransmission finds it past the job's deadline (in ticks, `tick`); updates the
  state and queues a command (`hw.aggregator_command`);
- sums (`hw.aggregator_sums.Sums`; one wide beat per cycle, 1 cycle a beat): reads each row of
  the slot's sums, adds the beat's int32 lanes with saturation (an overflow bit and the
  exponent, the maximum, are kept per row), writes the row back, and, when the packet
  completed the slot or is a replay, sends the row on as the result's payload. A null
  contribution (its payload dropped by priority at ingress) brings zeros, made there;
- records (`hw.aggregator_records.Records`): for a control request, applies each record to
  `Control`'s registers (`control`) and sends the reply through the sums' output stage;
- clearing (`hw.aggregator_clearing.Clearing`): clears the slots of each job whose CONFIG a
  request wrote, one slot per cycle.

The semantics are those of `sim.golden` (the shadow copies of SwitchML, tagged with the
use's message number; the count that returns to 0 on completion; a result's count of the
contributions that brought data, and its PSN the job's credit limit). A packet is dropped
and counted (`port_events`/`job_events`) if its payload length is wrong, its job is unknown
or disabled, its rank or source IP is not the job's, its key is not the job's, its slot is
outside the job's range, it is beyond the job's credit, it is a message other than its slot
copy's use (stale), or it is a duplicate of a contribution to a use in progress; a packet
that is neither a contribution nor a control request is dropped as unhandled. Every dropped
packet's payload is drained.

A control request is a barrier: no packet behind it is looked up until its records are
applied (and the slots of any job whose CONFIG it wrote are cleared, one slot per cycle). Its
reply goes out of the port it came in on, whose ingress holds the request's addresses
(`hw.ingress.Ingress.reply_to`); a request that is not served releases them (`reply_dropped`).

Throughput: one header per cycle and one payload beat per cycle, with no gap between packets.
Latency: the first result beat leaves 4 cycles after the header is taken, when the packet's
payload is waiting. What the parts hand each other is declared in `hw.aggregator_command`."""

from amaranth import Const, Module, Signal
from amaranth.lib import fifo, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from netagg.contract import regmap as R

from .aggregator_clearing import Clearing
from .aggregator_command import command, egress_beat, slot_state
from .aggregator_decide import Decide
from .aggregator_lookup import Lookup
from .aggregator_records import Records
from .aggregator_sums import Sums
from .beat import FrameStream
from .control import JOB_EVENTS, PORT_EVENTS, JobTable, RecordPort
from .fabric import NO_FABRIC, UPLINK, Fabric
from .ingress import ingress_header


class Aggregator(wiring.Component):
    def __init__(self, *, ports: int, width: int, jobs: int, max_workers: int, slots: int,
                 max_payload: int, fabric: Fabric = NO_FABRIC):
        if max_payload * 8 < width:
            raise ValueError("the aggregator's width must not exceed the largest payload")
        self.ports, self.width, self.jobs = ports, width, jobs
        self.max_workers, self.slots, self.max_payload = max_workers, slots, max_payload
        self.fabric = fabric
        more = {} if not fabric.any else {
            "fabric_events": Out(max(len(fabric.events), 1)).array(jobs),
        }
        if fabric.uplinks:
            more |= {"uplinks": In(UPLINK).array(fabric.uplinks),    # a leaf's uplink table
                     "uplink_down": In(fabric.uplinks)}
        super().__init__({
            **more,
            "header": In(stream.Signature(ingress_header(ports, fabric))),
            "payload": In(FrameStream(width)).array(ports),
            "table": In(JobTable(jobs, max_workers, fabric)),
            "control": Out(RecordPort(ports)),   # a control request's records applied
            "egress": Out(stream.Signature(egress_beat(width, ports, max_workers, fabric))),
            "reply_dropped": Out(ports),  # a port's control request got no reply
            "port_events": Out(len(PORT_EVENTS)).array(ports),
            "job_events": Out(len(JOB_EVENTS)).array(jobs),
            "tick": In(1),                # a tick of the deadlines' clock (TICK_SECONDS)
        })

    def elaborate(self, platform):
        m = Module()
        P, MW, J, slots = self.ports, self.max_workers, self.jobs, self.slots
        m.submodules.state = state = Memory(shape=slot_state(MW, self.fabric), depth=slots,
                                            init=[])
        state_wr = state.write_port()
        state_rd = state.read_port(transparent_for=(state_wr,))
        F = self.fabric
        m.submodules.commands = commands = fifo.SyncFIFOBuffered(
            width=command(P, slots, MW, F).size, depth=4)
        go = commands.w_rdy             # lookup and decide move together, or wait

        m.submodules.lookup = lookup = Lookup(
            ports=P, jobs=J, max_workers=MW, slots=slots, max_payload=self.max_payload,
            fabric=F)
        m.submodules.decide = decide = Decide(ports=P, jobs=J, max_workers=MW, slots=slots,
                                              fabric=F)
        m.submodules.sums = sums = Sums(
            ports=P, width=self.width, max_workers=MW, slots=slots,
            max_payload=self.max_payload, fabric=F)
        m.submodules.records = records = Records(
            ports=P, width=self.width, max_workers=MW, slots=slots, fabric=F)
        m.submodules.clearing = clearing = Clearing(jobs=J, max_workers=MW, slots=slots,
                                                    fabric=F)
        table = wiring.flipped(self.table)
        wiring.connect(m, table, lookup.table, decide.table, clearing.table)
        wiring.connect(m, wiring.flipped(self.header), lookup.header)
        wiring.connect(m, lookup.o, decide.i)
        if F.uplinks:
            m.d.comb += [decide.uplinks[i].eq(u) for i, u in enumerate(self.uplinks)]
            m.d.comb += decide.uplink_down.eq(self.uplink_down)
        now = Signal(R.DEADLINE_BITS)   # ticks, wrapping
        with m.If(self.tick):
            m.d.sync += now.eq(now + 1)
        m.d.comb += decide.now.eq(now)
        m.d.comb += [
            lookup.completing.eq(
                decide.decided & decide.job_event[JOB_EVENTS.index("completed")]),
            lookup.completing_job.eq(lookup.o.payload.imm.job),
        ]
        for p in range(P):
            wiring.connect(m, wiring.flipped(self.payload[p]), sums.payload[p])
        wiring.connect(m, sums.request, records.request)
        wiring.connect(m, records.reply, sums.reply)
        wiring.connect(m, sums.egress, wiring.flipped(self.egress))
        wiring.connect(m, records.control, wiring.flipped(self.control))

        # The slots' state: read by lookup, written by decide, or cleared.
        m.d.comb += [
            state_rd.addr.eq(lookup.index), state_rd.en.eq(go), decide.copies.eq(state_rd.data),
            decide.go.eq(go),
            state_wr.addr.eq(decide.state.addr), state_wr.data.eq(decide.state.data),
            state_wr.en.eq(decide.state.en),
        ]
        with m.If(clearing.write):
            m.d.comb += [state_wr.addr.eq(clearing.slot), state_wr.data.eq(0),
                         state_wr.en.eq(1)]
        # The commands, decided one a cycle, each carried out by the sums or the records.
        m.d.comb += [
            commands.w_data.eq(decide.command), commands.w_en.eq(decide.decided),
            sums.head.payload.eq(commands.r_data), sums.head.valid.eq(commands.r_rdy),
            records.head.payload.eq(commands.r_data), records.head.valid.eq(commands.r_rdy),
            commands.r_en.eq(sums.head.ready | records.head.ready),
            records.blocked.eq(clearing.busy), clearing.served.eq(records.served),
        ]
        self._barrier(m, lookup, decide, clearing)
        self._events(m, lookup.o.payload, decide, sums)
        return m

    def _barrier(self, m, lookup, decide, clearing):
        """Raised when a control request is taken; lifted when it is dropped, or served and
        its job's slots cleared. A dropped request's port's ingress may take the next one."""
        barrier = Signal()
        m.d.comb += lookup.barrier.eq(barrier)
        with m.If(lookup.request):
            m.d.sync += barrier.eq(1)
        with m.If(decide.unserved):
            m.d.sync += barrier.eq(0)
            m.d.comb += self.reply_dropped.eq(Const(1, self.ports) << lookup.o.payload.header.port)
        with m.If(clearing.release):
            m.d.sync += barrier.eq(0)

    def _events(self, m, b, decide, sums):
        """A decided packet's events, for its port and its job; a completion's overflow, for
        its job, at its last payload beat."""
        for p in range(self.ports):
            with m.If(decide.decided & (b.header.port == p)):
                m.d.comb += self.port_events[p].eq(decide.port_event)
        for j in range(self.jobs):
            with m.If(decide.decided & (b.imm.job == j)):
                m.d.comb += self.job_events[j].eq(decide.job_event)
                if self.fabric.any:
                    m.d.comb += self.fabric_events[j].eq(decide.fabric_event)
            with m.If(sums.overflowed & (sums.overflowed_job == j)):
                m.d.comb += self.job_events[j][JOB_EVENTS.index("overflows")].eq(1)
