"""The counter bank (hw.counters) against a plain model: random steps on every counter, reads
of random counters (as often as allowed: every other cycle), and resets in the middle of a
run."""

import random

import pytest
from amaranth import ClockDomain, Module
from amaranth.sim import Simulator

from netagg.hw.counters import CounterBank


def run(steps, cycles, seed, *, burst=False, resets=()):
    """Drives random steps and reads; returns the reads where `data` differs from the model
    (cycle, counter, expected, seen) and how many reads were checked."""
    m = Module()
    m.domains.sync = sync = ClockDomain()
    m.submodules.bank = bank = CounterBank(steps)
    rng = random.Random(seed)
    errors, reads = [], []

    async def bench(ctx):
        counts = [0] * len(steps)
        was_read = False
        for cycle in range(cycles):
            amounts = [rng.randint(0, s) if s and (burst or rng.random() < 0.5) else 0
                       for s in steps]
            read = not was_read and (burst or rng.random() < 0.7)
            addr = rng.randrange(len(steps))
            for i, a in enumerate(amounts):
                ctx.set(bank.step[i], a)
            ctx.set(bank.read, read)
            ctx.set(bank.addr, addr)
            ctx.set(sync.rst, cycle in resets)
            await ctx.tick()
            if cycle in resets:
                counts = [0] * len(steps)
                read = False
            else:
                counts = [(c + a) % 2**32 for c, a in zip(counts, amounts)]
            if read:
                reads.append(cycle)
                if ctx.get(bank.data) != counts[addr]:
                    errors.append((cycle, addr, counts[addr], ctx.get(bank.data)))
            was_read = read

    sim = Simulator(m)
    sim.add_clock(1e-6)
    sim.add_testbench(bench)
    sim.run()
    return errors, len(reads)


@pytest.mark.parametrize("steps", [[1, 1, 0, 3, 1], [2] * 16, [1, 0], [1]])
def test_counts_match_model(steps):
    errors, reads = run(steps, 600, seed=len(steps))
    assert errors == [] and reads > 150


def test_every_counter_at_its_largest_step_reads_every_other_cycle():
    """Every counter takes its largest step every cycle and a read comes every other cycle,
    holding the sweep back as much as allowed: `pending` must not overflow."""
    errors, reads = run([4, 1, 4, 1, 2, 3, 0, 1], 400, seed=7, burst=True)
    assert errors == [] and reads == 200


def test_reset_starts_every_counter_again_from_zero():
    """A reset mid-run (and one during the first sweep after another) zeroes every counter,
    though the block RAM keeps its words."""
    errors, reads = run([1, 2, 1, 1, 0, 1, 3, 1, 1, 1], 500, seed=3, resets=(150, 153, 300))
    assert errors == [] and reads > 100
