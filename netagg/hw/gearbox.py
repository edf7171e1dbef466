"""Gearboxes between a port's beats and the switch's wide beats.

`Widen` gathers `factor` beats of a payload into one beat `factor` times as wide (the first
beat in the lowest bits); a payload's last beat ends its wide beat early. `Narrow` does the
inverse, skipping the empty tail of a payload's last wide beat. Both keep payloads whole
(every beat full but the last) and take or give one narrow beat per cycle. Latency: one
cycle. They drop nothing.
"""

from amaranth import Cat, Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .beat import BeatLayout, FrameStream


class Widen(wiring.Component):
    def __init__(self, width: int, factor: int):
        if factor < 1 or factor & (factor - 1):
            raise ValueError(f"factor must be a power of two, not {factor}")
        self.width, self.factor = width, factor
        super().__init__({
            "i": In(FrameStream(width)),
            "o": Out(FrameStream(width * factor)),
            "idle": Out(1),    # nothing held: every beat taken so far has left
        })

    def elaborate(self, platform):
        m = Module()
        w, nb, k = self.width, self.width // 8, self.factor
        gathered = Signal(BeatLayout(w * k), reset_less=True)      # the lanes before `lane`
        out = Signal(BeatLayout(w * k), reset_less=True)
        lane = Signal(range(k))
        m.d.comb += [self.idle.eq(~self.o.valid & (lane == 0)), self.o.payload.eq(out)]
        beat = self.i.payload
        closes = beat.last | (lane == k - 1)
        m.d.comb += self.i.ready.eq(~self.o.valid | self.o.ready | ~closes)
        fire = self.i.valid & self.i.ready
        with m.If(self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        with m.If(fire):
            data = Cat(*(Mux(lane == n, beat.data, gathered.data[n * w:(n + 1) * w])
                         for n in range(k)))
            keep = Cat(*(Mux(lane == n, beat.keep,
                             Mux(lane > n, gathered.keep[n * nb:(n + 1) * nb], 0))
                         for n in range(k)))
            with m.If(closes):
                m.d.sync += [
                    out.data.eq(data), out.keep.eq(keep), out.last.eq(beat.last),
                    self.o.valid.eq(1), lane.eq(0),
                ]
            with m.Else():
                m.d.sync += [gathered.data.eq(data), gathered.keep.eq(keep), lane.eq(lane + 1)]
        return m


class Narrow(wiring.Component):
    def __init__(self, width: int, factor: int):
        if factor < 1 or factor & (factor - 1):
            raise ValueError(f"factor must be a power of two, not {factor}")
        self.width, self.factor = width, factor
        super().__init__({"i": In(FrameStream(width * factor)), "o": Out(FrameStream(width))})

    def elaborate(self, platform):
        m = Module()
        w, nb, k = self.width, self.width // 8, self.factor
        held = Signal(BeatLayout(w * k), reset_less=True)
        full = Signal()
        lane = Signal(range(k))
        lane_keep = held.keep.word_select(lane, nb)
        next_keep = Signal(nb)
        if k > 1:
            m.d.comb += next_keep.eq(held.keep.word_select(lane + 1, nb))
        final = (lane == k - 1) | ~next_keep[0]
        m.d.comb += [
            self.o.valid.eq(full),
            self.o.payload.data.eq(held.data.word_select(lane, w)),
            self.o.payload.keep.eq(lane_keep),
            self.o.payload.last.eq(held.last & final),
            self.i.ready.eq(~full | (self.o.ready & final)),
        ]
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += lane.eq(lane + 1)
            with m.If(final):
                m.d.sync += [full.eq(0), lane.eq(0)]
        with m.If(self.i.valid & self.i.ready):
            m.d.sync += [held.eq(self.i.payload), full.eq(1), lane.eq(0)]
        return m
