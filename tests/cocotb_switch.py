"""cocotb testbench of the whole switch (sim.tops.SwitchTop): scapy frames from N workers on
every port, compared frame for frame with the golden model, sums with numpy.

The golden model applies the good frames in the order the switch committed them (the
``committed{i}`` strobes; the k-th commit of a port is its k-th good frame) and frames the
parser rejects anywhere (they only count); the frames each port sends must equal the model's,
byte for byte, in order.
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

from host import wire as W
from sim import golden as G
from tests.switch_traffic import check_results, control_frame, scenario

PARAMS = json.loads(os.environ.get("NETAGG_SWITCH", "{}"))
PORTS = PARAMS.get("ports", 4)
WIDTH = PARAMS.get("width", 64)
NB = WIDTH // 8


def golden_switch() -> G.GoldenSwitch:
    return G.GoldenSwitch(
        ports=PORTS, jobs=PARAMS.get("jobs", 4), max_workers=PARAMS.get("max_workers", 8),
        slots=PARAMS.get("slots", 64), width=WIDTH,
        queue_capacity=PARAMS.get("queue_capacity", 4096))


class SwitchTB:
    """Drives every rx port from a queue of frames (back to back, or with idle cycles),
    takes every tx port's frames (always ready, or with backpressure), and records commits."""

    def __init__(self, dut, seed=0, idle=0.0, backpressure=0.0):
        self.dut, self.idle, self.backpressure = dut, idle, backpressure
        self.rng = random.Random(seed)
        self.queues = [[] for _ in range(PORTS)]
        self.sent = [[] for _ in range(PORTS)]          # frames fully sent, per port
        self.received = [[] for _ in range(PORTS)]
        self.commits = []                               # (cycle, port)
        self.cycle = 0
        self.beats_in = [0] * PORTS
        self.stalls = [0] * PORTS                       # cycles a beat waited for tready
        self.last_in_cycle = 0                          # the latest beat taken on any port
        self.frame_starts = []                          # cycle of each frame's first beat out
        self.sending = False
        cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
        self.rx = [self._port(f"rx{p}") for p in range(PORTS)]
        self.tx = [self._port(f"tx{p}") for p in range(PORTS)]
        self.committed = [getattr(dut, f"committed{p}") for p in range(PORTS)]
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
                    if not partial[p]:
                        self.frame_starts.append(self.cycle)
                    keep = int(tx["tkeep"].value)
                    n = bin(keep).count("1")
                    partial[p] += int(tx["tdata"].value).to_bytes(NB, "little")[:n]
                    if tx["tlast"].value:
                        self.received[p].append(bytes(partial[p]))
                        partial[p] = bytearray()
                if self.committed[p].value:
                    self.commits.append((self.cycle, p))
            self.sending = any(beats) or any(partial)
            await RisingEdge(self.dut.clk)
            self.cycle += 1
            for p in range(PORTS):
                if fired[p]:
                    self.beats_in[p] += 1
                    beats[p].pop(0)
                    if not beats[p]:
                        self.sent[p].append(current[p])

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


def accepted(model: G.GoldenSwitch, frame: bytes) -> bool:
    """Whether the switch's ingress commits this frame (it is then applied in commit order)."""
    verdict, info = G.parse(frame)
    return verdict == G.OK and info[2] <= model.queue_capacity


class Golden:
    """The model, fed in commit order: the k-th commit of a port is its k-th good frame;
    frames the ingress rejects are applied as they are sent (they only count)."""

    def __init__(self):
        self.model = golden_switch()
        self.sent = [0] * PORTS          # frames of each port looked at
        self.good = [[] for _ in range(PORTS)]
        self.commits = 0
        self.expected = [[] for _ in range(PORTS)]

    def catch_up(self, tb: SwitchTB):
        for p in range(PORTS):
            for f in tb.sent[p][self.sent[p]:]:
                if accepted(self.model, f):
                    self.good[p].append(f)
                else:
                    assert self.model.receive(p, f) == []
            self.sent[p] = len(tb.sent[p])
        for _, p in tb.commits[self.commits:]:
            for port, frame in self.model.receive(p, self.good[p].pop(0)):
                self.expected[port].append(frame)
        self.commits = len(tb.commits)


async def run_scenario(dut, seed, idle=0.0, backpressure=0.0, **kwargs):
    tb = SwitchTB(dut, seed=seed, idle=idle, backpressure=backpressure)
    await tb.reset()
    rng = random.Random(seed)
    sc = scenario(rng, ports=PORTS, **kwargs)
    model = Golden()
    for f in sc.config:
        tb.send(0, f)
    await tb.drain()
    model.catch_up(tb)
    outputs = []
    for rnd, batch in enumerate(sc.rounds):
        before = [len(r) for r in tb.received]
        for port, frame in batch:
            tb.send(port, frame)
        await tb.drain()
        model.catch_up(tb)
        outputs += [(rnd, p, f) for p in range(PORTS) for f in tb.received[p][before[p]:]]
    # Counters: control requests reading them all, answered alike by both.
    reads = counter_reads()
    for i in range(0, len(reads), W.MAX_CONTROL_RECORDS):
        chunk = reads[i:i + W.MAX_CONTROL_RECORDS]
        tb.send(1, control_frame([(a, 0) for _, a in chunk], psn=100 + i))
    await tb.drain()
    model.catch_up(tb)
    log_counter_differences(dut, tb, model, reads)
    assert_same(dut, tb, model)
    results = [o for o in outputs if W.parse_frame(o[2]).opcode == W.OP_RESULT]
    check_results(sc, results)
    counters = model.model.counters()
    dut._log.info("counters %s", counters)
    return tb, model, sc


def counter_reads():
    """(name, address) of every port counter and of the counters of jobs 0 and 1."""
    return ([(f"port{p}.{n}", W.port_counter(p, n)) for p in range(PORTS)
             for n in W.PORT_COUNTERS]
            + [(f"job{j}.{n}", W.job_counter(j, n)) for j in range(2) for n in W.JOB_COUNTERS])


def assert_same(dut, tb, model):
    """Every port sent the model's frames, in the model's order."""
    for p in range(PORTS):
        got_frames, want_frames = tb.received[p], model.expected[p]
        for k, (got, want) in enumerate(zip(got_frames, want_frames)):
            if got != want:
                dut._log.error("port %d frame %d:\n switch %s\n model  %s", p, k, got.hex(),
                               want.hex())
            assert got == want, f"port {p} frame {k} differs from the model's"
        if len(got_frames) < len(want_frames):
            dut._log.error("port %d: the model's frames the switch did not send: %s", p,
                           [f[:60].hex() for f in want_frames[len(got_frames):]])
        assert len(got_frames) == len(want_frames), (
            f"port {p}: {len(got_frames)} frames out, the model sends {len(want_frames)}")


def log_counter_differences(dut, tb, model, reads):
    """Log the counters where the switch's last control replies on port 1 and the model's
    differ (the switch's view of what happened to the packets)."""
    def values(frames):
        out = []
        for f in frames:
            try:
                pkt = W.parse_frame(f)
            except W.WireError as e:
                dut._log.error("frame out is not a good packet (%s): %s", e, f.hex())
                continue
            if pkt.opcode == W.OP_CONTROL:
                out += [v for _, v in W.unpack_records(pkt.payload)]
        return out[-len(reads):]
    got, want = values(tb.received[1]), values(model.expected[1])
    for (name, _), g, w in zip(reads, got, want):
        if g != w:
            dut._log.error("counter %s: switch %d, model %d", name, g, w)


@cocotb.test()
async def control_path(dut):
    """Configuration, then register reads of every size on every port, answered as the
    model answers."""
    tb = SwitchTB(dut, seed=4)
    await tb.reset()
    sc = scenario(random.Random(4), ports=PORTS, jobs=2, workers=2, slots=2, rounds=0)
    model = Golden()
    for f in sc.config:
        tb.send(0, f)
    addresses = [W.REG_MAGIC, W.REG_PARAMS, W.REG_SLOTS, W.REG_IP, W.job_reg(1, W.JOB_CONFIG)]
    addresses += [W.port_counter(p, n) for p in range(PORTS) for n in W.PORT_COUNTERS]
    for n, count in enumerate((1, 5, 8, 64, 63)):
        port = n % PORTS
        tb.send(port, control_frame([(a, 0) for a in (addresses * 2)[:count]], psn=n,
                                    sport=0xD000 + port))
    await tb.drain()
    model.catch_up(tb)
    assert_same(dut, tb, model)


@cocotb.test()
async def aggregate_scenario(dut):
    """Two jobs of three workers, three rounds, duplicates and malformed frames, back to
    back on every port."""
    await run_scenario(dut, seed=1, jobs=2, workers=3, slots=6, rounds=3, max_lanes=64)


@cocotb.test()
async def aggregate_idle_backpressure(dut):
    """The same with idle cycles on the sources and backpressure on the sinks."""
    await run_scenario(dut, seed=2, idle=0.3, backpressure=0.3, jobs=2, workers=2, slots=4,
                       rounds=3, max_lanes=256)


@cocotb.test()
async def egress_pressure(dut):
    """Full-size payloads back to back into sinks that take one beat in four: the egress
    rings fill, a result that goes to several ports waits for all of them, and the ingress
    queues push back."""
    await run_scenario(dut, seed=5, backpressure=0.75, jobs=1, workers=PORTS, slots=12,
                       rounds=2, max_lanes=256, duplicates=0.05, malformed=0)


@cocotb.test()
async def saturation(dut):
    """Sums that saturate carry the overflow flag; others stay exact."""
    _, model, _ = await run_scenario(dut, seed=3, jobs=1, workers=2, slots=4, rounds=2,
                                     saturate=True, duplicates=0, malformed=0)
    assert model.model.job_counters[0]["overflows"] > 0


@cocotb.test()
async def line_rate(dut):
    """Every port receives contributions back to back; the switch must take one beat per
    cycle on every port, and send every result."""
    bench = os.environ.get("NETAGG_BENCH_OUT")
    tb = SwitchTB(dut, seed=9)
    await tb.reset()
    rng = random.Random(9)
    rounds = int(os.environ.get("NETAGG_ROUNDS", "4"))
    slots = 16
    sc = scenario(rng, ports=PORTS, jobs=1, workers=PORTS, slots=slots, rounds=1,
                  max_lanes=256, duplicates=0, malformed=0)
    for f in sc.config:
        tb.send(0, f)
    await tb.drain()
    ws = sc.workers[0]
    lanes = np.arange(256, dtype=np.int32)
    # Latency: one slot alone, from its last contribution's last beat to its first result beat.
    for w in ws:
        tb.send(w.port, w.contribution(slots - 1, 1, 0, lanes, 0))
    await tb.drain()
    latency = min(c for c in tb.frame_starts if c > tb.last_in_cycle) - tb.last_in_cycle
    received_before = sum(map(len, tb.received))
    psn = 1
    for rnd in range(rounds):
        for s in range(slots):
            for w in ws:
                tb.send(w.port, w.contribution(s, rnd % 2, 0, lanes, psn))
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
