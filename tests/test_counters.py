"""The counter bank (hw.counters) against a plain model: random steps on every counter, a
read of a random counter every cycle, and resets in the middle of a run."""

import random

import pytest
from amaranth import ClockDomain, Module
from amaranth.sim import Simulator

from hw.counters import CounterBank


def run(steps, cycles, seed, *, burst=False, resets=()):
    """Drives random steps and reads; returns the cycles where `data` differs from the model
    (cycle, expected, seen)."""
    m = Module()
    m.domains.sync = sync = ClockDomain()
    m.submodules.bank = bank = CounterBank(steps)
    rng = random.Random(seed)
    errors = []

    async def bench(ctx):
        counts = [0] * len(steps)
        expected = None             # what `data` must show this cycle
        for cycle in range(cycles):
            amounts = [rng.randint(0, s) if s and (burst or rng.random() < 0.5) else 0
                       for s in steps]
            addr = rng.randrange(len(steps))
            for i, a in enumerate(amounts):
                ctx.set(bank.step[i], a)
            ctx.set(bank.addr, addr)
            ctx.set(sync.rst, cycle in resets)
            if expected is not None and ctx.get(bank.data) != expected:
                errors.append((cycle, expected, ctx.get(bank.data)))
            await ctx.tick()
            if cycle in resets:
                counts = [0] * len(steps)
                expected = 0
            else:
                counts = [(c + a) % 2**32 for c, a in zip(counts, amounts)]
                expected = counts[addr]

    sim = Simulator(m)
    sim.add_clock(1e-6)
    sim.add_testbench(bench)
    sim.run()
    return errors


@pytest.mark.parametrize("steps", [[1, 1, 0, 3, 1], [2] * 16, [1, 0], [1]])
def test_counts_match_model(steps):
    assert run(steps, 600, seed=len(steps)) == []


def test_every_counter_at_its_largest_step():
    """Every counter takes its largest step every cycle: `pending` must not overflow."""
    assert run([4, 1, 4, 1, 2, 3, 0, 1], 400, seed=7, burst=True) == []


def test_reset_starts_every_counter_again_from_zero():
    """A reset mid-run (and one during the first sweep after another) zeroes every counter,
    though the block RAM keeps its words."""
    assert run([1, 2, 1, 1, 0, 1, 3, 1, 1, 1], 500, seed=3, resets=(150, 153, 300)) == []
