"""The aggregator's control records: a control request applied to the registers, and its reply.

Takes a control request's command (`head`, action CONTROL) and its payload beats
(`request`), one beat at a time: each of the beat's 64-bit records (a 32-bit address, the
top bit set for a write, and a 32-bit value) is applied to `Control`'s registers (`control`)
and read back, two cycles a record (the value written, or the register's, or 0 at an unknown
address), and the beat, its values replaced, goes out as the reply's payload (`reply`).
A request starts only when `Control` is `ready` and no slots are being cleared (`blocked`);
`served` pulses when its reply's last beat has left.

Latency: 2 cycles a record, then the reply beat; the command queue waits meanwhile. Drops
nothing: a record at an unknown address is answered 0.
"""

from amaranth import Array, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from . import headers as H
from .aggregator_command import Action, command
from .beat import BeatLayout, FrameStream
from .control import RecordPort
from .fabric import NO_FABRIC, Fabric


class Records(wiring.Component):
    def __init__(self, *, ports: int, width: int, max_workers: int, slots: int,
                 fabric: Fabric = NO_FABRIC):
        self.width = width
        super().__init__({
            "head": In(stream.Signature(command(ports, slots, max_workers, fabric))),
            "request": In(FrameStream(width)),
            "reply": Out(FrameStream(width)),
            "control": Out(RecordPort(ports)),
            "blocked": In(1),             # slots are being cleared: start no request
            "served": Out(1),             # the reply's last beat left
        })

    def elaborate(self, platform):
        m = Module()
        c, ctl = self.head.payload, self.control
        records = self.width // 64
        held = Signal(BeatLayout(self.width), reset_less=True)
        holding = Signal()
        record = Signal(range(records + 1))
        readback = Signal()
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
            self.reply.payload.eq(held), self.reply.valid.eq(holding & ~in_payload),
        ]
        known = address[16:31] == 0
        control_cmd = self.head.valid & (c.action == Action.CONTROL)
        pop = self.head.ready
        with m.If(control_cmd & ~holding & ~self.blocked & ctl.ready):
            with m.If(~c.has_payload):
                m.d.comb += pop.eq(1)
            with m.Else():
                m.d.comb += self.request.ready.eq(1)
                with m.If(self.request.valid):
                    m.d.sync += [held.eq(self.request.payload), holding.eq(1), record.eq(0),
                                 readback.eq(0)]
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
            with m.Elif(self.reply.ready):
                # The reply beat goes out; the request's last beat ends the command.
                m.d.sync += holding.eq(0)
                with m.If(held.last):
                    m.d.comb += [pop.eq(1), self.served.eq(1)]
        return m
