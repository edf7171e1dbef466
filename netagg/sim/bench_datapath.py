"""The datapath's line-rate benchmark: the cocotb testcase `line_rate`, run inside the
simulator on one port's datapath (parser, packet queue, deparser: `sim.tops.DatapathTop` in
loopback), its width from NETAGG_WIDTH.

48 RoCEv2 frames (24 RDMA WRITEs of 1024 bytes of payload, 24 of random opcode and size,
built by scapy: `sim.scapy_frames`) go in back to back, with no idle cycle even between
frames, and come out into a sink that is always ready. The testcase checks that every frame
comes out unchanged, that the input never stalls, and that the output ends at most one frame
(and the pipeline's latency) after the input; with NETAGG_BENCH_OUT set it writes its figures
there as JSON: beats per cycle in and out, the first output beat's cycle, simulated cycles
per second. `netagg bench datapath` runs it (`netagg/apps/bench_line_rate.py`), and so do the tests.
"""

import json
import os
import random
import time

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge, with_timeout
from cocotbext.axi import AxiStreamBus, AxiStreamSink

from netagg.sim.scapy_frames import roce_frame

WIDTH = int(os.environ.get("NETAGG_WIDTH", "64"))


def beats(frames) -> list[tuple[bytes, bool]]:
    """The bus beats of `frames`, each (bytes, last)."""
    nb = WIDTH // 8
    return [(frame[i : i + nb], i + nb >= len(frame))
            for frame in frames for i in range(0, len(frame), nb)]


async def drive_back_to_back(dut, frames, stats=None):
    """Drive `frames` on rx with no idle cycle, not even between frames (the bus models may
    leave one); count in `stats` the cycles and the cycles the parser did not take a beat."""
    stats = stats if stats is not None else {"stalls": 0, "cycles": 0}
    todo = beats(frames)
    n = 0
    while n < len(todo):
        chunk, last = todo[n]
        dut.rx_tdata.value = int.from_bytes(chunk, "little")
        dut.rx_tkeep.value = (1 << len(chunk)) - 1
        dut.rx_tlast.value = int(last)
        dut.rx_tvalid.value = 1
        await ReadOnly()
        taken = int(dut.rx_tready.value)
        stats["stalls"] += 1 - taken
        stats["cycles"] += 1
        await RisingEdge(dut.clk)
        n += taken
    dut.rx_tvalid.value = 0


def bench_frames() -> list[bytes]:
    """The benchmark's frames, the same for a width on every run."""
    rng = random.Random(WIDTH + 4)
    nb = WIDTH // 8
    frames = [bytes(roce_frame(0x0A, bytes(1024), rng=rng, psn=n)) for n in range(24)]
    frames += [bytes(roce_frame(rng.choice([0x0A, 0x04, 0x0B, 0x05]),
                                bytes(rng.randrange(nb, 1500)), rng=rng, psn=100 + n))
               for n in range(24)]
    return frames


@cocotb.test()
async def line_rate(dut):
    """With no backpressure, back-to-back frames go in and out at one beat per cycle."""
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    dut.loopback.value = 1
    dut.rx_tvalid.value = 0
    sink = AxiStreamSink(AxiStreamBus.from_prefix(dut, "tx"), dut.clk, dut.rst)
    dut.rst.value = 1
    await ClockCycles(dut.clk, 4)
    dut.rst.value = 0
    await ClockCycles(dut.clk, 2)
    frames = bench_frames()
    nb = WIDTH // 8
    n_beats = len(beats(frames))
    stats = {"stalls": 0, "out_beats": 0, "cycles": 0, "first_out": None, "last_out": None}

    async def watch():
        cycle = 0
        while stats["out_beats"] < n_beats:
            await ReadOnly()
            if int(dut.tx_tvalid.value) and int(dut.tx_tready.value):
                stats["out_beats"] += 1
                stats["first_out"] = stats["first_out"] if stats["first_out"] is not None \
                    else cycle
                stats["last_out"] = cycle
            await RisingEdge(dut.clk)
            cycle += 1

    async def receive(timeout_cycles):
        got = []
        for _ in frames:
            frame = await with_timeout(sink.recv(), timeout_cycles * 10, "ns")
            got.append(bytes(frame.tdata))
        return got

    watcher = cocotb.start_soon(watch())
    wall = time.perf_counter()
    await drive_back_to_back(dut, frames, stats)
    got = await receive(20 * sum(len(f) // nb + 2 for f in frames) + 2000)
    wall = time.perf_counter() - wall
    await watcher
    assert got == frames
    assert stats["stalls"] == 0, stats
    assert stats["cycles"] == n_beats
    # The output carries every beat. Being store-and-forward, it can only idle while a
    # frame longer than the one before it is still arriving: it ends at most one frame
    # (plus the pipeline's latency) after the input.
    out_span = stats["last_out"] - stats["first_out"] + 1
    longest = max(-(-len(f) // nb) for f in frames)
    assert stats["last_out"] <= n_beats + longest + 8, stats
    report = os.environ.get("NETAGG_BENCH_OUT")
    if report:
        with open(report, "w") as f:
            json.dump({
                "width": WIDTH, "frames": len(frames), "beats": n_beats,
                "in_beats_per_cycle": n_beats / stats["cycles"],
                "out_beats_per_cycle": n_beats / out_span,
                "latency_cycles": stats["first_out"], "wall_seconds": round(wall, 3),
                "sim_cycles_per_second": round(stats["last_out"] / wall),
            }, f)
