"""Counter bank: many 32-bit wrapping counters in one block RAM, instead of a register, an
adder and a 32-bit read mux input each.

Counter `i` adds `step[i]` each cycle (at most `steps[i]`; a counter with `steps[i] == 0` is
a hole, never counts and reads 0). Its steps gather in a small `pending` register, wide
enough for what `len(steps)` cycles can bring. A sweep visits one counter per cycle, in
order: it reads the counter's word, adds what is pending and writes the sum back, while
`pending` starts again from that cycle's step. Reading counter `addr` gives, on `data` in the
next cycle, its value with every step up to and including the cycle `addr` was shown: the word
(read through a second, write-transparent port) plus what is pending for it.

Reset: the first sweep after reset writes only what is pending, so the words start at 0
without a clear cycle; until the sweep has passed a counter, a read shows its pending amount
alone. Latency: one cycle from `addr` to `data`. Resources: one block RAM per read port for up
to 512 counters, a few bits of pending per counter, two 32-bit adders.
"""

from amaranth import Array, Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

WIDTH = 32


class CounterBank(wiring.Component):
    def __init__(self, steps):
        self.steps = list(steps)
        if not self.steps or min(self.steps) < 0:
            raise ValueError("a counter bank needs counters with steps of 0 or more")
        self.depth = max(len(self.steps), 2)
        super().__init__({
            "step": In(range(max(self.steps) + 1)).array(len(self.steps)),
            "addr": In(range(self.depth)),
            "data": Out(WIDTH),
        })

    def elaborate(self, platform):
        m = Module()
        n = self.depth
        m.submodules.words = words = Memory(shape=WIDTH, depth=n, init=[],
                                            attrs={"ram_style": "block"})
        write = words.write_port()
        sweep_read = words.read_port()
        user_read = words.read_port(transparent_for=(write,))

        # pending[i] holds at most `n` cycles of steps: a sweep comes by every `n` cycles.
        pending = [Signal(range(max(step * n, 0) + 1), name=f"pending{i}")
                   for i, step in enumerate(self.steps)]
        pending += [Signal(1, name=f"pending{i}") for i in range(len(self.steps), n)]

        visit = Signal(range(n))                 # the counter whose word is read now
        visited = Signal(range(n), init=n - 1)   # the one whose word is written now
        fresh = Signal(init=1)                   # the first sweep after reset
        m.d.sync += [visit.eq(Mux(visit == n - 1, 0, visit + 1)), visited.eq(visit)]
        with m.If(visit == n - 1):
            m.d.sync += fresh.eq(0)
        moved = Array(pending)[visited]
        m.d.comb += [
            sweep_read.addr.eq(visit),
            write.addr.eq(visited), write.en.eq(1),
            write.data.eq(Mux(fresh, 0, sweep_read.data) + moved),
        ]
        for i, (count, step) in enumerate(zip(pending, self.steps)):
            if step:
                m.d.sync += count.eq(Mux(visited == i, 0, count) + self.step[i])

        # Reads: the word after this cycle's write, plus what is pending after this cycle.
        # During the first sweep a word not yet written (at or after `visit`, other than the
        # last, written first) is not read.
        addr = Signal(range(n))
        unwritten = Signal(init=1)
        m.d.sync += [addr.eq(self.addr),
                     unwritten.eq(fresh & (self.addr >= visit) & (self.addr != n - 1))]
        m.d.comb += [
            user_read.addr.eq(self.addr),
            self.data.eq(Mux(unwritten, 0, user_read.data) + Array(pending)[addr]),
        ]
        return m
