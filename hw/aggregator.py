"""Aggregator: the slot pool, exactly-once aggregation, and the control path.

Takes committed packets one after another (header entry from the arbiter, then the payload,
wide beats of `width` bits, from the packet's ingress port) and gives the egress ports the
result packets' payloads, each with a descriptor on its last beat and the mask of the ports
that send it. Three stages:

- lookup (1 cycle): classifies the packet (contribution, control request, or unhandled),
  checks its payload length, job, rank and source IP, slot, and credit (its message number,
  RETH.rkey, below the job's completed uses plus its credits), and reads the slot's state;
- decide (1 cycle): with the slot's state (for each of its two versions: bitmap, count,
  data contributions, length, and the message number of its use) decides: start a new use
  (overwrite) for a later message, add to the use in progress, send a completed use's result
  again to the one worker (replay), or drop a duplicate or a stale message; a use completes
  at the job's quorum of contributions; updates the state and queues a command;
- payload (one wide beat per cycle): reads each row of the slot's sums, adds the beat's int32
  lanes with saturation (an overflow bit and the exponent, the maximum, are kept per row),
  writes the row back, and, when the packet completed the slot or is a replay, sends the row
  on as the result's payload; for a control request it applies each record and sends the
  reply. A null contribution (its payload dropped by priority at ingress) brings zeros,
  made here.

The semantics are those of `sim.golden` (the shadow copies of SwitchML, tagged with the
use's message number; the count that returns to 0 on completion; a result's count of the
contributions that brought data, and its PSN the job's credit limit). A packet is dropped
and counted (`port_events`/`job_events`) if its payload length is wrong, its job is unknown
or disabled, its rank or source IP is not the job's, its slot is outside the job's range,
it is beyond the job's credit, it is a message other than its slot copy's use (stale), or it
is a duplicate of a contribution to a use in progress; a packet that is neither a
contribution nor a control request is dropped as unhandled. Every dropped packet's payload
is drained.

A control request is a barrier: no packet behind it is looked up until its records are
applied (and the slots of any job whose CONFIG it wrote are cleared, one slot per cycle). Its
reply goes out of the port it came in on, whose ingress holds the request's addresses
(`hw.ingress.Ingress.reply_to`); a request that is not served releases them (`reply_dropped`).

Throughput: one header per cycle and one payload beat per cycle, with no gap between packets.
Latency: the first result beat leaves 4 cycles after the header is taken, when the packet's
payload is waiting. What the stages hand each other is declared in `hw.aggregator_command`."""

import enum

from amaranth import Array, Cat, Const, Module, Mux, Signal, signed
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from . import headers as H
from .aggregator_command import (
    MAX_CONTROL_PAYLOAD,
    Action,
    command,
    egress_beat,
    result_descriptor,
    slot_copy,
    sums_row,
)
from .beat import BeatLayout, FrameStream
from .control import JOB_EVENTS, PORT_EVENTS
from .ingress import ingress_header


class Aggregator(wiring.Component):
    def __init__(self, *, ports: int, width: int, jobs: int, max_workers: int, slots: int,
                 max_payload: int, control):
        if max_payload * 8 < width:
            raise ValueError("the aggregator's width must not exceed the largest payload")
        self.ports, self.width, self.jobs = ports, width, jobs
        self.max_workers, self.slots, self.max_payload = max_workers, slots, max_payload
        self.rows = max_payload * 8 // width
        self.control = control
        super().__init__({
            "header": In(stream.Signature(ingress_header(ports))),
            "payload": In(FrameStream(width)).array(ports),
            "egress": Out(stream.Signature(egress_beat(width, ports, max_workers))),
            "reply_dropped": Out(ports),  # a port's control request got no reply
            "port_events": Out(len(PORT_EVENTS)).array(ports),
            "job_events": Out(len(JOB_EVENTS)).array(jobs),
        })

    def elaborate(self, platform):
        m = Module()
        ctl = self.control
        P, MW, J = self.ports, self.max_workers, self.jobs
        lanes = self.width // 32

        state_layout = data.ArrayLayout(slot_copy(MW), 2)
        m.submodules.state = state = Memory(shape=state_layout, depth=self.slots, init=[])
        state_wr = state.write_port()
        state_rd = state.read_port(transparent_for=(state_wr,))
        m.submodules.sums = sums = Memory(
            shape=sums_row(lanes), depth=self.slots * 2 * self.rows, init=[])
        sums_wr = sums.write_port()
        sums_rd = sums.read_port(transparent_for=(sums_wr,))

        cmd_layout = command(P, self.slots, MW)
        m.submodules.commands = commands = fifo.SyncFIFOBuffered(
            width=cmd_layout.size, depth=4)
        go = commands.w_rdy             # lookup and decide move together, or wait

        # --- lookup --------------------------------------------------------------------
        barrier = Signal()          # a control request is between lookup and its end
        a_valid = Signal()
        a = Signal(self.header.payload.shape(), reset_less=True)
        m.d.comb += self.header.ready.eq(go & ~barrier)
        with m.If(go):
            m.d.sync += a_valid.eq(self.header.valid & ~barrier)
            m.d.sync += a.eq(self.header.payload)

        def is_control(header):
            return H.is_control(header.bth)

        with m.If(self.header.valid & self.header.ready & is_control(self.header.payload)):
            m.d.sync += barrier.eq(1)

        imm = H.REQUEST_IMM(a.immdt.data)
        length = a.payload_length
        job_number = imm.job
        job = Array(ctl.job)[job_number[: max(1, (J - 1).bit_length())]]
        worker_index = job_number * MW + imm.rank
        worker_ip = Array(ctl.worker_ip)[worker_index]
        worker_port_number = Array(ctl.worker_port)[worker_index]
        index = Signal(17)
        m.d.comb += index.eq(job.slot_base + imm.slot)
        contribution = a.bth.opcode == H.OP_CONTRIBUTION
        control = is_control(a)
        length_ok = ((length >= 4) & (length <= self.max_payload) & (length[:2] == 0)
                     & (a.reth.dma_length == length))
        control_length_ok = (length >= 8) & (length <= MAX_CONTROL_PAYLOAD) & (length[:3] == 0)
        job_ok = (job_number < J) & job.enable
        worker_ok = (imm.rank < job.workers) & (imm.rank < MW) & (worker_ip == a.ip.src)
        slot_ok = (imm.slot < job.slot_count) & (index < self.slots)
        ahead = Signal(32)          # the message's distance beyond the job's completed uses
        m.d.comb += ahead.eq(a.reth.rkey - job.completed)
        credit_ok = (job.credits == 0) | (ahead[-1] | (ahead < job.credits))
        completion_ports = Signal(P)
        rank_ports = [Array(ctl.worker_port[j * MW + r] for j in range(J))[job_number]
                      for r in range(MW)]
        m.d.comb += completion_ports.eq(Cat(*(
            Cat(*(((rank_ports[r] == p) & (r < job.workers)) for r in range(MW))).any()
            for p in range(P))))
        worker_port = Signal(P)
        m.d.comb += worker_port.eq(Cat(*((worker_port_number == p) for p in range(P))))

        class Look(enum.IntEnum):
            UNHANDLED = 0
            BAD_PAYLOAD = 1
            BAD_JOB = 2
            BAD_WORKER = 3
            BAD_SLOT = 4
            BAD_CREDIT = 5
            CONTROL = 6
            AGGREGATE = 7

        look = Signal(Look)
        with m.If(contribution):
            with m.If(~length_ok):
                m.d.comb += look.eq(Look.BAD_PAYLOAD)
            with m.Elif(~job_ok):
                m.d.comb += look.eq(Look.BAD_JOB)
            with m.Elif(~worker_ok):
                m.d.comb += look.eq(Look.BAD_WORKER)
            with m.Elif(~slot_ok):
                m.d.comb += look.eq(Look.BAD_SLOT)
            with m.Elif(~credit_ok):
                m.d.comb += look.eq(Look.BAD_CREDIT)
            with m.Else():
                m.d.comb += look.eq(Look.AGGREGATE)
        with m.Elif(control):
            m.d.comb += look.eq(Mux(control_length_ok, Look.CONTROL, Look.BAD_PAYLOAD))
        with m.Else():
            m.d.comb += look.eq(Look.UNHANDLED)

        m.d.comb += [state_rd.addr.eq(index), state_rd.en.eq(go)]
        b_valid, b = Signal(), Signal(a.shape(), reset_less=True)
        b_look, b_imm = Signal(Look), Signal(H.REQUEST_IMM, reset_less=True)
        b_index = Signal(range(self.slots), reset_less=True)
        b_workers, b_quorum = Signal(6, reset_less=True), Signal(6, reset_less=True)
        b_completion_ports = Signal(P, reset_less=True)
        b_worker_port = Signal(P, reset_less=True)
        with m.If(go):
            m.d.sync += [
                b_valid.eq(a_valid), b.eq(a), b_look.eq(look), b_imm.eq(imm),
                b_index.eq(index), b_workers.eq(job.workers),
                b_quorum.eq(Mux((job.quorum == 0) | (job.quorum >= job.workers),
                                job.workers, job.quorum)),
                b_completion_ports.eq(completion_ports), b_worker_port.eq(worker_port),
            ]

        # --- decide ------------------------------------------------------------------
        version = b_imm.version
        copies = state_rd.data
        mine = copies[version]
        bit = Signal(MW)
        m.d.comb += bit.eq(Const(1, MW) << b_imm.rank)
        seen = (mine.bitmap & bit).any()
        idle = mine.count == 0              # no use in progress: the last one completed
        fresh = mine.bitmap == 0            # never used since the job's slots were cleared
        distance = Signal(signed(16))       # of this message from the copy's use
        m.d.comb += distance.eq(b.reth.rkey[:16] - mine.msn)
        new_count = Signal(7)
        m.d.comb += new_count.eq(mine.count + 1)
        finishes = new_count >= b_quorum    # a quorum written lower meanwhile: now
        new_data = Signal(6)
        m.d.comb += new_data.eq(Mux(idle, 0, mine.data) + ~b.null)
        # The credit limit a result carries: the job's completed uses (this one included)
        # plus its credits, as a running total.
        b_job = Array(ctl.job)[b_imm.job[: max(1, (J - 1).bit_length())]]
        limit = Signal(24)
        m.d.comb += limit.eq(b_job.completed + b_job.credits + finishes)
        cmd = Signal(cmd_layout)
        desc = cmd.desc
        m.d.comb += [
            cmd.port.eq(b.port), cmd.index.eq(b_index), cmd.null.eq(b.null),
            cmd.has_payload.eq((b.payload_length != 0)
                               & (~b.null | (cmd.action != Action.DRAIN))),
            desc.job.eq(b_imm.job), desc.slot.eq(b_imm.slot), desc.version.eq(version),
            desc.count.eq(new_data), desc.exponent.eq(b_imm.exponent),
            desc.offset.eq(b.reth.va), desc.length.eq(b.payload_length),
            desc.psn.eq(Mux(b_look == Look.CONTROL, b.bth.psn, limit)),
            cmd.action.eq(Action.DRAIN),
        ]
        new_state = Signal(state_layout)
        m.d.comb += new_state.eq(copies)
        update = Signal()
        port_event = Signal(len(PORT_EVENTS))
        job_event = Signal(len(JOB_EVENTS))

        def count_port(name):
            return port_event[PORT_EVENTS.index(name)].eq(1)

        def count_job(name):
            return job_event[JOB_EVENTS.index(name)].eq(1)

        with m.Switch(b_look):
            with m.Case(Look.UNHANDLED):
                m.d.comb += count_port("drop_unhandled")
            with m.Case(Look.BAD_PAYLOAD):
                m.d.comb += count_port("drop_bad_payload")
            with m.Case(Look.BAD_JOB):
                m.d.comb += count_port("drop_bad_job")
            with m.Case(Look.BAD_WORKER):
                m.d.comb += count_job("drop_bad_worker")
            with m.Case(Look.BAD_SLOT):
                m.d.comb += count_job("drop_bad_slot")
            with m.Case(Look.BAD_CREDIT):
                m.d.comb += count_job("drop_credit")
            with m.Case(Look.CONTROL):
                m.d.comb += [
                    count_port("control"), cmd.action.eq(Action.CONTROL), cmd.emit.eq(1),
                    desc.control.eq(1), cmd.ports.eq(Const(1, P) << b.port),
                ]
            with m.Case(Look.AGGREGATE):
                new_use = idle & (fresh | (distance > 0))
                with m.If(idle & ~new_use & (distance == 0)):
                    m.d.comb += [
                        count_job("replays"), cmd.action.eq(Action.REPLAY),
                        cmd.emit.eq(1), desc.dests.eq(bit), cmd.ports.eq(b_worker_port),
                        desc.count.eq(mine.data), limit.eq(b_job.completed + b_job.credits),
                    ]
                with m.Elif(~new_use & (distance != 0)):
                    m.d.comb += count_job("drop_stale")
                with m.Elif(~new_use & seen):
                    m.d.comb += count_job("duplicates")
                with m.Elif(~new_use & (mine.length != b.payload_length)):
                    m.d.comb += count_job("drop_bad_length")
                with m.Else():
                    m.d.comb += [
                        update.eq(1), count_job("contributions"),
                        cmd.action.eq(Mux(new_use, Action.OVERWRITE, Action.ADD)),
                        new_state[version].bitmap.eq(Mux(new_use, bit, mine.bitmap | bit)),
                        new_state[version].count.eq(Mux(finishes, 0, new_count)),
                        new_state[version].data.eq(new_data),
                        new_state[version].length.eq(b.payload_length),
                        new_state[version].msn.eq(b.reth.rkey[:16]),
                    ]
                    with m.If(finishes):
                        m.d.comb += [
                            count_job("completed"), cmd.emit.eq(1),
                            desc.dests.eq((Const(1, MW + 1) << b_workers) - 1),
                            cmd.ports.eq(b_completion_ports),
                        ]
        decided = go & b_valid
        m.d.comb += [
            commands.w_data.eq(cmd), commands.w_en.eq(decided),
            state_wr.addr.eq(b_index), state_wr.data.eq(new_state),
            state_wr.en.eq(decided & update),
        ]
        # A control request that was not served (a bad length) lifts its barrier here, and
        # its port's ingress may take the next one.
        with m.If(decided & is_control(b) & (b_look != Look.CONTROL)):
            m.d.sync += barrier.eq(0)
            m.d.comb += self.reply_dropped.eq(Const(1, P) << b.port)
        for p in range(P):
            with m.If(decided & (b.port == p)):
                m.d.comb += self.port_events[p].eq(port_event)
        # A completion's overflow is known at its last payload beat (below).
        overflowed = Signal()
        overflowed_job = Signal(4)
        for j in range(J):
            with m.If(decided & (b_imm.job == j)):
                m.d.comb += self.job_events[j].eq(job_event)
            with m.If(overflowed & (overflowed_job == j)):
                m.d.comb += self.job_events[j][JOB_EVENTS.index("overflows")].eq(1)

        # --- payload -------------------------------------------------------------------
        c = Signal(cmd_layout)
        m.d.comb += c.eq(commands.r_data)
        row = Signal(range(self.rows))
        source = Signal(BeatLayout(self.width))
        source_valid = Signal()
        with m.If(c.null):
            # A null contribution's payload is zeros, made here: its frame brought none.
            beat_bytes = self.width // 8
            left = Signal(range(self.max_payload + 1))
            m.d.comb += [
                left.eq(c.desc.length - row * beat_bytes),
                source.keep.eq(Cat(*(left > i for i in range(beat_bytes)))),
                source.last.eq(left <= beat_bytes),
                source_valid.eq(1),
            ]
        with m.Else():
            m.d.comb += [
                source.eq(Array(s.payload for s in self.payload)[c.port]),
                source_valid.eq(Array(s.valid for s in self.payload)[c.port]),
            ]
        take_source = Signal()
        for p, s in enumerate(self.payload):
            m.d.comb += s.ready.eq(take_source & (c.port == p) & ~c.null)

        # Second payload stage: the row read, the sums written, the result beat sent.
        d_valid, d_emit = Signal(), Signal()
        d_action = Signal(Action)
        d_beat = Signal(BeatLayout(self.width), reset_less=True)
        d_ports = Signal(P, reset_less=True)
        d_desc = Signal(result_descriptor(MW), reset_less=True)
        d_row_addr = Signal(range(self.slots * 2 * self.rows), reset_less=True)
        d_overflow = Signal()       # a lane of an earlier row of this packet saturated
        d_direct = d_action == Action.CONTROL    # d_beat is a control reply, not a row
        advance = ~d_valid | ~d_emit | self.egress.ready

        old = sums_rd.data
        new = Signal(sums_row(lanes))
        saturated = Signal(lanes)
        with m.Switch(d_action):
            with m.Case(Action.OVERWRITE, Action.ADD):
                for i in range(lanes):
                    given = Mux(d_beat.keep[4 * i], d_beat.data[32 * i: 32 * i + 32].as_signed(),
                                0)
                    base = Mux(d_action == Action.ADD, old.lanes[i], 0)
                    total = Signal(signed(33), name=f"total{i}")
                    m.d.comb += total.eq(base + given)
                    high, low = total > (1 << 31) - 1, total < -(1 << 31)
                    m.d.comb += [
                        saturated[i].eq(high | low),
                        new.lanes[i].eq(Mux(high, (1 << 31) - 1, Mux(low, -(1 << 31), total))),
                    ]
                with m.If(d_action == Action.ADD):
                    m.d.comb += [
                        new.overflow.eq(old.overflow | saturated.any()),
                        new.exponent.eq(Mux(old.exponent > d_desc.exponent, old.exponent,
                                            d_desc.exponent)),
                    ]
                with m.Else():
                    m.d.comb += new.exponent.eq(d_desc.exponent)
            with m.Default():
                m.d.comb += new.eq(old)
        m.d.comb += [
            sums_wr.addr.eq(d_row_addr), sums_wr.data.eq(new),
            sums_wr.en.eq(d_valid & advance
                          & ((d_action == Action.OVERWRITE) | (d_action == Action.ADD))),
        ]
        out = self.egress.payload
        m.d.comb += [
            self.egress.valid.eq(d_valid & d_emit),
            out.ports.eq(d_ports), out.desc.eq(d_desc),
            out.desc.overflow.eq(d_overflow | new.overflow), out.desc.exponent.eq(new.exponent),
            out.beat.keep.eq(d_beat.keep), out.beat.last.eq(d_beat.last),
            out.beat.data.eq(Mux(d_direct, d_beat.data, new.lanes.as_value())),
        ]
        completes = (d_action == Action.OVERWRITE) | (d_action == Action.ADD)
        m.d.comb += [
            overflowed.eq(d_valid & advance & d_emit & d_beat.last & completes
                          & (d_overflow | new.overflow)),
            overflowed_job.eq(d_desc.job),
        ]
        with m.If(d_valid & d_direct):
            m.d.comb += [out.desc.overflow.eq(0), out.desc.exponent.eq(0)]
        with m.If(advance):
            m.d.sync += d_valid.eq(0)
            with m.If(d_valid):
                m.d.sync += d_overflow.eq(Mux(d_beat.last, 0, d_overflow | new.overflow))

        # First payload stage: a beat taken, its row's read issued.
        m.d.comb += [
            sums_rd.addr.eq(Cat(row, c.desc.version, c.index) if self.rows > 1
                            else Cat(c.desc.version, c.index)),
            sums_rd.en.eq(advance),
        ]
        pop = Signal()
        m.d.comb += commands.r_en.eq(pop)
        rows_action = commands.r_rdy & (c.action != Action.CONTROL)
        with m.If(rows_action & ~c.has_payload):
            m.d.comb += pop.eq(1)
        with m.Elif(rows_action & advance):
            m.d.comb += take_source.eq(source_valid)
        with m.If(take_source & (c.action != Action.CONTROL)):
            m.d.sync += [
                d_valid.eq(1), d_emit.eq(c.emit), d_action.eq(c.action), d_beat.eq(source),
                d_ports.eq(c.ports), d_desc.eq(c.desc),
                d_row_addr.eq(sums_rd.addr), row.eq(row + 1),
            ]
            with m.If(source.last):
                m.d.comb += pop.eq(1)
                m.d.sync += row.eq(0)

        # Control requests: each beat's records applied one by one (write, then read back),
        # then the beat, values replaced, goes out as the reply's payload.
        records = self.width // 64
        held = Signal(BeatLayout(self.width), reset_less=True)
        holding = Signal()
        record = Signal(range(records + 1))
        readback = Signal()
        clear_pending = Signal(J)
        clearing = Signal()
        clear_slot = Signal(17)
        clear_end = Signal(17)
        wire = [held.data[8 * i: 8 * i + 8] for i in range(self.width // 8)]
        which = record[:max(1, (records - 1).bit_length())]
        current = Signal(H.CONTROL_RECORD)
        m.d.comb += current.eq(Array(
            H.from_wire(H.CONTROL_RECORD, wire[8 * i: 8 * i + 8]).as_value()
            for i in range(records))[which])
        in_payload = Array(held.keep[8 * i] for i in range(records))[which] & (record < records)
        address = current.address
        m.d.comb += [
            ctl.record.addr.eq(address[:16]),
            ctl.record.write.eq(address[31]),
            ctl.record.wdata.eq(current.value),
            ctl.request_port.eq(c.port),
        ]
        known = address[16:31] == 0
        control_cmd = commands.r_rdy & (c.action == Action.CONTROL)
        with m.If(ctl.cleared):
            m.d.sync += clear_pending.eq(clear_pending | (Const(1, J) << ctl.cleared_job))
        with m.If(control_cmd & ~holding & ~clearing & ctl.ready):
            with m.If(~c.has_payload):
                m.d.comb += pop.eq(1)
            with m.Else():
                m.d.comb += take_source.eq(source_valid)
                with m.If(source_valid):
                    m.d.sync += [held.eq(source), holding.eq(1), record.eq(0), readback.eq(0)]
        with m.If(holding):
            with m.If(in_payload):
                with m.If(~readback):
                    m.d.comb += ctl.record.en.eq(known)
                    m.d.sync += readback.eq(1)
                with m.Else():
                    value_bytes = H.to_wire(ctl.rdata)
                    for i in range(records):
                        with m.If(record == i):
                            m.d.sync += held.data[64 * i + 32: 64 * i + 64].eq(
                                Mux(known, value_bytes, 0))
                    m.d.sync += [readback.eq(0), record.eq(record + 1)]
            with m.Elif(advance):
                # The reply beat goes out; the request's last beat ends the command.
                m.d.sync += [
                    d_valid.eq(1), d_emit.eq(1), d_action.eq(Action.CONTROL), d_beat.eq(held),
                    d_ports.eq(c.ports), d_desc.eq(c.desc), holding.eq(0),
                ]
                with m.If(held.last):
                    m.d.comb += pop.eq(1)
                    with m.If(clear_pending.any()):
                        m.d.sync += clearing.eq(1)
                    with m.Else():
                        m.d.sync += barrier.eq(0)
        # Clearing the slots of each job whose CONFIG was written, one slot per cycle.
        pending_job = Signal(range(max(J, 2)))
        for j in reversed(range(J)):
            with m.If(clear_pending[j]):
                m.d.comb += pending_job.eq(j)
        with m.If(clearing):
            with m.If(clear_slot >= clear_end):
                with m.If(clear_pending.any()):
                    job = Array(ctl.job)[pending_job]
                    m.d.sync += [
                        clear_slot.eq(job.slot_base),
                        clear_end.eq(Mux(job.slot_base + job.slot_count > self.slots,
                                         self.slots, job.slot_base + job.slot_count)),
                        clear_pending.eq(clear_pending & ~(Const(1, J) << pending_job)),
                    ]
                with m.Else():
                    m.d.sync += [clearing.eq(0), barrier.eq(0)]
            with m.Else():
                m.d.comb += [state_wr.addr.eq(clear_slot), state_wr.data.eq(0),
                             state_wr.en.eq(1)]
                m.d.sync += clear_slot.eq(clear_slot + 1)
        return m
