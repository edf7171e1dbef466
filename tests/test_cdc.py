"""hw.cdc.AsyncFifo in amaranth.sim: values cross between two unrelated clocks in order,
none lost, repeated or overwritten, with the writer and the reader stalling at random, both
ways round (125 MHz against 25 MHz, as in the MACs) and at nearly equal rates."""

import random

import pytest
from amaranth import ClockDomain, Module
from amaranth.sim import Simulator

from netagg.hw.cdc import AsyncFifo


@pytest.mark.parametrize("w_ns,r_ns", [(8, 40), (40, 8), (8, 9.7)])
def test_values_cross_in_order(w_ns, r_ns):
    m = Module()
    m.domains.w = ClockDomain("w", reset_less=True)
    m.domains.r = ClockDomain("r", reset_less=True)
    m.submodules.fifo = fifo = AsyncFifo(16, 8, w_domain="w", r_domain="r")
    sent = list(range(1, 400))
    got = []
    rng = random.Random(w_ns * 100 + r_ns)

    async def writer(ctx):
        pending = list(sent)
        while pending:
            enable = rng.random() < 0.8
            ctx.set(fifo.w_data, pending[0])
            ctx.set(fifo.w_en, enable)
            taken = enable and ctx.get(fifo.w_rdy)
            await ctx.tick("w")
            if taken:
                pending.pop(0)
        ctx.set(fifo.w_en, 0)

    async def reader(ctx):
        while len(got) < len(sent):
            ctx.set(fifo.r_en, rng.random() < 0.7)
            if ctx.get(fifo.r_en) and ctx.get(fifo.r_rdy):
                got.append(ctx.get(fifo.r_data))
            await ctx.tick("r")

    sim = Simulator(m)
    sim.add_clock(w_ns * 1e-9, domain="w")
    sim.add_clock(r_ns * 1e-9, domain="r")
    sim.add_testbench(writer)
    sim.add_testbench(reader)
    sim.run_until(2e-3)
    assert got == sent
