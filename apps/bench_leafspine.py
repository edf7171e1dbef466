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
  In cycles once the RTL has a leaf (`latency_cycles` is null until then).
"""

from __future__ import annotations

import time
import uuid

import numpy as np
from netagg.apps.demo import demo_data


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
    out["latency_cycles"] = None
    out["latency_cycles_note"] = ("in cycles once the RTL has a leaf (the golden model has no "
                                  "time: its figures are frames and Python wall time)")
    return out


def bench_leafspine(quiet: bool = False, workers: int = 8, values: int = 200_000,
                    make=None) -> dict:
    from rich.console import Console
    console = Console(stderr=True, quiet=quiet)
    report = {"bench": "leafspine", "backend": "golden", "workers": workers,
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
    return report
