"""`netagg bench leafspine`: what the second level of a leaf and spine fabric costs and how
evenly it spreads the load.

- **Balance**: `workers` in-process workers over `leaves` leaves allreduce `values` float32
  values through a fabric of 2 and of 4 spines (golden); each leaf's partials up each uplink
  are counted on the links (`sim.topology.Topology.partials`), and the report gives each
  uplink's share of them and the largest share over the even one (1.0: perfectly even). The
  hosts deal slots round robin and SPRAY deals slots over the uplinks, so the share is even
  up to the slots of the last round.
- **Latency of the second level**: an allreduce of one packet (one chunk of lanes) per
  worker, repeated, through one switch (`sim.golden.GoldenSwitch`, the same workers) and
  through the fabric: the frames a use crosses between switches per completed use (a partial
  up and a result down per leaf) and the link hops on its path (worker -> leaf -> spine ->
  leaf -> worker: 4, against 2), and the wall time per allreduce of each (the golden model's
  Python time, which says what the level costs in frames handled, not a switch's latency).
- **The RTL** (`rtl_figures`, Verilator under cocotb, `netagg/sim/bench_leaf.py`): the leaf
  (`Switch(uplinks=2)`, 2 downlinks, 2 uplinks) with both downlinks at line rate and golden
  spines answering in zero simulated time: beats per cycle out and in on each uplink and
  downlink, and the cycles a port stalled, with one local worker per job (1:1, every
  contribution a partial) and one job of two local workers (2:1); and `latency_cycles`, one
  use of 1024 bytes: the leaf up (last local contribution's last beat -> the partial's first
  beat on the uplink), the RTL spine (`Switch(spine=True)`: the last partial's last beat in ->
  the result's first beat out), the leaf down (the spine's result's last beat in -> the first
  result beat to a worker), one switch measured as the spine is, and what the second level
  adds: up + spine + down - one switch.
"""

from __future__ import annotations

import json
import time
import uuid

import numpy as np

from netagg.apps.bench_line_rate import cocotb_run
from netagg.apps.demo import demo_data

# The RTL builds: the tables of tests/test_switch.py's switch (so that its build is the single
# switch's), as a leaf of 2 downlinks and 2 uplinks, and as a spine.
SINGLE = {"ports": 4, "width": 64, "jobs": 2, "max_workers": 4, "slots": 16}
LEAF = {**SINGLE, "uplinks": 2}
SPINE = {**SINGLE, "spine": True}


def _workers(switch, workers: int, fabric=None):
    from netagg.host import Worker
    session = uuid.uuid4().hex
    return [Worker(r, workers, None if fabric is not None else switch, session=session,
                   fabric=fabric) for r in range(workers)]


def _allreduce(ws, xs):
    handles = [w.allreduce_async(x) for w, x in zip(ws, xs)]
    return [h.wait(60) for h in handles]


def balance(spines: int, leaves: int = 2, workers: int = 8, values: int = 200_000,
            make=None) -> dict:
    """Partials per uplink, and their shares, over a fabric of `leaves` x `spines`."""
    from netagg.sim.topology import Topology
    topology = Topology(leaves, spines, make=make, max_workers=max(8, workers // leaves))
    ws = _workers(topology, workers, topology)
    xs = [demo_data(r, values, 0) for r in range(workers)]
    _allreduce(ws, xs)
    for w in ws:
        w.close()
    per_leaf = topology.partials()
    per_uplink = [sum(p[i] for p in per_leaf.values()) for i in range(spines)]
    total = sum(per_uplink)
    shares = [round(n / total, 4) for n in per_uplink]
    return {"spines": spines, "leaves": leaves, "partials_per_uplink": per_uplink,
            "partials_per_leaf": per_leaf, "shares": shares,
            "max_share_over_even": round(max(shares) * spines, 4)}


def latency(spines: int = 2, leaves: int = 2, workers: int = 8, rounds: int = 200,
            make=None) -> dict:
    """One packet's allreduce through one switch and through the fabric, `rounds` times."""
    from netagg.sim.golden import GoldenSwitch
    from netagg.sim.topology import Topology
    out = {}
    for level, make_backend in (("one_switch", None), ("leaf_spine", "fabric")):
        if make_backend is None:
            switch = GoldenSwitch(max_workers=max(8, workers))
            ws = _workers(switch, workers)
            topology = None
        else:
            topology = Topology(leaves, spines, make=make,
                                max_workers=max(8, workers // leaves))
            ws = _workers(topology, workers, topology)
        xs = [np.full(ws[0].lanes, r + 1, np.int32) for r in range(workers)]
        _allreduce(ws, xs)                      # warm: set-up, first packets
        hops0 = topology.hops if topology is not None else 0
        t0 = time.perf_counter()
        for _ in range(rounds):
            _allreduce(ws, xs)
        seconds = (time.perf_counter() - t0) / rounds
        for w in ws:
            w.close()
        out[level] = {"wall_us_per_allreduce": round(seconds * 1e6, 1),
                      "link_hops_on_path": 2 if topology is None else 4,
                      "frames_between_switches_per_use":
                          0.0 if topology is None else (topology.hops - hops0) / rounds}
    out["added_wall_us"] = round(out["leaf_spine"]["wall_us_per_allreduce"]
                                 - out["one_switch"]["wall_us_per_allreduce"], 1)
    out["added_link_hops"] = 2
    return out


def rtl_figures(rounds: int = 8, console=None) -> dict:
    """The RTL leaf at line rate and the second level's latency in cycles (`sim.bench_leaf`,
    three Verilator builds, cached): `uplink_beats_per_cycle` per case and uplink, the
    per-port figures, and `latency_cycles`."""
    from rich.console import Console
    console = console or Console(stderr=True, quiet=True)
    module = "netagg.sim.bench_leaf"

    def run(params, testcase, what, **env):
        return cocotb_run("switch", module, params, {
            "NETAGG_SWITCH": json.dumps(params), "NETAGG_WIDTH": str(params["width"]), **env},
            console, what, testcase)
    leaf = run(LEAF, "line_rate", "the leaf", NETAGG_ROUNDS=str(rounds))
    spine = run(SPINE, "hop_latency", "the spine", NETAGG_HOP="spine")
    single = run(SINGLE, "hop_latency", "one switch", NETAGG_HOP="single")
    down = leaf["downlinks"]
    latency = {**leaf["latency_cycles"], "spine": spine["latency_cycles"]}
    latency["two_levels"] = latency["leaf_up"] + latency["spine"] + latency["leaf_down"]
    latency["single_switch"] = single["latency_cycles"]
    latency["added"] = latency["two_levels"] - latency["single_switch"]
    cases = {case: {f"uplink{p - down}": {"out": leaf[case][p]["out_beats_per_cycle"],
                                          "in": leaf[case][p]["in_beats_per_cycle"]}
                    for p in range(down, leaf["ports"])} for case in ("1:1", "2:1")}
    ports = {case: {(f"downlink{p}" if p < down else f"uplink{p - down}"): leaf[case][p]
                    for p in range(leaf["ports"])} for case in ("1:1", "2:1")}
    return {"latency_cycles": latency, "uplink_beats_per_cycle": cases, "ports": ports,
            "rounds": rounds, "payload_bytes": leaf["payload_bytes"],
            "wire_delay_cycles": leaf["wire_delay_cycles"],
            "build_seconds": round(leaf["build_seconds"] + spine["build_seconds"]
                                   + single["build_seconds"], 1)}


def bench_leafspine(quiet: bool = False, workers: int = 8, values: int = 200_000,
                    make=None) -> dict:
    from rich.console import Console
    console = Console(stderr=True, quiet=quiet)
    report = {"bench": "leafspine", "backend": "golden (balance, latency's frames and wall "
              "time), rtl (beats per cycle, latency_cycles)", "workers": workers,
              "values": values, "balance": [], "latency": None}
    for spines in (2, 4):
        b = balance(spines, workers=workers, values=values, make=make)
        report["balance"].append(b)
        console.print(f"{spines} spines: partials per uplink {b['partials_per_uplink']}, "
                      f"shares {b['shares']}, largest over even {b['max_share_over_even']}")
    lat = report["latency"] = latency(workers=workers, make=make)
    console.print(f"one packet's allreduce: {lat['one_switch']['wall_us_per_allreduce']} us "
                  f"through one switch, {lat['leaf_spine']['wall_us_per_allreduce']} us "
                  f"through 2x2 (+{lat['added_wall_us']} us of golden Python time); "
                  f"{lat['leaf_spine']['frames_between_switches_per_use']:g} frames between "
                  f"switches per use, +{lat['added_link_hops']} link hops")
    rtl = rtl_figures(console=console)
    lat["latency_cycles"] = rtl["latency_cycles"]
    report["uplink_beats_per_cycle"] = rtl["uplink_beats_per_cycle"]
    report["rtl"] = rtl
    c = rtl["latency_cycles"]
    console.print(f"RTL: leaf up {c['leaf_up']} + spine {c['spine']} + leaf down "
                  f"{c['leaf_down']} cycles = {c['two_levels']}, one switch "
                  f"{c['single_switch']}: the second level adds {c['added']} cycles")
    for case, uplinks in rtl["uplink_beats_per_cycle"].items():
        console.print(f"RTL {case}: beats per cycle (out, in) " + ", ".join(
            f"{name} {v['out']:.3f}, {v['in']:.3f}" for name, v in uplinks.items()))
    return report
