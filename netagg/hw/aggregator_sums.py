"""The aggregator's payload stages: the slots' sums, and the result beats out.

Takes the command at the head of the queue (`head`) and its packet's payload, one wide beat
per cycle, from the packet's ingress port (`payload`), or zeros for a null contribution (its
payload dropped by priority at ingress: made here, as long as its length says). For each
beat it reads the row of the slot's sums (`rows` rows of `width` bits a version), adds the
beat's int32 lanes with saturation (an overflow bit and the exponent, the maximum, are kept
per row), writes the row back, and, when the packet completed the slot, closed it at its
deadline (its payload drained, the rows unchanged) or is a replay, sends the row on as the
result's payload (`egress`), with the command's descriptor and ports; a
command that drains its packet changes nothing and sends nothing. A control request's beats
go to the records stage (`request`), and its reply comes back (`reply`) to leave the same way.
A completion whose sums saturated is counted (`overflowed`, of job `overflowed_job`), at its
last beat.

Latency: 1 cycle, from a beat taken (its row's read issued) to the row written and the result
beat offered; one beat per cycle, with no gap between packets. Drops nothing: the decide stage has
chosen what is drained.
"""

from amaranth import Array, Cat, Module, Mux, Signal, signed
from amaranth.lib import stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from .aggregator_command import Action, command, egress_beat, result_descriptor, sums_row
from .beat import BeatLayout, FrameStream
from .fabric import NO_FABRIC, Fabric


class Sums(wiring.Component):
    def __init__(self, *, ports: int, width: int, max_workers: int, slots: int,
                 max_payload: int, fabric: Fabric = NO_FABRIC):
        self.ports, self.width, self.max_workers = ports, width, max_workers
        self.fabric = fabric
        self.slots, self.max_payload = slots, max_payload
        self.rows = max_payload * 8 // width
        super().__init__({
            "head": In(stream.Signature(command(ports, slots, max_workers, fabric))),
            "payload": In(FrameStream(width)).array(ports),
            "request": Out(FrameStream(width)),    # a control request's beats
            "reply": In(FrameStream(width)),       # ... and its reply's
            "egress": Out(stream.Signature(egress_beat(width, ports, max_workers, fabric))),
            "overflowed": Out(1),                  # a completion's sums saturated
            "overflowed_job": Out(4),
        })

    def elaborate(self, platform):
        m = Module()
        P, MW = self.ports, self.max_workers
        m.submodules.sums = sums = Memory(
            shape=sums_row(self.width // 32), depth=self.slots * 2 * self.rows, init=[])
        sums_wr = sums.write_port()
        sums_rd = sums.read_port(transparent_for=(sums_wr,))

        c = Signal(command(P, self.slots, MW, self.fabric))
        m.d.comb += c.eq(self.head.payload)
        row = Signal(range(self.rows))
        source, source_valid, take_source = self._source(m, c, row)

        # Second stage: the row read, the sums written, the result beat sent.
        d_valid = Signal()
        d_emit = Signal()
        d_action = Signal(Action)
        d_beat = Signal(BeatLayout(self.width), reset_less=True)
        d_ports = Signal(P, reset_less=True)
        d_desc = Signal(result_descriptor(MW, self.fabric), reset_less=True)
        d_row_addr = Signal(range(self.slots * 2 * self.rows), reset_less=True)
        d_overflow = Signal()       # a lane of an earlier row of this packet saturated
        d_direct = d_action == Action.CONTROL    # d_beat is a control reply, not a row
        d_out = d_emit      # the beat goes out (a spine's pull: its last, emptied, alone)
        if self.fabric.spine:
            d_out = d_emit & (~d_desc.pull | d_beat.last)
        advance = ~d_valid | ~d_out | self.egress.ready

        new = self._add(m, sums_rd.data, d_action, d_beat, d_desc)
        m.d.comb += [
            sums_wr.addr.eq(d_row_addr), sums_wr.data.eq(new),
            sums_wr.en.eq(d_valid & advance
                          & ((d_action == Action.OVERWRITE) | (d_action == Action.ADD))),
        ]
        out = self.egress.payload
        m.d.comb += [
            self.egress.valid.eq(d_valid & d_out),
            out.ports.eq(d_ports), out.desc.eq(d_desc),
            out.desc.overflow.eq(d_overflow | new.overflow), out.desc.exponent.eq(new.exponent),
            out.beat.keep.eq(d_beat.keep), out.beat.last.eq(d_beat.last),
            out.beat.data.eq(Mux(d_direct, d_beat.data, new.lanes.as_value())),
        ]
        completes = ((d_action == Action.OVERWRITE) | (d_action == Action.ADD)
                     | (d_action == Action.CLOSE))
        if self.fabric.spine:
            completes = completes & ~d_desc.pull
        if self.fabric.uplinks:
            completes = completes & ~d_desc.up      # a partial up: not complete here
        m.d.comb += [
            self.overflowed.eq(d_valid & advance & d_out & d_beat.last & completes
                               & (d_overflow | new.overflow)),
            self.overflowed_job.eq(d_desc.job),
        ]
        with m.If(d_valid & d_direct):
            m.d.comb += [out.desc.overflow.eq(0), out.desc.exponent.eq(0)]
        if self.fabric.spine:
            with m.If(d_desc.pull):     # a pull: no payload, count, exponent nor overflow
                m.d.comb += [out.desc.overflow.eq(0), out.desc.exponent.eq(0),
                             out.beat.keep.eq(0)]
        with m.If(advance):
            m.d.sync += d_valid.eq(0)
            with m.If(d_valid):
                m.d.sync += d_overflow.eq(Mux(d_beat.last, 0, d_overflow | new.overflow))

        # First stage: a beat taken, its row's read issued.
        m.d.comb += [
            sums_rd.addr.eq(Cat(row, c.desc.version, c.index) if self.rows > 1
                            else Cat(c.desc.version, c.index)),
            sums_rd.en.eq(advance),
        ]
        pop = self.head.ready
        rows_action = self.head.valid & (c.action != Action.CONTROL)
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

        # A control request's beats go to the records stage; its reply's come back.
        m.d.comb += [self.request.payload.eq(source), self.request.valid.eq(source_valid),
                     self.reply.ready.eq(advance)]
        with m.If(self.request.ready):
            m.d.comb += take_source.eq(source_valid)
        with m.If(self.reply.valid & advance):
            m.d.sync += [
                d_valid.eq(1), d_emit.eq(1), d_action.eq(Action.CONTROL),
                d_beat.eq(self.reply.payload), d_ports.eq(c.ports), d_desc.eq(c.desc),
            ]
        return m

    def _source(self, m, c, row):
        """The command's payload beats: its port's, or, for a null contribution, zeros made
        here; and `take_source`, which takes the beat."""
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
        return source, source_valid, take_source

    def _add(self, m, old, d_action, d_beat, d_desc):
        """The row to write back: the beat's lanes added to the row read (`old`), with
        saturation, for a contribution; the row unchanged otherwise."""
        lanes = self.width // 32
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
                # a spine's partial brings its leaf's overflow (the descriptor's)
                added_overflow = old.overflow | saturated.any()
                if self.fabric.spine:
                    added_overflow = added_overflow | d_desc.overflow
                with m.If(d_action == Action.ADD):
                    m.d.comb += [
                        new.overflow.eq(added_overflow),
                        new.exponent.eq(Mux(old.exponent > d_desc.exponent, old.exponent,
                                            d_desc.exponent)),
                    ]
                with m.Else():
                    m.d.comb += new.exponent.eq(d_desc.exponent)
                    if self.fabric.spine:
                        m.d.comb += new.overflow.eq(d_desc.overflow)
            with m.Default():
                m.d.comb += new.eq(old)
        return new
