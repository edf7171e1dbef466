"""Counter bank: many 32-bit wrapping counters in one block RAM, instead of a register, an
adder and a 32-bit read mux input each.

Counter `i` adds `step[i]` each cycle (at most `steps[i]`; a counter with `steps[i] == 0`
counts only bumps, below, and reads 0 when nothing bumps it). Its steps gather in a small
`pending` register. A sweep visits one counter per cycle, in order: it reads the counter's
word, adds what is pending and writes the sum back, while `pending` starts again from that
cycle's step. A read (`read` with `addr`) is a visit out of turn: the sweep visits `addr`
instead and waits a cycle, and the sum it writes is shown on `data` in the next cycle: the
counter's value with every step up to and including the cycle of the read. Reads must be at
least two cycles apart (a control record takes two), so that the sweep comes by every
counter at least every 2 x `len(steps)` cycles, which sizes `pending`. A read with `bump`
high also adds 1 to the counter it visits, which must be one of step 0: a counter of rare
events, such as the refusals of control records, costs no pending register, adder or mux
input.

Reset: a word's first visit after reset writes only what is pending (a bit per counter
remembers which words were rewritten), so the words start at 0 without a clear cycle.
Latency: one cycle from a read to `data`. Resources: one block RAM for up to 512 counters, a
few bits of pending per counter, one mux over them and a 32-bit adder.
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
            "read": In(1),
            "bump": In(1),          # with read: the visit adds 1 (to a counter of step 0)
            "addr": In(range(self.depth)),
            "data": Out(WIDTH),
        })

    def elaborate(self, platform):
        m = Module()
        n = self.depth
        m.submodules.words = words = Memory(shape=WIDTH, depth=n, init=[],
                                            attrs={"ram_style": "block"})
        write = words.write_port()
        word = words.read_port(transparent_for=(write,))

        # Between two visits of a counter: at most n cycles of sweep and n reads.
        pending = [Signal(range(step * 2 * n + 1), name=f"pending{i}")
                   for i, step in enumerate(self.steps)]
        pending += [Signal(1, name=f"pending{i}") for i in range(len(self.steps), n)]

        turn = Signal(range(n))                  # the counter the sweep visits next
        visit = Signal(range(n))                 # the counter whose word is read now
        visited = Signal(range(n), init=n - 1)   # the one whose word is written now
        rewritten = Signal(n)                    # the words written since reset
        bumped = Signal()                        # the visit written now adds 1
        m.d.comb += visit.eq(Mux(self.read, self.addr, turn))
        with m.If(~self.read):
            m.d.sync += turn.eq(Mux(turn == n - 1, 0, turn + 1))
        m.d.sync += [visited.eq(visit), rewritten.bit_select(visited, 1).eq(1),
                     bumped.eq(self.read & self.bump)]
        m.d.comb += [
            word.addr.eq(visit),
            write.addr.eq(visited), write.en.eq(1),
            write.data.eq(Mux(rewritten.bit_select(visited, 1), word.data, 0)
                          + (Array(pending)[visited] | bumped)),
            self.data.eq(write.data),
        ]
        for i, (count, step) in enumerate(zip(pending, self.steps)):
            if step:
                m.d.sync += count.eq(Mux(visited == i, 0, count) + self.step[i])
        return m
