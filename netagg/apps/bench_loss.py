"""`netagg bench loss`: allreduce under heavy loss, the workers' early loss recovery against
the timeouts alone, in one run.

A simulated switch (`netagg sim serve`'s server, in a thread of this process, on a free
loopback address) and `workers` worker processes over UDP, each through a lossy transport
(`host.lossy.LossyTransport`) that drops each packet, each way, with the loss rate, sends 2 %
twice and holds 10 % back by up to 3 ms (so packets behind overtake them). For each loss
rate the same allreduce (`values` float32 values a worker, in `tensors` tensors, submitted
together) runs `repeat` times with each recovery (`host.retransmit.Recovery`: EARLY, the
default, and TIMERS), the two alternating, after an allreduce without loss that warms the
switch up; every result is checked against the exact sum
within the fixed-point bound, and the medians are reported with the retransmissions (early
ones and probes among them) per run.

Figures: seconds per allreduce for each loss rate and recovery, timers' over early's, and
each recovery's time at the highest loss rate over its time at 5 % (or the rate nearest).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics

from netagg.apps.demo import run_workers
from netagg.host.retransmit import Recovery

LOSSES = (0.01, 0.05, 0.20)
DUPLICATE = 0.02            # share of packets sent twice, each way
REORDER = 0.10              # share of packets held back, each way, by up to MAX_DELAY
MAX_DELAY = 0.003           # seconds


def bench_loss(losses=LOSSES, workers: int = 4, values: int = 1_000_000, tensors: int = 6,
               repeat: int = 1, backend: str = "fast", quiet: bool = False,
               timeout: float = 900.0) -> dict:
    from rich.progress import Progress

    from netagg.sim.serve import SimServer, make_backend
    report = {"date": datetime.date.today().isoformat(),
              "machine": f"{os.cpu_count()} cores, {platform.machine()}, Linux "
                         f"{platform.release()}",
              "workers": workers, "values": values, "tensors": tensors, "repeat": repeat,
              "switch": backend, "duplicate": DUPLICATE, "reorder": REORDER,
              "max_delay": MAX_DELAY, "runs": []}
    recoveries = list(Recovery)
    with SimServer(make_backend(backend, max_workers=max(8, workers))).start() as server, \
            Progress(disable=quiet, transient=True) as progress:
        task = progress.add_task("loss", total=len(losses) * repeat * len(recoveries))
        progress.update(task, description="warming up")     # (the switch's first uses)
        run_workers(server.url, workers=workers, nodes=workers, values=values // 10,
                    steps=tensors, timeout=timeout)
        for loss in losses:
            row = {"loss": loss}
            runs = {r: [] for r in recoveries}
            for i in range(repeat):
                for recovery in recoveries[::1 if i % 2 == 0 else -1]:     # alternating
                    progress.update(task, description=f"{loss:.0%} loss, {recovery.value}")
                    faults = dict(drop=loss, duplicate=DUPLICATE, reorder=REORDER,
                                  max_delay=MAX_DELAY, seed=1000 * i + round(loss * 100))
                    runs[recovery].append(run_workers(
                        server.url, workers=workers, nodes=workers, values=values,
                        steps=tensors, faults=faults, timeout=timeout,
                        recovery=recovery.value))
                    progress.advance(task)
            for recovery, rs in runs.items():
                row[recovery.value] = _summary(rs)
            row["timers_over_early"] = round(row["timers"]["seconds"]
                                             / row["early"]["seconds"], 2)
            report["runs"].append(row)
    base = min(report["runs"], key=lambda r: abs(r["loss"] - 0.05))
    worst = max(report["runs"], key=lambda r: r["loss"])
    report["worst_over_5pct"] = {r.value: round(worst[r.value]["seconds"]
                                                / base[r.value]["seconds"], 2)
                                 for r in recoveries}
    if not quiet:
        print(summary(report))
    return report


def _summary(runs: list[dict]) -> dict:
    counters = [r["counters"] for r in runs]
    return {"seconds": statistics.median(r["seconds"] for r in runs),
            "seconds_each": [r["seconds"] for r in runs],
            "verified": all(r["verified"] for r in runs),
            "errors": [e for r in runs for e in r["errors"]],
            "packets_sent": statistics.median(r["packets_sent"] for r in runs),
            "retransmissions": statistics.median(c.get("retransmissions", 0) for c in counters),
            "early_retransmissions": statistics.median(c.get("early_retransmissions", 0)
                                                       for c in counters),
            "probes": statistics.median(c.get("probes", 0) for c in counters)}


def summary(report: dict) -> str:
    lines = [f"allreduce of {report['values']:,} float32 values in {report['tensors']} tensors, "
             f"{report['workers']} worker processes over UDP, each way {report['duplicate']:.0%} "
             f"duplicated and {report['reorder']:.0%} held back up to "
             f"{report['max_delay'] * 1e3:g} ms; median of {report['repeat']} "
             f"({report['date']}, {report['machine']})",
             " loss   early      timers   timers/early  retransmissions early (of them early, "
             "probes), timers"]
    for r in report["runs"]:
        e, t = r["early"], r["timers"]
        checked = e["verified"] and t["verified"]
        lines.append(f"{r['loss']:>5.0%} {e['seconds']:>7.3f}s {t['seconds']:>9.3f}s "
                     f"{r['timers_over_early']:>10.2f}x   {e['retransmissions']:>7g} "
                     f"({e['early_retransmissions']:g}, {e['probes']:g}), "
                     f"{t['retransmissions']:g}" + ("" if checked else "  RESULT WRONG"))
    w = report["worst_over_5pct"]
    lines.append(f"the highest loss over 5 %: early {w['early']:.2f}x, timers {w['timers']:.2f}x")
    return "\n".join(lines)
