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
contribution of zeros, so its slot still completes. Nothing else is dropped by priority: on
a leaf, a spine's frame (a result, whose ImmDt is no REQUEST_IMM) is marked `parent` and kept.

A control request's addresses (Ethernet, IPv4 destination, UDP ports) do not travel in its
header entry: they wait in `reply_to` until the request's reply has left this port's egress
or the aggregator has dropped the request (`reply_sent`), and a second control request waits
at the parser meanwhile.

Latency: a header entry is committed two cycles after the frame's last beat at the earliest
(one in the parser, one waiting for the gearbox to hand over the frame's last wide beat).
Drops: every frame the parser does not judge OK, frames larger than the queue, and the
payload of droppable contributions under congestion.
"""

from amaranth import Array, Cat, Module, Signal, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from netagg.contract import headers as C
from netagg.contract import regmap as R

from . import headers as H
from .beat import FrameStream, check_width
from .fabric import NO_FABRIC, UPLINK, Fabric, parent_fields
from .gearbox import Widen
from .packet_queue import PacketQueue
from .parser import Parser

TIME_WIDTH = 32


def ingress_header(ports: int, fabric: Fabric = NO_FABRIC) -> data.StructLayout:
    """A committed header entry: the parser's fields that the aggregator reads (under the
    same names as in `hw.headers.PACKET_HEADER`), the verdict and payload length the packet
    queue reads, the ingress port and the commit time: 301 bits at 2 ports, where all of
    PACKET_HEADER's would make 693. The entries fill LUT RAM, the arbiter's mux and two
    aggregator stages. A leaf's mark its spine's frames (`hw.fabric.parent_fields`)."""
    return data.StructLayout({
        "ip": data.StructLayout({"src": 32}),
        "bth": data.StructLayout({"opcode": 8, "dqpn": 24, "psn": 24}),
        "reth": H.RETH,
        "immdt": H.IMMDT,
        "payload_length": unsigned(16),
        "verdict": unsigned(3),
        "port": range(max(ports, 2)),
        "time": unsigned(TIME_WIDTH),
        "null": 1,                 # payload dropped by priority
        **parent_fields(fabric),
    })


# Where a control reply goes: its request's addresses, which the egress port swaps.
REPLY_TO = data.StructLayout({
    "eth_src": 48, "eth_dst": 48, "ip_src": 32, "ip_dst": 32, "udp_src": 16, "udp_dst": 16,
})


def _copy(m, to, source):
    """`to`'s fields from the fields of the same names in `source`, nested layouts too (the
    others are left to the caller)."""
    names = {name for name, _ in source.shape()}
    for name, field in to.shape():
        if name not in names:
            continue
        if isinstance(field.shape, data.StructLayout):
            _copy(m, getattr(to, name), getattr(source, name))
        else:
            m.d.comb += getattr(to, name).eq(getattr(source, name))


class Ingress(wiring.Component):
    def __init__(self, width: int, factor: int, port: int, ports: int, capacity: int = 4096,
                 headers: int = 32, icrc: str = "engine", fabric: Fabric = NO_FABRIC):
        self.width, self.factor, self.port = check_width(width), factor, port
        self.capacity, self.headers, self.icrc = capacity, headers, icrc
        self.fabric = fabric
        layout = ingress_header(ports, fabric)
        more = {} if not fabric.uplinks else {
            "uplinks": In(UPLINK).array(fabric.uplinks),     # a leaf's uplink table
        }
        super().__init__({
            **more,
            "i": In(FrameStream(width, checked=icrc == "mac")),
            "time": In(unsigned(TIME_WIDTH)),
            "thresholds": In(16).array(R.PRIORITY_CLASSES),
            "header": Out(stream.Signature(layout)),
            "payload": Out(FrameStream(width * factor)),
            "dropped": Out(len(C.Verdict)),       # a frame dropped, by verdict (a pulse)
            "committed": Out(1),
            "nulled": Out(1),
            "reply_to": Out(REPLY_TO),     # the control request in flight from this port
            "reply_sent": In(1),           # its reply has left, or it was dropped
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
        header = parser.header.payload
        _copy(m, entry, header)
        droppable = ((header.bth.opcode == C.OP_CONTRIBUTION)
                     & H.REQUEST_IMM(header.immdt.data).droppable)
        if self.fabric.uplinks:
            droppable = droppable & ~self._parent(m, entry, header)
        congested = queue.level >= Array(self.thresholds)[header.ip.dscp[3:]]
        control = H.is_control(header.bth)
        replying = Signal()             # `reply_to` holds a request in flight
        go = widen.idle & ~(control & replying)
        m.d.comb += [
            entry.port.eq(self.port),
            entry.time.eq(self.time),
            entry.null.eq(droppable & congested),
            queue.i_null.eq(entry.null),
            queue.i_header.valid.eq(parser.header.valid & go),
            parser.header.ready.eq(queue.i_header.ready & go),
        ]
        with m.If(self.reply_sent):
            m.d.sync += replying.eq(0)
        reply_to = Signal(REPLY_TO, reset_less=True)
        m.d.comb += self.reply_to.eq(reply_to)
        with m.If(queue.committed & control):
            m.d.sync += [
                replying.eq(1),
                reply_to.eth_src.eq(header.eth.src), reply_to.eth_dst.eq(header.eth.dst),
                reply_to.ip_src.eq(header.ip.src), reply_to.ip_dst.eq(header.ip.dst),
                reply_to.udp_src.eq(header.udp.src_port), reply_to.udp_dst.eq(header.udp.dst_port),
            ]
        with m.If(parser.header.valid):
            m.d.comb += [widen.i.valid.eq(0), parser.payload.ready.eq(0)]

        m.d.comb += [self.committed.eq(queue.committed),
                     self.nulled.eq(queue.committed & entry.null)]
        m.d.comb += self.dropped.eq(queue.dropped)
        return m

    def _parent(self, m, entry, header):
        """A leaf's mark of a frame from an uplink's spine (opcode 0x2B at UPLINK_QPN from an
        uplink's IP: never dropped by priority), whether it came by that uplink's port, and the
        first uplink it came by."""
        ip = [up.ip == header.ip.src for up in self.uplinks]
        by = [i & (up.port == self.port) for i, up in zip(ip, self.uplinks)]
        m.d.comb += [
            entry.parent.eq((header.bth.opcode == C.OP_RESULT)
                            & (header.bth.dqpn == C.UPLINK_QPN) & Cat(*ip).any()),
            entry.by.eq(Cat(*by).any()),
        ]
        for i in reversed(range(len(by))):      # the first uplink it came by
            with m.If(by[i]):
                m.d.comb += entry.uplink.eq(i)
        return entry.parent
