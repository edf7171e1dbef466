"""Ingress of one switch port: parse, gather into wide beats, queue until judged good.

A frame goes through the `Parser` (checks, header entry, payload realigned), a `Widen`
gearbox (`factor` port beats to one wide beat, so that the shared aggregator, `factor` times
as wide, can serve every port at line rate) and a `PacketQueue` that commits the payload when
the header entry says OK and discards it otherwise, counting the drop by reason. Each
committed header entry is stamped with the cycle of its commit (`time`) and the port's
number, so that the arbiter serves frames of all ports in the order they were committed.

Priority drop: a good contribution marked droppable (ImmDt) whose queue holds at least
`thresholds[class]` bytes ahead of it (class = IPv4 DSCP >> 3) loses its payload and is
queued as a header alone, marked `null` (`nulled` pulses); the aggregator counts it as a
contribution of zeros, so its slot still completes. Nothing else is dropped by priority.

Latency: a header entry is committed two cycles after the frame's last beat at the earliest
(one in the parser, one waiting for the gearbox to hand over the frame's last wide beat).
Drops: every frame the parser does not judge OK, frames larger than the queue, and the
payload of droppable contributions under congestion.
"""

from amaranth import Array, Module, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from . import headers as H
from . import regmap as R
from .beat import FrameStream, check_width
from .gearbox import Widen
from .packet_queue import COUNTER_WIDTH, PacketQueue
from .parser import Parser

TIME_WIDTH = 32


def ingress_header(ports: int) -> data.StructLayout:
    """A committed header entry: the parser's fields, the ingress port and the commit time."""
    return data.StructLayout({
        **{name: field.shape for name, field in H.PACKET_HEADER},
        "port": range(max(ports, 2)),
        "time": unsigned(TIME_WIDTH),
        "null": 1,                 # payload dropped by priority
    })


class Ingress(wiring.Component):
    def __init__(self, width: int, factor: int, port: int, ports: int, capacity: int = 4096,
                 headers: int = 32, icrc: str = "engine"):
        self.width, self.factor, self.port = check_width(width), factor, port
        self.capacity, self.headers, self.icrc = capacity, headers, icrc
        layout = ingress_header(ports)
        super().__init__({
            "i": In(FrameStream(width, checked=icrc == "mac")),
            "time": In(unsigned(TIME_WIDTH)),
            "thresholds": In(16).array(R.PRIORITY_CLASSES),
            "header": Out(stream.Signature(layout)),
            "payload": Out(FrameStream(width * factor)),
            "drops": Out(unsigned(COUNTER_WIDTH)).array(len(H.Verdict)),
            "committed": Out(1),
            "nulled": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.parser = parser = Parser(self.width, self.icrc)
        m.submodules.widen = widen = Widen(self.width, self.factor)
        m.submodules.queue = queue = PacketQueue(
            self.width * self.factor, self.capacity, headers=self.headers,
            header_layout=self.header.payload.shape())
        wiring.connect(m, wiring.flipped(self.i), parser.i)
        wiring.connect(m, parser.payload, widen.i)
        wiring.connect(m, widen.o, queue.i_payload)
        wiring.connect(m, queue.o_header, wiring.flipped(self.header))
        wiring.connect(m, queue.o_payload, wiring.flipped(self.payload))

        # A header entry goes to the queue once the gearbox has handed over its frame's last
        # beat; meanwhile the next frame's payload waits, so the gearbox empties.
        entry = queue.i_header.payload
        for name, _ in H.PACKET_HEADER:
            m.d.comb += getattr(entry, name).eq(getattr(parser.header.payload, name))
        header = parser.header.payload
        droppable = ((header.bth.opcode == H.OP_CONTRIBUTION)
                     & H.REQUEST_IMM(header.immdt.data).droppable)
        congested = queue.level >= Array(self.thresholds)[header.ip.dscp[3:]]
        m.d.comb += [
            entry.port.eq(self.port),
            entry.time.eq(self.time),
            entry.null.eq(droppable & congested),
            queue.i_null.eq(entry.null),
            queue.i_header.valid.eq(parser.header.valid & widen.idle),
            parser.header.ready.eq(queue.i_header.ready & widen.idle),
        ]
        with m.If(parser.header.valid):
            m.d.comb += [widen.i.valid.eq(0), parser.payload.ready.eq(0)]

        m.d.comb += [self.committed.eq(queue.committed),
                     self.nulled.eq(queue.committed & entry.null)]
        for mine, theirs in zip(self.drops, queue.drops):
            m.d.comb += mine.eq(theirs)
        return m
