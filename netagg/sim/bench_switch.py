"""The switch's line-rate benchmark: the cocotb testcase `line_rate`, run inside the
simulator on the whole switch (`sim.tops.SwitchTop`, its parameters from NETAGG_SWITCH as
JSON), and the testbench that drives it (`SwitchTB`, which the switch's tests use too).

One job of one worker per port, 16 slots. One use of the last slot alone first measures the
latency from its last contribution's last beat to its first result beat; then every worker
sends its contributions of 1024 bytes back to back on its own port, NETAGG_ROUNDS uses of
each slot (4 by default), as a host builds them (`netagg.contract.wire`). The testcase checks that
every result comes out; with NETAGG_BENCH_OUT set it writes its figures there as JSON (beats per
cycle taken on each port, the latency, cycles and simulated cycles per second), else it
checks that every port took one beat per cycle. `netagg bench switch` runs it
(`netagg/apps/bench_line_rate.py`), and so do the tests.
"""

from __future__ import annotations

import json
import os
import random
import time

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.model import BENCH_KEY

PARAMS = json.loads(os.environ.get("NETAGG_SWITCH", "{}"))
PORTS = PARAMS.get("ports", 4)
WIDTH = PARAMS.get("width", 64)
NB = WIDTH // 8

HOST = W.Endpoint("10.0.9.9", 0xD000, 0x02BB00000009)     # where control requests come from
SWITCH = W.Endpoint("10.0.0.1", W.ROCEV2_PORT, 0x02AA00000001)


class SwitchTB:
    """Drives every rx port from a queue of frames (back to back, or with idle cycles),
    takes every tx port's frames (always ready, or with backpressure), and records commits,
    and each frame's first and last beat cycles in (`in_times`, beside `sent`) and out
    (`out_times`, beside `received`). `on_frame(port, frame)`, when given, is called in the
    cycle a frame's last beat leaves tx `port` (a network that answers in zero simulated
    time, `sim.bench_leaf`'s spines, sends from it)."""

    def __init__(self, dut, seed=0, idle=0.0, backpressure=0.0, on_frame=None):
        self.dut, self.idle, self.backpressure = dut, idle, backpressure
        self.on_frame = on_frame
        self.rng = random.Random(seed)
        self.queues = [[] for _ in range(PORTS)]
        self.sent = [[] for _ in range(PORTS)]          # frames fully sent, per port
        self.received = [[] for _ in range(PORTS)]
        self.commits = []                               # (cycle, port, nulled)
        self.cycle = 0
        self.beats_in = [0] * PORTS
        self.beats_out = [0] * PORTS
        self.in_times = [[] for _ in range(PORTS)]     # (first, last) cycle, beside `sent`
        self.out_times = [[] for _ in range(PORTS)]    # (first, last) cycle, beside `received`
        self.stalls = [0] * PORTS                       # cycles a beat waited for tready
        self.last_in_cycle = 0                          # the latest beat taken on any port
        self.frame_starts = []                          # cycle of each frame's first beat out
        self.sending = False
        cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
        self.rx = [self._port(f"rx{p}") for p in range(PORTS)]
        self.tx = [self._port(f"tx{p}") for p in range(PORTS)]
        self.committed = [getattr(dut, f"committed{p}") for p in range(PORTS)]
        self.nulled = [getattr(dut, f"nulled{p}") for p in range(PORTS)]
        for p in range(PORTS):
            self.rx[p]["tvalid"].value = 0
            self.tx[p]["tready"].value = 0

    def _port(self, prefix):
        return {n: getattr(self.dut, f"{prefix}_{n}")
                for n in ("tdata", "tkeep", "tlast", "tvalid", "tready")}

    async def reset(self):
        self.dut.rst.value = 1
        await ClockCycles(self.dut.clk, 4)
        self.dut.rst.value = 0
        await ClockCycles(self.dut.clk, 2)
        cocotb.start_soon(self._run())

    def send(self, port: int, frame: bytes):
        self.queues[port].append(bytes(frame))

    async def _run(self):
        """One loop for every port, so that a cycle costs one trigger, not one per port."""
        beats = [[] for _ in range(PORTS)]       # beats of the frame being sent
        current = [None] * PORTS
        partial = [bytearray() for _ in range(PORTS)]
        first_in, first_out = [0] * PORTS, [0] * PORTS
        while True:
            for p in range(PORTS):
                rx = self.rx[p]
                if not beats[p] and self.queues[p]:
                    current[p] = self.queues[p].pop(0)
                    f = current[p]
                    beats[p] = [f[i:i + NB] for i in range(0, len(f), NB)]
                    beats[p][-1] = (beats[p][-1], True)
                    beats[p][:-1] = [(b, False) for b in beats[p][:-1]]
                if beats[p] and not (self.idle and self.rng.random() < self.idle):
                    data, last = beats[p][0]
                    rx["tdata"].value = int.from_bytes(data, "little")
                    rx["tkeep"].value = (1 << len(data)) - 1
                    rx["tlast"].value = int(last)
                    rx["tvalid"].value = 1
                else:
                    rx["tvalid"].value = 0
                self.tx[p]["tready"].value = int(
                    not (self.backpressure and self.rng.random() < self.backpressure))
            await ReadOnly()
            fired = []
            for p in range(PORTS):
                rx, tx = self.rx[p], self.tx[p]
                fired.append(bool(rx["tvalid"].value) and bool(rx["tready"].value))
                if rx["tvalid"].value and not rx["tready"].value:
                    self.stalls[p] += 1
                if fired[p]:
                    self.last_in_cycle = self.cycle
                if tx["tvalid"].value and tx["tready"].value:
                    self.beats_out[p] += 1
                    if not partial[p]:
                        self.frame_starts.append(self.cycle)
                        first_out[p] = self.cycle
                    keep = int(tx["tkeep"].value)
                    n = bin(keep).count("1")
                    partial[p] += int(tx["tdata"].value).to_bytes(NB, "little")[:n]
                    if tx["tlast"].value:
                        self.received[p].append(bytes(partial[p]))
                        self.out_times[p].append((first_out[p], self.cycle))
                        partial[p] = bytearray()
                        if self.on_frame is not None:
                            self.on_frame(p, self.received[p][-1])
                if self.committed[p].value:
                    self.commits.append((self.cycle, p, bool(self.nulled[p].value)))
            self.sending = any(beats) or any(partial)
            await RisingEdge(self.dut.clk)
            self.cycle += 1
            for p in range(PORTS):
                if fired[p]:
                    self.beats_in[p] += 1
                    if len(beats[p]) * NB >= len(current[p]):     # its first beat
                        first_in[p] = self.cycle - 1
                    beats[p].pop(0)
                    if not beats[p]:
                        self.sent[p].append(current[p])
                        self.in_times[p].append((first_in[p], self.cycle - 1))

    async def drain(self, quiet=1000, limit=2_000_000):
        """Wait until every frame is sent, and nothing has been committed or come out for
        `quiet` cycles (a control request of 64 records takes about 150)."""
        last_seen, start = None, self.cycle
        while True:
            await ClockCycles(self.dut.clk, 50)
            seen = (sum(map(len, self.received)), len(self.commits))
            busy = any(self.queues) or self.sending
            if seen != last_seen or busy:
                last_seen, quiet_since = seen, self.cycle
            elif self.cycle - quiet_since >= quiet:
                return
            assert self.cycle - start < limit, "the switch did not go quiet"


def workers() -> list[W.Endpoint]:
    """One worker on each port: worker r enters, and hears from, port r."""
    return [W.Endpoint(f"10.1.0.{r + 10}", 0xC100 + r, 0x020000000000 | r) for r in range(PORTS)]


def config_frames(ws: list[W.Endpoint], slots: int) -> list[bytes]:
    """Control requests that give the switch its addresses and configure job 0 over `slots`
    slots with one worker per port (CONFIG last, which clears the job's slots)."""
    records = [(R.WRITE | R.REG_MAC_HI, SWITCH.mac >> 32),
               (R.WRITE | R.REG_MAC_LO, SWITCH.mac & 0xFFFFFFFF),
               (R.WRITE | R.REG_IP, W.ip_to_int(SWITCH.ip)),
               (R.WRITE | R.job_reg(0, R.JOB_CONFIG), 0),   # its range is fixed while enabled
               (R.WRITE | R.job_reg(0, R.JOB_SLOT_BASE), 0),
               (R.WRITE | R.job_reg(0, R.JOB_SLOT_COUNT), slots)]
    for r, w in enumerate(ws):
        records += [
            (R.WRITE | R.worker_reg(0, r, R.WORKER_PORT),
             R.WORKER_ENDPOINT.pack(switch_port=r, udp_port=w.port)),
            (R.WRITE | R.worker_reg(0, r, R.WORKER_MAC_HI), w.mac >> 32),
            (R.WRITE | R.worker_reg(0, r, R.WORKER_MAC_LO), w.mac & 0xFFFFFFFF),
            (R.WRITE | R.worker_reg(0, r, R.WORKER_IP), W.ip_to_int(w.ip)),
        ]
    records.append((R.WRITE | R.job_reg(0, R.JOB_CONFIG),
                    R.CONFIG.pack(enable=1, workers=len(ws))))
    records.append((R.WRITE | R.job_reg(0, R.JOB_KEY), BENCH_KEY))
    step = W.MAX_CONTROL_RECORDS
    return [W.control_request(records[i:i + step], i // step, HOST, SWITCH).frame()
            for i in range(0, len(records), step)]


def contribution(rank: int, w: W.Endpoint, slot: int, version: int, lanes: bytes, psn: int,
                 msn: int) -> bytes:
    return W.contribution(job=0, rank=rank, slot=slot, version=version, offset=0, lanes=lanes,
                          psn=psn, msn=msn, key=BENCH_KEY, src=w, dst=SWITCH).frame()


@cocotb.test()
async def line_rate(dut):
    """Every port receives contributions back to back; the switch must take one beat per
    cycle on every port, and send every result."""
    bench = os.environ.get("NETAGG_BENCH_OUT")
    tb = SwitchTB(dut, seed=9)
    await tb.reset()
    rounds = int(os.environ.get("NETAGG_ROUNDS", "4"))
    slots = 16
    ws = workers()
    for f in config_frames(ws, slots):
        tb.send(0, f)
    await tb.drain()
    lanes = np.arange(256, dtype="<i4").tobytes()
    # Latency: one slot alone, from its last contribution's last beat to its first result beat.
    for r, w in enumerate(ws):
        tb.send(r, contribution(r, w, slots - 1, 1, lanes, 0, msn=slots - 1))
    await tb.drain()
    latency = min(c for c in tb.frame_starts if c > tb.last_in_cycle) - tb.last_in_cycle
    received_before = sum(map(len, tb.received))
    psn = 1
    for rnd in range(rounds):
        for s in range(slots):
            for r, w in enumerate(ws):
                tb.send(r, contribution(r, w, s, rnd % 2, lanes, psn,
                                        msn=(rnd + 1) * slots + s))
            psn += 1
    start_cycle, start_beats, start_stalls = tb.cycle, list(tb.beats_in), list(tb.stalls)
    t0 = time.perf_counter()
    while any(tb.queues):
        await ClockCycles(dut.clk, 100)
    cycles = tb.cycle - start_cycle
    seconds = time.perf_counter() - t0
    await tb.drain()
    results = sum(map(len, tb.received)) - received_before
    expected = rounds * slots * PORTS
    in_rate = [(tb.beats_in[p] - start_beats[p]) /
               (tb.beats_in[p] - start_beats[p] + tb.stalls[p] - start_stalls[p])
               for p in range(PORTS)]
    dut._log.info("beats/cycle per port %s, results %d of %d", in_rate, results, expected)
    assert results == expected
    if bench:
        with open(bench, "w") as fh:
            json.dump({"ports": PORTS, "width": WIDTH, "beats_per_cycle": in_rate,
                       "latency_cycles": latency,
                       "cycles": cycles, "cycles_per_second": cycles / seconds,
                       "results": results}, fh)
    else:
        assert min(in_rate) >= 0.99, in_rate
