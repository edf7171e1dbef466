"""ARP for a board: answer requests for the switch's IPv4 address, and share a port's
transmit side between the switch and those answers.

`ArpResponder` watches the frames a port receives (it takes nothing from the stream; the
frames go on to the switch, whose parser drops them as not RoCE). An ARP request (EtherType
0x0806, Ethernet/IPv4, operation 1) whose target is `ip` gets a reply from `mac`: 42 bytes
(the MAC pads to 60), one cycle after the request's last beat. A request that arrives while
a reply is still waiting to be sent is not answered. `FrameMux` puts the replies between the
switch's frames, whole frames only, the switch first.
"""

from amaranth import Cat, Const, Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .beat import FrameStream, check_width

ARP_BYTES = 42


def _bytes(value: int, n: int) -> list:
    """`value` as `n` big-endian bytes, first byte first."""
    return [Const((value >> (8 * (n - 1 - i))) & 0xFF, 8) for i in range(n)]


class ArpResponder(wiring.Component):
    def __init__(self, width: int, *, mac: int, ip: int):
        self.width = check_width(width)
        self.mac, self.ip = mac, ip
        super().__init__({
            "data": In(width), "keep": In(width // 8), "last": In(1),
            "taken": In(1),            # a beat of a received frame is taken in this cycle
            "o": Out(FrameStream(width)),
            "replies": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        nb = self.width // 8
        beats = (ARP_BYTES + nb - 1) // nb
        head = [Signal(8, name=f"head{i}", reset_less=True) for i in range(ARP_BYTES)]
        index = Signal(range(beats + 1))
        covered = Signal()            # byte 41 was received
        check = Signal()
        with m.If(self.taken):
            m.d.sync += index.eq(index + (index != beats))
            for i in range(ARP_BYTES):
                with m.If(index == i // nb):
                    m.d.sync += head[i].eq(self.data.word_select(i % nb, 8))
            with m.If((index == (ARP_BYTES - 1) // nb) & self.keep[(ARP_BYTES - 1) % nb]):
                m.d.sync += covered.eq(1)
            with m.If(self.last):
                m.d.sync += index.eq(0)
        m.d.sync += check.eq(self.taken & self.last)

        def field(start, n):
            return Cat(*reversed(head[start:start + n]))   # big-endian value

        request = (covered & (field(12, 2) == 0x0806) & (field(14, 2) == 1)
                   & (field(16, 2) == 0x0800) & (field(18, 1) == 6) & (field(19, 1) == 4)
                   & (field(20, 2) == 1) & (field(38, 4) == self.ip))
        sha = [Signal(8, name=f"sha{i}", reset_less=True) for i in range(6)]
        spa = [Signal(8, name=f"spa{i}", reset_less=True) for i in range(4)]
        pending = Signal()
        with m.If(check):
            m.d.sync += covered.eq(0)
            with m.If(request & ~pending):
                m.d.sync += [pending.eq(1), self.replies.eq(self.replies + 1)]
                m.d.sync += [s.eq(h) for s, h in zip(sha, head[22:28])]
                m.d.sync += [s.eq(h) for s, h in zip(spa, head[28:32])]

        reply = [*sha, *_bytes(self.mac, 6), *_bytes(0x0806, 2), *_bytes(1, 2),
                 *_bytes(0x0800, 2), *_bytes(6, 1), *_bytes(4, 1), *_bytes(2, 2),
                 *_bytes(self.mac, 6), *_bytes(self.ip, 4), *sha, *spa]
        reply += [Const(0, 8)] * (beats * nb - ARP_BYTES)
        out = Signal(range(beats))
        final = out == beats - 1
        tail = ARP_BYTES - (beats - 1) * nb
        m.d.comb += [
            self.o.valid.eq(pending),
            self.o.payload.data.eq(Cat(*reply).word_select(out, self.width)),
            self.o.payload.keep.eq(Const((1 << nb) - 1, nb)),
            self.o.payload.last.eq(final),
        ]
        with m.If(final):
            m.d.comb += self.o.payload.keep.eq((1 << tail) - 1)
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += out.eq(out + 1)
            with m.If(final):
                m.d.sync += [out.eq(0), pending.eq(0)]
        return m


class FrameMux(wiring.Component):
    """Two frame streams into one, a whole frame at a time; `a` first when both wait."""

    def __init__(self, width: int):
        super().__init__({"a": In(FrameStream(width)), "b": In(FrameStream(width)),
                          "o": Out(FrameStream(width))})

    def elaborate(self, platform):
        m = Module()
        busy = Signal()
        from_b = Signal()
        choose_b = Signal()
        m.d.comb += choose_b.eq(Mux(busy, from_b, ~self.a.valid & self.b.valid))
        with m.If(choose_b):
            m.d.comb += [self.o.payload.eq(self.b.payload), self.o.valid.eq(self.b.valid),
                         self.b.ready.eq(self.o.ready)]
        with m.Else():
            m.d.comb += [self.o.payload.eq(self.a.payload), self.o.valid.eq(self.a.valid),
                         self.a.ready.eq(self.o.ready)]
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += [busy.eq(~self.o.payload.last), from_b.eq(choose_b)]
        return m

