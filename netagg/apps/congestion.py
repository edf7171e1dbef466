"""`netagg bench congestion`: the host under congestion, one section per experiment.

- `spraying`: goodput of a float32 allreduce with every worker spraying its packets over 1, 2
  and 4 paths (UDP source ports; in `netagg sim serve` each enters the switch port
  `switch_port_for(ip, port, ports)`), worker processes over UDP against the simulated switch
  (`SimServer` in this process), `repeat` runs per path count, interleaved. Per path count:
  median goodput and time, each run's goodput, retransmissions and packets, packets per path
  and contributions the switch took on each port (its rx counters, read through the control
  path, less the control requests) in the last run, and whether every result is bit for bit
  the first run's.

- `priority_drop`: allreduce completion time under congestion, priority drop off and on.
  The golden switch sits behind a `sim.bottleneck.Bottleneck`: one queue of `capacity` bytes
  drained at `rate` bytes/s, shared with cross traffic (`burst` bytes every `period` s), where
  a frame that does not fit is lost at the tail and the sender's retransmission timeout
  recovers it. Worker processes over UDP allreduce a float32 tensor `steps` times, each with
  the same `loss_budget` (the smallest chunks sent droppable, in the lowest priority
  classes). Off: every threshold is NEVER_DROP. On: class 0 is dropped (to a null
  contribution) when a quarter of the queue is taken, class 1 at half. The same traffic meets
  the same congestion in both; per step, the completion time is the slowest worker's. Per
  mode: median and 99th percentile of the step times, tail drops, nulls, retransmissions,
  and the contributions lost per result.
"""

from __future__ import annotations

import collections
import queue as queue_mod
import time

import numpy as np

from netagg.apps.demo import run_workers
from netagg.contract import regmap as R


def _port_contributions(ctl) -> list[int]:
    ports = ctl.counters(jobs=[])["ports"]
    return [ports[p]["rx"] - ports[p]["control"] for p in sorted(ports)]


def bench_spraying(server, paths_list=(1, 2, 4), workers: int = 4, values: int = 1 << 18,
                   spray: str = "round_robin", repeat: int = 3, console=None,
                   timeout: float = 60.0) -> dict:
    """Allreduce of `values` float32 per worker over `server`, `repeat` times per path count
    (the path counts interleaved, so that a machine's changing load falls on all alike)."""
    import statistics

    from netagg.host import SwitchControl

    ctl = SwitchControl(server.url)
    out = {"policy": spray, "workers": workers, "tensor_bytes": values * 4, "repeat": repeat,
           "paths": {}}
    runs = {paths: [] for paths in paths_list}
    reference = None
    try:
        for _ in range(repeat):
            for paths in paths_list:
                before = _port_contributions(ctl)
                r = run_workers(server.url, workers=workers, nodes=workers, values=values,
                                steps=1, seed=1, verify=True, timeout=timeout, paths=paths,
                                spray=spray)
                if r["errors"] or not r["verified"]:
                    raise SystemExit(f"the allreduce sprayed over {paths} paths failed: "
                                     f"{r['errors'] or 'results not verified'}")
                after = _port_contributions(ctl)
                reference = reference or r["digest"]
                r["switch_port_contributions"] = [a - b for a, b in zip(after, before)]
                r["same"] = r["digest"] == reference
                runs[paths].append(r)
                if console is not None:
                    console.print(
                        f"spraying over {paths} path{'s' if paths > 1 else ' '} ({spray}): "
                        f"{r['goodput_MBps']:8.3f} MB/s per worker ({r['seconds']:.3f} s), "
                        f"{r['retransmissions']} retransmissions, contributions per switch "
                        f"port {r['switch_port_contributions']}")
    finally:
        ctl.close()
    for paths, rs in runs.items():
        out["paths"][str(paths)] = {
            "goodput_MBps": statistics.median(r["goodput_MBps"] for r in rs),
            "seconds": statistics.median(r["seconds"] for r in rs),
            "goodput_MBps_runs": [r["goodput_MBps"] for r in rs],
            "retransmissions_runs": [r["retransmissions"] for r in rs],
            "packets_runs": [r["packets_sent"] for r in rs],
            "packets_per_path": rs[-1]["packets_sent_per_path"],
            "switch_port_contributions": rs[-1]["switch_port_contributions"],
            "same_result_as_first": all(r["same"] for r in rs),
        }
    return out


def bench_congestion(backend: str = "golden", paths_list=(1, 2, 4), workers: int = 4,
                     size: int = 1 << 20, spray: str = "round_robin", repeat: int = 3,
                     quiet: bool = False, experiments=("priority_drop", "spraying"),
                     priority: dict | None = None) -> dict:
    from rich.console import Console

    from netagg.sim.serve import SimServer, make_backend

    console = Console(stderr=True, quiet=quiet)
    report = {"bench": "congestion", "backend": backend}
    if "priority_drop" in experiments:
        report["priority_drop"] = bench_priority_drop(workers, console=console,
                                                      **(priority or {}))
        if not quiet:
            pd = report["priority_drop"]
            for mode, row in pd["modes"].items():
                print(f"priority drop {mode:3}: allreduce completion p50 "
                      f"{row['p50_s'] * 1e3:.1f} ms, p99 {row['p99_s'] * 1e3:.1f} ms "
                      f"({pd['steps']} steps of {pd['tensor_bytes'] // 1024} KB); "
                      f"{row['tail_drops']} tail drops, {row['nulled']} nulled, "
                      f"{row['retransmissions']} retransmissions")
            print(f"priority drop: p99 off / on = {pd['p99_ratio_off_to_on']:.2f}")
    if "spraying" not in experiments:
        return report
    with console.status(f"starting the {backend} switch"):
        switch = make_backend(backend)
    with SimServer(switch).start() as server:
        report["switch_ports"] = server.ports
        report["spraying"] = bench_spraying(server, paths_list, workers, max(1, size // 4),
                                            spray, repeat, console)
    if not quiet:
        for paths, row in report["spraying"]["paths"].items():
            print(f"{paths} path{'s' if paths != '1' else ' '}: {row['goodput_MBps']:8.3f} MB/s "
                  f"per worker (median of {repeat}), retransmissions "
                  f"{row['retransmissions_runs']}, contributions per switch port (last run) "
                  f"{row['switch_port_contributions']}")
    return report


# --- priority drop -------------------------------------------------------------------------

def priority_worker(rank: int, world: int, url: str, session: str, values: int, steps: int,
                    loss_budget: float, credits: int, results, start, timeout: float):
    """One worker process of the priority-drop experiment: `steps` allreduces (mean) of a
    tensor whose values differ in magnitude from chunk to chunk, as gradients do."""
    from netagg.host import Worker
    try:
        rng = np.random.default_rng([7, rank])
        scale = np.repeat(10.0 ** rng.uniform(-4, 0, -(-values // 255)), 255)[:values]
        data = (rng.standard_normal(values) * scale).astype(np.float32)
        times = []
        with Worker(rank, world, url, session=session, timeout=timeout,
                    credits=credits) as w:
            start.wait(timeout)
            for _ in range(steps):
                t0 = time.perf_counter()
                w.allreduce(data, op="mean", loss_budget=loss_budget, priority=4)
                times.append(time.perf_counter() - t0)
            counters = w.counters()
        results.put({"rank": rank, "times": times, "counters": counters})
    except BaseException as e:
        start.abort()
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def _percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _priority_run(workers, values, steps, loss_budget, credits, chosen, link_params,
                  timeout) -> tuple[dict, dict]:
    """One run of `steps` allreduces through a fresh bottleneck with thresholds `chosen`:
    (the workers' reports, the bottleneck's and the switch's counters)."""
    import multiprocessing as mp
    import uuid

    from netagg.host import SwitchControl
    from netagg.sim.bottleneck import Bottleneck
    from netagg.sim.golden import GoldenSwitch
    from netagg.sim.serve import SimServer

    link = Bottleneck(GoldenSwitch(), **link_params)
    with SimServer(link).start() as server:
        ctl = SwitchControl(server.url)
        ctl.write([(R.drop_threshold(c), chosen.get(c, R.NEVER_DROP))
                   for c in range(R.PRIORITY_CLASSES)])
        ctx = mp.get_context("spawn")
        results, start = ctx.Queue(), ctx.Barrier(workers)
        session = uuid.uuid4().hex
        procs = [ctx.Process(target=priority_worker, daemon=True, args=(
            r, workers, server.url, session, values, steps, loss_budget, credits, results,
            start, timeout)) for r in range(workers)]
        for proc in procs:
            proc.start()
        reports = []
        deadline = time.monotonic() + timeout * steps
        while len(reports) < workers and time.monotonic() < deadline:
            try:
                reports.append(results.get(timeout=0.5))
            except queue_mod.Empty:
                if all(proc.exitcode is not None for proc in procs) and results.empty():
                    break
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        job = ctl.counters(ports=[], jobs=[0])["jobs"][0]
        ctl.close()
    errors = [r["error"] for r in reports if "error" in r]
    if errors or len(reports) < workers:
        raise SystemExit(f"the workers failed: {errors or 'no report from some workers'}")
    return reports, collections.Counter({**link.stats, "completed": job["completed"],
                                         "contributions": job["contributions"]})


def bench_priority_drop(workers: int = 4, values: int = 16 * 255, steps: int = 40,
                        repeat: int = 2, loss_budget: float = 0.1, rate: float = 1.0e6,
                        capacity: int = 24 * 1024, burst: int = 12 * 1024,
                        period: float = 0.05, credits: int = 4, console=None,
                        timeout: float = 60.0) -> dict:
    """Completion times with priority drop off and on through the same bottleneck, `repeat`
    runs of `steps` allreduces per mode, the modes alternating."""
    link_params = {"rate": rate, "capacity": capacity, "burst": burst, "period": period}
    out = {"workers": workers, "tensor_bytes": values * 4, "steps": steps, "repeat": repeat,
           "loss_budget": loss_budget, "credits": credits,
           "bottleneck": {"rate_Bps": rate, "capacity_bytes": capacity,
                          "cross_burst_bytes": burst, "cross_period_s": period},
           "modes": {}}
    thresholds = {"off": {}, "on": {0: capacity // 8, 1: capacity // 4, 2: capacity // 2}}
    times = {mode: [] for mode in thresholds}
    totals = {mode: collections.Counter() for mode in thresholds}
    for run in range(repeat):
        for mode, chosen in thresholds.items():
            reports, stats = _priority_run(workers, values, steps, loss_budget, credits,
                                           chosen, link_params, timeout)
            step_times = np.max([r["times"] for r in reports], axis=0)
            times[mode] += step_times.tolist()
            total = totals[mode]
            total.update(stats)
            for key in ("retransmissions", "packets_sent", "droppable_sent", "redone",
                        "lost_contributions", "filled_chunks", "rescaled_chunks"):
                total[key] += sum(r["counters"].get(key, 0) for r in reports)
            if console is not None:
                console.print(
                    f"run {run + 1}/{repeat}, priority drop {mode:3}: completion p50 "
                    f"{np.median(step_times) * 1e3:7.1f} ms, max {step_times.max() * 1e3:7.1f}"
                    f" ms; {stats['tail_drops']} tail drops, {stats['nulled']} nulled")
    for mode, chosen in thresholds.items():
        t, total = times[mode], totals[mode]
        out["modes"][mode] = {
            "thresholds": {str(c): v for c, v in chosen.items()},
            "p50_s": _percentile(t, 50), "p99_s": _percentile(t, 99),
            "max_s": max(t), "mean_s": float(np.mean(t)), "steps_measured": len(t),
            "tail_drops": total["tail_drops"], "nulled": total["nulled"],
            "frames_in": total["frames_in"],
            "cross_bytes_dropped": total["cross_bytes_dropped"],
            "retransmissions": total["retransmissions"], "redone": total["redone"],
            "filled_chunks": total["filled_chunks"] // workers,
            "rescaled_chunks": total["rescaled_chunks"] // workers,
            "packets_sent": total["packets_sent"], "droppable_sent": total["droppable_sent"],
            # every worker counts the same losses (they see the same results)
            "lost_contributions": total["lost_contributions"] // workers,
            "completed": total["completed"], "contributions": total["contributions"],
        }
    off, on = out["modes"]["off"], out["modes"]["on"]
    out["p99_ratio_off_to_on"] = off["p99_s"] / on["p99_s"]
    out["p50_ratio_off_to_on"] = off["p50_s"] / on["p50_s"]
    return out
