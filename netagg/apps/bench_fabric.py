"""`netagg bench fabric`: netagg on an emulated leaf and spine fabric, its packets sprayed over
the spines against flows hashed onto one by ECMP, the ring beside both, a spine cut, and
priority drop under another job's traffic (`apps.bench_fabric_priority`).

One fabric (`sim.cluster_fabric`: `topology` leaves and spines, `hosts_per_leaf` hosts on
each leaf, host links of `rate`, uplinks oversubscribed `oversubscription` to one, the fast
switch reached through the spines) serves every run. `repeat` rounds each run, on every host
(`apps.cluster_allreduce`), one checked allreduce of `size` bytes of float32 and one timed:

- **ecmp**: netagg, each worker's packets one UDP flow, hashed onto a spine by the leaves and
  the switch (each run's workers have new source ports: a new draw of the hash);
- **spray**: netagg, the fabric spraying its contributions and results over the spines by
  slot (`FabricCluster.spray`), the workers told that their packets may come back out of
  order (two source ports: no loss is inferred from the order of answers);
- **ring**: torch's gloo over TCP, its connections hashed by ECMP.

Per run: the time (the slowest rank's), whether every result is right, the bytes each
leaf sent up each uplink and received down it, the imbalance (over the leaves, the most any
uplink of a leaf carried over its uplinks' mean, less one; up and down), netagg's
retransmissions and the packets the uplinks' queues dropped. Per mode: the median and the
worst time and imbalance; and spraying's median time over ECMP's. `targets` says whether
spraying kept every uplink within 5 % of its leaf's mean and was no slower than ECMP's
median, and whether the cut run was exact.

The cut: spraying on, `cut_rounds` allreduces on every host, and once the hosts have sent
about a round and a half, the last spine's links go down at every leaf and the switch
(`FabricCluster.cut_spine`); every result is checked, and the time lost is the cut round's
time less the mean of the rounds before and after it (which run on every spine and on one
fewer).

Priority drop: on a second fabric whose ports honour DSCP, `steps` allreduces of `step_size`
bytes a mode (plain, priority, priority_drop with `loss_budget`), in `rounds` rounds, under
the same cross traffic (`apps.bench_fabric_priority`). `targets` says whether the p99 step
with priority drop is at most 0.7x the plain one's.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import threading
import time

from netagg.apps.bench_cluster import run_hosts
from netagg.apps.bench_fabric_priority import bench_priority
from netagg.apps.bench_fabric_priority import summary as priority_summary
from netagg.sim.cluster_fabric import FabricCluster, Topology
from netagg.sim.cluster_links import rate_text

MODES = ("ecmp", "spray", "ring")
_OPTIONS = {"ecmp": (), "spray": ("--paths", "2"), "ring": ()}


def bench_fabric(topology: str = "2x2", hosts_per_leaf: int = 2, rate: str = "40mbit",
                 oversubscription: float = 2.0, size: int = 8 << 20, repeat: int = 5,
                 cut_rounds: int = 4, name: str = "naggfab", quiet: bool = False,
                 timeout: float = 120.0, steps: int = 40, rounds: int = 2,
                 step_size: int = 1 << 20, loss_budget: float = 0.1) -> dict:
    from rich.progress import Progress
    shape = Topology.parse(topology, hosts_per_leaf)
    report = {"date": datetime.date.today().isoformat(),
              "machine": f"{os.cpu_count()} cores, {platform.machine()}, Linux "
                         f"{platform.release()}",
              "topology": topology, "hosts_per_leaf": hosts_per_leaf, "rate": rate,
              "oversubscription": oversubscription, "bytes": size, "repeat": repeat,
              "switch": "fast", "runs": {m: [] for m in MODES}}
    with FabricCluster(shape, rate, name=name, oversubscription=oversubscription) as fabric, \
            Progress(disable=quiet, transient=True) as progress:
        report["uplink_rate"] = rate_text(fabric.uplink_shape.rate)
        url = fabric.serve("fast", max_workers=max(8, len(fabric.hosts)))
        task = progress.add_task("fabric", total=repeat * len(MODES) + 1)
        for i in range(repeat):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:       # alternating
                progress.update(task, description=f"round {i + 1}: {mode}")
                report["runs"][mode].append(_run(fabric, mode, url, size, timeout, i))
                progress.advance(task)
        progress.update(task, description="a spine cut")
        report["cut"] = _cut(fabric, url, size, cut_rounds, timeout)
        progress.advance(task)
    with Progress(disable=quiet, transient=True) as progress:
        report["priority_drop"] = bench_priority(
            shape, rate, oversubscription, step_size, max(1, steps // rounds), rounds,
            loss_budget, name, timeout, progress)
    report["modes"] = {m: _summary(rs) for m, rs in report["runs"].items()}
    modes = report["modes"]
    report["spray_over_ecmp"] = round(modes["spray"]["seconds"] / modes["ecmp"]["seconds"], 3)
    priority = report["priority_drop"]
    report["verified"] = all(r["verified"] for rs in report["runs"].values() for r in rs) \
        and report["cut"]["verified"] and all(m["verified"] for m in priority["modes"].values())
    sprayed = modes["spray"]
    report["targets"] = {       # what spraying and a cut must give
        "uplinks_within_5_percent": max(sprayed["worst_imbalance_up"],
                                             sprayed["worst_imbalance_down"]) <= 0.05,
        "spraying_no_slower_than_ecmp_median": sprayed["seconds"] <= modes["ecmp"]["seconds"],
        "spine_cut_exact": report["cut"]["cut"] and report["cut"]["verified"],
        "p99_with_priority_drop_at_most_0.7x_plain": priority["p99_drop_over_plain"] <= 0.7}
    if not quiet:
        print(summary(report))
    return report


def _run(fabric: FabricCluster, mode: str, url: str, size: int, timeout: float,
         i: int) -> dict:
    fabric.spray(mode == "spray")
    before = fabric.uplinks()
    library = "gloo" if mode == "ring" else "netagg"
    reports = run_hosts(fabric, library, size, 1, url if library == "netagg" else None,
                         timeout, _OPTIONS[mode], session=f"fab-{mode}-{i}")
    moved = [[a - b for a, b in zip(after, first)]
             for after, first in zip(fabric.uplinks(), before)]
    up = [[m.tx_bytes for m in leaf] for leaf in moved]
    down = [[m.rx_bytes for m in leaf] for leaf in moved]
    return {"seconds": max(r["sizes"][0]["seconds"][0] for r in reports),
            "verified": all(r["sizes"][0]["verified"] for r in reports),
            "retransmissions": sum(r["sizes"][0]["retransmissions"] for r in reports),
            "uplink_bytes_up": up, "uplink_bytes_down": down,
            "imbalance_up": _imbalance(up), "imbalance_down": _imbalance(down),
            "queue_drops": sum(m.drops for leaf in moved for m in leaf)}


def _imbalance(per_leaf: list[list[int]]) -> float:
    """The most any uplink of a leaf carried over its leaf's uplinks' mean, less one."""
    worst = 0.0
    for links in per_leaf:
        mean = statistics.mean(links)
        if mean > 0:
            worst = max(worst, max(links) / mean - 1)
    return round(worst, 4)


def _summary(runs: list[dict]) -> dict:
    times = [r["seconds"] for r in runs]
    return {"seconds": statistics.median(times), "worst_seconds": max(times),
            "imbalance_up": statistics.median(r["imbalance_up"] for r in runs),
            "worst_imbalance_up": max(r["imbalance_up"] for r in runs),
            "imbalance_down": statistics.median(r["imbalance_down"] for r in runs),
            "worst_imbalance_down": max(r["imbalance_down"] for r in runs),
            "verified": all(r["verified"] for r in runs),
            "retransmissions": statistics.median(r["retransmissions"] for r in runs),
            "queue_drops": statistics.median(r["queue_drops"] for r in runs)}


def _cut(fabric: FabricCluster, url: str, size: int, rounds: int, timeout: float) -> dict:
    """`rounds` sprayed allreduces; the last spine cut after about a round and a half."""
    spine = fabric.topology.spines - 1
    fabric.spray(True)
    start = sum(c.tx_bytes for c in fabric.counters())
    at = start + int(2.5 * size * len(fabric.hosts))     # the checked round and 1.5 timed
    cut = {}

    def cut_when_sent():
        while sum(c.tx_bytes for c in fabric.counters()) < at:
            if cut.get("stop"):
                return
            time.sleep(0.02)
        cut["at"] = time.time()
        fabric.cut_spine(spine)

    watcher = threading.Thread(target=cut_when_sent, daemon=True)
    watcher.start()
    try:
        reports = run_hosts(fabric, "netagg", size, rounds, url, timeout,
                             _OPTIONS["spray"], session="fab-cut")
    finally:
        cut["stop"] = True
        watcher.join()
        if "at" in cut:
            fabric.cut_spine(spine, up=True)
    seconds = [max(r["sizes"][0]["seconds"][i] for r in reports) for i in range(rounds)]
    started = [min(r["sizes"][0]["started"][i] for r in reports) for i in range(rounds)]
    during = None               # the round the cut lands in
    if "at" in cut:
        during = max((i for i in range(rounds) if started[i] <= cut["at"]), default=None)
    lost = None
    if during is not None and 0 < during < rounds - 1:
        lost = round(seconds[during] - (seconds[during - 1] + seconds[during + 1]) / 2, 3)
    return {"spine": spine, "cut": "at" in cut, "round": during, "seconds": seconds,
            "seconds_lost": lost,
            "verified": all(r["sizes"][0]["verified"] for r in reports),
            "retransmissions": sum(r["sizes"][0]["retransmissions"] for r in reports)}


def summary(report: dict) -> str:
    m = report["modes"]
    lines = [f"allreduce of {report['bytes'] >> 20} MiB float32 on an emulated "
             f"{report['topology']} leaf and spine fabric, {report['hosts_per_leaf']} hosts a "
             f"leaf on {report['rate']} links, uplinks {report['uplink_rate']} "
             f"({report['oversubscription']:g}:1), fast switch; {report['repeat']} runs each "
             f"({report['date']}, {report['machine']})",
             "mode    median    worst   uplink imbalance up (worst), down (worst)  "
             "retransmissions  queue drops"]
    for mode in MODES:
        s = m[mode]
        lines.append(f"{mode:<6} {s['seconds']:>7.3f}s {s['worst_seconds']:>7.3f}s   "
                     f"{s['imbalance_up']:>6.1%} ({s['worst_imbalance_up']:.1%}), "
                     f"{s['imbalance_down']:.1%} ({s['worst_imbalance_down']:.1%})"
                     f"{s['retransmissions']:>17g} {s['queue_drops']:>12g}"
                     + ("" if s["verified"] else "  RESULT WRONG"))
    lines.append(f"spraying's median over ECMP's: {report['spray_over_ecmp']:.2f}x; the ring's "
                 f"over spraying's: {m['ring']['seconds'] / m['spray']['seconds']:.2f}x")
    c = report["cut"]
    lost = f", {c['seconds_lost']:.3f} s lost" if c["seconds_lost"] is not None else ""
    lines.append(f"spine {c['spine']} cut in round {c['round']} of {len(c['seconds'])}: rounds "
                 + ", ".join(f"{t:.3f}" for t in c["seconds"]) + f" s{lost}; "
                 + ("every result exact" if c["verified"] else "RESULT WRONG"))
    lines += priority_summary(report["priority_drop"])
    lines.append("targets: " + ", ".join(f"{name.replace('_', ' ')} "
                                         + ("met" if met else "NOT MET")
                                         for name, met in report["targets"].items()))
    return "\n".join(lines)

