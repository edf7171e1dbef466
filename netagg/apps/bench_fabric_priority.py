"""`netagg bench fabric`'s priority-drop experiment: allreduce steps under another job's
traffic on an emulated leaf and spine fabric whose ports honour DSCP, with and without
netagg's priority classes and loss budget.

The fabric (`sim.cluster_fabric`, `classes=True`): every port's queue is two classes
(`sim.cluster_classes`: priority classes 4 to 7 and the switch's own packets high, the rest
low, each with the port's queue depth). netagg's contributions are sprayed over the spines.
Another job (`sim.cross_traffic`): each host's long TCP flow to the host in its place on the
next leaf, and an incast into the last host, DSCP 0.

Each mode runs `steps` allreduces of `size` bytes of float32 on every host, each after a
barrier, while the other job runs (started afresh for each mode, a second before):

- **plain**: netagg in class 0, no loss budget: the job shares the low class with the other
  job's traffic, as a job that marks nothing does;
- **priority**: netagg in class 4, no loss budget: every packet of the job in the high class;
- **priority_drop**: netagg in class 4 with `loss_budget`: each worker's smallest chunks (by
  norm) go in classes 0 to 3, the low class; one whose answer does not come in time is given
  up, zeros in class 7 in its place (`host.messages`).

Per mode: each step's time (the slowest rank's), the p50 and p99, whether each result is right
(within the loss budget: `apps.cluster_allreduce`), its relative error, the contributions
given up (nulls) and retransmitted, the other job's goodput, and the packets each class's
queues dropped on the uplinks. `rounds` rounds of the modes, alternating their order.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from netagg.apps.bench_cluster import run_hosts
from netagg.sim.cluster_classes import class_counters
from netagg.sim.cluster_fabric import FabricCluster, Topology
from netagg.sim.cross_traffic import CrossTraffic

MODES = ("plain", "priority", "priority_drop")
WARM_UP = 1.0           # seconds the other job runs before a mode's steps


def options(mode: str, loss_budget: float) -> tuple[str, ...]:
    sprayed = ("--paths", "2")
    if mode == "plain":
        return (*sprayed, "--priority", "0")
    if mode == "priority":
        return (*sprayed, "--priority", "4")
    return (*sprayed, "--priority", "4", "--loss-budget", str(loss_budget))


def bench_priority(topology: Topology, rate: str, oversubscription: float, size: int,
                   steps: int, rounds: int, loss_budget: float, name: str, timeout: float,
                   progress=None) -> dict:
    runs = {m: [] for m in MODES}
    with FabricCluster(topology, rate, name=name, oversubscription=oversubscription,
                       spray=True, classes=True) as fabric:
        url = fabric.serve("fast", max_workers=max(8, len(fabric.hosts)))
        task = progress.add_task("priority drop", total=rounds * len(MODES)) \
            if progress else None
        for i in range(rounds):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                if progress:
                    progress.update(task, description=f"priority drop, round {i + 1}: {mode}")
                runs[mode].append(_run(fabric, mode, url, size, steps, loss_budget,
                                       timeout, i))
                if progress:
                    progress.advance(task)
    modes = {m: _summary(rs) for m, rs in runs.items()}
    return {"size": size, "steps": steps, "rounds": rounds, "loss_budget": loss_budget,
            "cross_traffic": "each host's long TCP flow to its place on the next leaf, and an "
                             "incast of 256 KiB from every other host into the last every 0.5 s",
            "modes": modes, "runs": runs,
            "p99_drop_over_plain": round(modes["priority_drop"]["p99"] / modes["plain"]["p99"],
                                         3)}


def _run(fabric: FabricCluster, mode: str, url: str, size: int, steps: int,
         loss_budget: float, timeout: float, i: int) -> dict:
    before = _drops(fabric)
    with CrossTraffic.across(fabric, fabric.topology.hosts_per_leaf) as other:
        time.sleep(WARM_UP)
        reports = run_hosts(fabric, "netagg", size, steps, url, timeout,
                            options(mode, loss_budget), session=f"fabp-{mode}-{i}")
        goodput = other.stop()["goodput_bps"]
    after = _drops(fabric)
    sizes = [r["sizes"][0] for r in reports]
    return {"seconds": [max(s["seconds"][k] for s in sizes) for k in range(steps)],
            "verified": all(s["verified"] for s in sizes),
            "error": max(s["error"] for s in sizes),
            "given_up": sum(s.get("given_up", 0) for s in sizes),
            "retransmissions": sum(s["retransmissions"] for s in sizes),
            "cross_goodput_bps": goodput,
            "uplink_drops": {c: after[c] - before[c] for c in after}}


def _drops(fabric: FabricCluster) -> dict[str, int]:
    """Packets each class's queues dropped so far at both ends of every uplink."""
    from pyroute2 import NetNS
    total = {"high": 0, "low": 0}
    t = fabric.topology
    ends = [(fabric.leaf(leaf), f"s{s}") for leaf in range(t.leaves) for s in range(t.spines)]
    ends += [(fabric.spine(s), f"l{leaf}") for leaf in range(t.leaves) for s in range(t.spines)]
    for namespace, device in ends:
        with NetNS(namespace) as ns:
            for c, n in class_counters(ns, ns.link_lookup(ifname=device)[0]).items():
                total[c] += n.drops
    return total


def _summary(runs: list[dict]) -> dict:
    steps = [t for r in runs for t in r["seconds"]]
    return {"p50": round(float(np.percentile(steps, 50)), 4),
            "p99": round(float(np.percentile(steps, 99)), 4),
            "mean": round(statistics.mean(steps), 4),
            "verified": all(r["verified"] for r in runs),
            "error": max(r["error"] for r in runs),
            "given_up": sum(r["given_up"] for r in runs),
            "retransmissions": sum(r["retransmissions"] for r in runs),
            "cross_goodput_bps": round(statistics.mean(r["cross_goodput_bps"] for r in runs)),
            "uplink_drops_high": sum(r["uplink_drops"]["high"] for r in runs),
            "uplink_drops_low": sum(r["uplink_drops"]["low"] for r in runs)}


def summary(report: dict) -> list[str]:
    lines = [f"priority drop: {report['steps']} steps of {report['size'] >> 10} KiB float32 a "
             f"mode a round, {report['rounds']} rounds, under another job's traffic "
             f"({report['cross_traffic']}); loss budget {report['loss_budget']:g}",
             "mode           p50      p99   other job  uplink drops high/low  given up  "
             "retransmissions  error"]
    for mode, s in report["modes"].items():
        lines.append(f"{mode:<13} {s['p50']:>6.3f}s {s['p99']:>6.3f}s "
                     f"{s['cross_goodput_bps'] / 1e6:>6.1f} Mb/s {s['uplink_drops_high']:>10}"
                     f"/{s['uplink_drops_low']:<10} {s['given_up']:>8} "
                     f"{s['retransmissions']:>16} {s['error']:>7.4f}"
                     + ("" if s["verified"] else "  RESULT WRONG"))
    lines.append(f"p99 with priority drop over plain: {report['p99_drop_over_plain']:.2f}x")
    return lines
