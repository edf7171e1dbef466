"""The leaf's line-rate benchmark and the second level's latency: cocotb testcases run inside
the simulator on the whole switch (`sim.tops.SwitchTop`, its parameters from NETAGG_SWITCH as
JSON), driven by the switch's testbench (`sim.bench_switch.SwitchTB`).

`line_rate`, on a leaf (`Switch(uplinks=2)`, 2 downlinks, ports 0 and 1, and 2 uplinks,
ports 2 and 3): golden spines (`GoldenSpine`, one per uplink, whose job's one "worker" is
this leaf) answer each partial in the cycle its last beat leaves the uplink (zero simulated
time, no wire delay: the result is queued on the uplink's rx at once). Two cases, workers
sending contributions of 1024 bytes back to back on both downlinks, NETAGG_ROUNDS uses of
every slot (4 by default):

- 1:1: two jobs, each with one local worker (port 0, port 1): every contribution completes
  its use at the leaf and goes up as a partial, so the uplinks carry what the downlinks do.
  Job 1's SPRAY is job 0's with the uplinks swapped, so that the two partials of a moment go
  up different uplinks;
- 2:1: one job of the two workers: one partial per two contributions, half the load.

Per port and direction it measures beats per cycle (beats over the cycles from the case's
first beat there to its last) and the cycles a beat waited on rx (`stalls`). Before the 2:1
stream, one use of one slot alone measures the leaf's two latencies: up (the last local
contribution's last beat in -> the partial's first beat on the uplink) and down (the spine's
result's last beat in -> the first result beat to a worker).

`hop_latency`, on a spine (`Switch(spine=True)`) or a single switch (NETAGG_HOP "spine" or
"single"): one use of two contributions (a spine's: two leaves' partials) of 1024 bytes, from
the last one's last beat in to the result's first beat out, as `sim.bench_switch` measures a
single switch's.

With NETAGG_BENCH_OUT set each writes its figures there as JSON; else `line_rate` checks that
the 1:1 uplinks carried one beat per cycle out and in. `netagg bench leafspine` runs them
(`netagg/apps/bench_leafspine.py`), and so do the tests.
"""

from __future__ import annotations

import json
import os

import cocotb
import numpy as np

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.bench_switch import HOST, NB, PARAMS, PORTS, SWITCH, SwitchTB
from netagg.sim.golden_spine import GoldenSpine
from netagg.sim.model import BENCH_KEY
from netagg.sim.topology import Role, default_ip, default_mac

UPLINKS = PARAMS.get("uplinks", 0)
DOWNLINKS = PORTS - UPLINKS
JOBS, SLOTS, MAX_WORKERS = PARAMS.get("jobs", 2), PARAMS.get("slots", 16), \
    PARAMS.get("max_workers", 4)
SPINE_KEY = 0x5B1E0077          # every leaf job's PARENT_KEY, the spines' job KEY
LANES = np.arange(256, dtype="<i4").tobytes()      # 1024 bytes


def leaf(l: int = 0) -> W.Endpoint:
    return W.Endpoint(default_ip(Role.LEAF, l), W.ROCEV2_PORT, default_mac(Role.LEAF, l))


def spine(s: int) -> W.Endpoint:
    return W.Endpoint(default_ip(Role.SPINE, s), W.ROCEV2_PORT, default_mac(Role.SPINE, s))


def worker(job: int, port: int) -> W.Endpoint:
    """The local worker of `job` on leaf port `port`."""
    return W.Endpoint(f"10.1.{job}.{port + 10}", 0xC100 + 16 * job + port,
                      0x020000000000 | job << 8 | port)


def requests(records, me: W.Endpoint) -> list[bytes]:
    step = W.MAX_CONTROL_RECORDS
    return [W.control_request(records[i:i + step], i // step, HOST, me).frame()
            for i in range(0, len(records), step)]


def address_records(me: W.Endpoint) -> list[tuple[int, int]]:
    return [(R.WRITE | R.REG_MAC_HI, me.mac >> 32), (R.WRITE | R.REG_MAC_LO, me.mac & 0xFFFFFFFF),
            (R.WRITE | R.REG_IP, W.ip_to_int(me.ip))]


def uplink_records(uplinks: int, first_port: int) -> list[tuple[int, int]]:
    """A leaf's uplink table: uplink i leaves by port `first_port + i` to spine i."""
    records = [record for i in range(uplinks)
               for record in W.uplink_records(i, first_port + i, spine(i))]
    return [(R.WRITE | a, v) for a, v in records] + [(R.WRITE | R.REG_UPLINK_DOWN, 0)]


def job_records(job: int, members: list[tuple[W.Endpoint, int, int]], slot_base: int,
                slot_count: int, key: int, *, partials: bool = False, qpn: int = 0,
                parent: dict | None = None) -> list[tuple[int, int]]:
    """`job` over `slot_count` slots from `slot_base`, its members (endpoint, switch port,
    R_Key) in rank order; a spine's (`partials`: the members are leaves at `qpn`), or a
    leaf's with `parent` (rank, spray word)."""
    records = [(R.WRITE | R.job_reg(job, R.JOB_CONFIG), 0),
               (R.WRITE | R.job_reg(job, R.JOB_SLOT_BASE), slot_base),
               (R.WRITE | R.job_reg(job, R.JOB_SLOT_COUNT), slot_count)]
    for r, (ep, port, rkey) in enumerate(members):
        records += [(R.WRITE | a, v) for a, v in W.entry_records(job, r, port, ep, qpn,
                                                                  rkey=rkey)]
    records.append((R.WRITE | R.job_reg(job, R.JOB_CONFIG),
                    R.CONFIG.pack(enable=1, partials=int(partials), workers=len(members))))
    records.append((R.WRITE | R.job_reg(job, R.JOB_KEY), key))
    if parent is not None:
        records += [(R.WRITE | R.job_reg(job, R.JOB_PARENT_KEY), SPINE_KEY),
                    (R.WRITE | R.job_reg(job, R.JOB_SPRAY), parent["spray"]),
                    (R.WRITE | R.job_reg(job, R.JOB_PARENT),
                     R.PARENT.pack(enable=1, rank=parent["rank"]))]
    return records


def spine_job_records(job: int, leaves: int, slot_base: int, slot_count: int):
    """A spine's `job`: partials from `leaves` leaves, leaf l on the spine's port l."""
    members = [(leaf(l), l, SPINE_KEY) for l in range(leaves)]
    return job_records(job, members, slot_base, slot_count, SPINE_KEY, partials=True,
                       qpn=W.UPLINK_QPN)


def alternate(swap: bool = False) -> int:
    """SPRAY over 2 uplinks, slot by slot (swapped: the other uplink first)."""
    return R.spray_word([(e + swap) % 2 for e in range(R.SPRAY_ENTRIES)])


class Spines:
    """Golden spines, one per uplink, that answer a partial in the cycle its last beat leaves
    the leaf: their frames to the leaf (port 0 of each) go into the uplink's rx queue."""

    def __init__(self, tb: SwitchTB, uplinks: int):
        self.tb, self.uplinks = tb, uplinks
        self.spines = [GoldenSpine(ports=2, jobs=JOBS, max_workers=MAX_WORKERS, slots=SLOTS)
                       for _ in range(uplinks)]
        for i in range(uplinks):
            self.control(i, address_records(spine(i)))

    def control(self, i: int, records):
        for frame in requests(records, spine(i)):
            self.spines[i].receive(1, frame)

    def frame(self, port: int, frame: bytes):
        """`SwitchTB.on_frame`: a frame out of an uplink goes to its spine."""
        i = port - DOWNLINKS
        if 0 <= i < self.uplinks:
            for out_port, out in self.spines[i].receive(0, frame):
                if out_port == 0:
                    self.tb.send(port, out)


async def configure(tb: SwitchTB, spines: Spines, jobs: list[list[int]], sprays: list[int]):
    """The leaf's addresses and uplinks, and `jobs` (the local workers' ports of each, the
    job's SPRAY word beside) over equal shares of the slots; the spines' jobs alike, with
    this leaf their only one."""
    slots = SLOTS // len(jobs)
    records = address_records(leaf()) + uplink_records(UPLINKS, DOWNLINKS)
    for j in range(JOBS):
        records.append((R.WRITE | R.job_reg(j, R.JOB_CONFIG), 0))
    for j, ports in enumerate(jobs):
        members = [(worker(j, p), p, 0) for p in ports]
        records += job_records(j, members, j * slots, slots, BENCH_KEY,
                               parent={"rank": 0, "spray": sprays[j]})
        for i in range(UPLINKS):
            spines.control(i, spine_job_records(j, 1, j * slots, slots))
    for f in requests(records, leaf()):
        tb.send(0, f)
    await tb.drain()
    return slots


def contribution(job: int, rank: int, port: int, slot: int, msn: int, slots: int) -> bytes:
    return W.contribution(job=job, rank=rank, slot=slot, version=(msn // slots) % 2, offset=0,
                          lanes=LANES, psn=msn, msn=msn, key=BENCH_KEY, src=worker(job, port),
                          dst=leaf()).frame()


def beats(frame: bytes) -> int:
    return -(-len(frame) // NB)


def port_rates(tb: SwitchTB, since: tuple[list[int], list[int], list[int]]) -> list[dict]:
    """Per port, the frames in and out since `since` (counts of `sent`, `received`,
    `stalls`): beats per cycle over the span of each direction's beats, and the rx stalls."""
    sent0, received0, stalls0 = since
    out = []
    for p in range(PORTS):
        figures = {}
        for name, frames, times in (("in", tb.sent[p][sent0[p]:], tb.in_times[p][sent0[p]:]),
                                    ("out", tb.received[p][received0[p]:],
                                     tb.out_times[p][received0[p]:])):
            span = times[-1][1] - times[0][0] + 1 if times else 0
            figures[f"{name}_frames"] = len(frames)
            figures[f"{name}_beats_per_cycle"] = (
                round(sum(map(beats, frames)) / span, 4) if span else 0.0)
        figures["stalls"] = tb.stalls[p] - stalls0[p]
        out.append(figures)
    return out


def mark(tb: SwitchTB):
    return [len(s) for s in tb.sent], [len(r) for r in tb.received], list(tb.stalls)


async def stream(tb: SwitchTB, jobs: list[list[int]], slots: int, rounds: int,
                 first_use: int) -> list[dict]:
    """Every job's workers send `rounds` uses of each of its slots back to back; every result
    must come back; the ports' figures."""
    since = mark(tb)
    expected = 0
    for u in range(first_use, first_use + rounds):
        for s in range(slots):
            for j, ports in enumerate(jobs):
                for r, p in enumerate(ports):
                    tb.send(p, contribution(j, r, p, s, u * slots + s, slots))
                    expected += 1
    await tb.drain()
    figures = port_rates(tb, since)
    results = sum(figures[p]["out_frames"] for p in range(DOWNLINKS))
    assert results == expected, f"{results} results of {expected}"
    return figures


async def leaf_latency(tb: SwitchTB, ports: list[int], slot: int, slots: int) -> dict:
    """One use of `slot` alone by the workers on `ports` (job 0): the leaf's up and down
    latencies in cycles."""
    since = mark(tb)
    for r, p in enumerate(ports):
        tb.send(p, contribution(0, r, p, slot, slot, slots))
    await tb.drain()
    last_in = max(tb.in_times[p][-1][1] for p in ports)
    up_port = next(p for p in range(DOWNLINKS, PORTS) if len(tb.received[p]) > since[1][p])
    up = tb.out_times[up_port][since[1][up_port]][0] - last_in
    result_in = tb.in_times[up_port][since[0][up_port]][1]
    down = min(tb.out_times[p][since[1][p]][0] for p in ports) - result_in
    return {"leaf_up": up, "leaf_down": down}


@cocotb.test()
async def line_rate(dut):
    """Both downlinks at line rate, 1:1 and 2:1: every result comes back; the figures."""
    bench = os.environ.get("NETAGG_BENCH_OUT")
    rounds = int(os.environ.get("NETAGG_ROUNDS", "4"))
    tb = SwitchTB(dut, seed=9)
    spines = Spines(tb, UPLINKS)
    tb.on_frame = spines.frame
    await tb.reset()
    report = {"ports": PORTS, "downlinks": DOWNLINKS, "uplinks": UPLINKS, "rounds": rounds,
              "payload_bytes": len(LANES), "wire_delay_cycles": 0}
    shared = [list(range(DOWNLINKS))]
    slots = await configure(tb, spines, shared, [alternate()])
    report["latency_cycles"] = await leaf_latency(tb, shared[0], slots - 1, slots)
    report["2:1"] = await stream(tb, shared, slots, rounds, 1)
    apart = [[p] for p in range(DOWNLINKS)]
    slots = await configure(tb, spines, apart, [alternate(j % 2 == 1) for j in range(len(apart))])
    report["1:1"] = await stream(tb, apart, slots, rounds, 0)
    for case in ("1:1", "2:1"):
        dut._log.info("%s: %s", case, report[case])
    dut._log.info("latency %s", report["latency_cycles"])
    if bench:
        with open(bench, "w") as fh:
            json.dump(report, fh)
    else:
        one = report["1:1"]
        for p in range(DOWNLINKS, PORTS):
            assert one[p]["out_beats_per_cycle"] >= 0.99, one[p]
            assert one[p]["in_beats_per_cycle"] >= 0.99, one[p]
        for p in range(DOWNLINKS):
            assert one[p]["in_beats_per_cycle"] >= 0.99, one[p]


@cocotb.test()
async def hop_latency(dut):
    """One use through a spine (NETAGG_HOP "spine": two leaves' partials) or a single switch
    ("single": two workers' contributions): the last one's last beat in -> the result's first
    beat out."""
    hop = os.environ.get("NETAGG_HOP", "single")
    tb = SwitchTB(dut, seed=9)
    await tb.reset()
    if hop == "spine":
        me = spine(0)
        records = spine_job_records(0, 2, 0, SLOTS)
        senders = [(leaf(l), l, SPINE_KEY, W.pack_imm(W.PARTIAL, count=1)) for l in range(2)]
    else:
        me = SWITCH
        records = job_records(0, [(worker(0, p), p, 0) for p in range(2)], 0, SLOTS, BENCH_KEY)
        senders = [(worker(0, p), p, BENCH_KEY, 0) for p in range(2)]
    for f in requests(address_records(me) + records, me):
        tb.send(0, f)
    await tb.drain()
    since = mark(tb)
    for rank, (src, port, key, psn) in enumerate(senders):
        tb.send(port, W.contribution(job=0, rank=rank, slot=0, version=0, offset=0, lanes=LANES,
                                     psn=psn, msn=0, key=key, src=src, dst=me,
                                     dqpn=0 if hop == "spine" else 2).frame())
    await tb.drain()
    last_in = max(tb.in_times[port][-1][1] for _, port, _, _ in senders)
    firsts = [tb.out_times[p][since[1][p]][0] for p in range(PORTS)
              if len(tb.received[p]) > since[1][p]]
    assert len(firsts) == 2, "the use did not complete"
    latency = min(firsts) - last_in
    dut._log.info("%s: latency %d cycles", hop, latency)
    bench = os.environ.get("NETAGG_BENCH_OUT")
    if bench:
        with open(bench, "w") as fh:
            json.dump({"hop": hop, "latency_cycles": latency}, fh)
    assert latency > 0
