"""`netagg train --cluster`: the same DDP training through gloo, netagg and netagg with priority
drop, on an emulated rack whose links are the bottleneck.

    netagg train --cluster [--hosts 4 --rate 100mbit --switch fast --epochs 3]
                           [--channels 64 --hidden 2048] [--plot FILE] [--json]
    netagg train --cluster --topology 2x2 [--hosts-per-leaf 2 --oversubscription 2 --spray]

makes a cluster (`sim.cluster`: `hosts` hosts as network namespaces, each on a link shaped to
`rate` both ways, a top-of-rack bridge, netagg's switch on the rack's own port) and runs
`apps.torch_train` in it three times from the same seed (`apps.torch_runs.RUNS`: gloo,
netagg, netagg_drop), one process per host, each under its own torchrun agent started in the
host's namespace (`torch_runs.torchrun`, static rendezvous at host 0's address, gloo on the
host's NIC, netagg's workers at the rack's switch). torchrun's rendezvous, gloo's TCP and
netagg's RoCEv2 all cross the same shaped links. With `--topology` the hosts sit on a leaf and
spine fabric instead (`sim.cluster_fabric`), the switch reached through the spines; with
`--spray` netagg's packets are sprayed over them, its workers on two source ports. With
`--cross-traffic` the fabric's ports honour DSCP (`sim.cluster_classes`) and another job's
long TCP flows and incast (`sim.cross_traffic`) run through every run; the drop run then
leaves the switch's thresholds alone (the network drops or holds the low classes, and the
workers give up what does not get through, `host.messages`), and each run reports the
other job's goodput. The drop run's switch thresholds and the switch's counters are read and written
from a thread that joined host 0's namespace, which reaches the switch's address.

The model is `torch_train.DigitsCNN` widened (64 channels, a hidden layer of 2048: 1,145,610
parameters, 4.6 MB of float32 gradients a step, against 22,602 at the default width): its
gradients take 0.37 s a step at 100 Mbit/s, its compute tens of milliseconds, so the
gradient exchange sets a step's time, as in the case netagg is for.

Per run it reports the final test accuracy, the time per step (the slowest rank's training
loop over its steps; the median and 99th percentile of the steps, each from the slowest
rank's end of the step before to its end of this one), the compute of a step (a forward and
backward pass without the allreduce), the CPU seconds a step of a host's process (its
training loop's, every thread's) and of the switch (the whole run's), and what each host's
NIC sent and received per step: the kernel's interface counters over the whole run (the
rendezvous, DDP's first broadcast and the final gather included) over its steps, and the
packets the links' queues dropped.
`summary` prints them as a table with each run's accuracy gap to gloo's and its time per step
against gloo's; `plot` draws the loss against the seconds of training. Needs root (the
cluster) and `pip install -e .[torch]`.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import platform
import tempfile
import threading
from pathlib import Path

import numpy as np
import psutil

from netagg.apps import torch_runs
from netagg.contract import regmap as R
from netagg.sim import netns
from netagg.sim.cluster import Cluster
from netagg.sim.cluster_fabric import FabricCluster, Topology
from netagg.sim.cluster_links import rate_text
from netagg.sim.cross_traffic import CrossTraffic

CHANNELS, HIDDEN = 64, 2048     # the widened DigitsCNN: the gradients, not compute, set a step
EPOCHS = 3


def in_namespace(namespace: str, call):
    """`call()` in a thread that has joined network namespace `namespace` (so the sockets it
    opens are that namespace's); its value, or its exception raised here."""
    outcome = {}

    def run():
        try:
            netns.enter(namespace)
            outcome["value"] = call()
        except BaseException as e:      # noqa: BLE001  (raised again in the caller)
            outcome["error"] = e

    thread = threading.Thread(target=run, name=f"in {namespace}")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _step_seconds(seconds_at_step: list[float]) -> dict:
    steps = np.diff(seconds_at_step, prepend=0.0)
    return {"mean": float(steps.mean()), "p50": float(np.percentile(steps, 50)),
            "p99": float(np.percentile(steps, 99))}


def train_cluster(hosts: int = 4, rate: str = "100mbit", switch: str = "fast",
                  epochs: int = EPOCHS, seed: int = 0, loss_budget: float = 0.05,
                  channels: int = CHANNELS, hidden: int = HIDDEN, runs=torch_runs.RUNS,
                  queue=None, name: str = "nagtrain", timeout: float = 600.0,
                  quiet: bool = False, fabric: dict | None = None,
                  cross_traffic: bool = False) -> dict:
    """Train every run of `runs` on a cluster of `hosts` hosts on links of `rate`, netagg's
    `switch` on the rack, or on a leaf and spine fabric: `fabric` holds its `topology`
    (``2x2``), `hosts_per_leaf`, `oversubscription` and `spray` (`hosts` is then theirs);
    with `cross_traffic` (a fabric only) its ports honour DSCP and another job's traffic
    runs through every run; the report (`summary`, `plot`)."""
    from rich.console import Console

    from netagg.apps.torch_train import digits

    console = Console(stderr=True, quiet=quiet)
    report = {"command": "train", "cluster": True, "hosts": hosts, "workers": hosts,
              "nodes": hosts, "switch": switch, "epochs": epochs, "seed": seed,
              "loss_budget": loss_budget, "channels": channels, "hidden": hidden,
              "date": datetime.date.today().isoformat(),
              "machine": f"{os.cpu_count()} cores, {platform.machine()}, Linux "
                         f"{platform.release()}",
              "runs": {}}
    model = ["--channels", str(channels), "--hidden", str(hidden)]
    if fabric is not None:
        shape = Topology.parse(fabric["topology"], fabric["hosts_per_leaf"])
        made = FabricCluster(shape, rate, queue, name, fabric["oversubscription"],
                             fabric["spray"], classes=cross_traffic)
        report["cross_traffic"] = cross_traffic
    elif cross_traffic:
        raise ValueError("cross traffic runs on a leaf and spine fabric (--topology)")
        hosts = report["hosts"] = report["workers"] = report["nodes"] = len(made.hosts)
        report["fabric"] = fabric
    else:
        made = Cluster(hosts, rate, queue, name)
    with tempfile.TemporaryDirectory(prefix="netagg-train-") as tmp_name, made as cluster:
        tmp = Path(tmp_name)
        report["rate"] = rate_text(cluster.shape.rate)
        report["rate_bits"] = cluster.shape.rate
        report["queue_bytes"] = cluster.shape.queue
        np.savez(tmp / "digits.npz", **digits(seed))
        with console.status(f"starting the {switch} switch on the rack"):
            url = cluster.serve(switch, max_workers=max(8, hosts))
        place = {"master": cluster.hosts[0].ip, "ifname": "eth0", "start": cluster.run,
                 "at_switch": functools.partial(in_namespace, cluster.hosts[0].namespace),
                 "paths": 2 if fabric and fabric["spray"] else 1}
        switch_process = psutil.Process(cluster.switch.pid)
        for run in runs:
            before, switch_cpu = cluster.counters(), _cpu_seconds(switch_process)
            other = CrossTraffic.across(cluster, fabric["hosts_per_leaf"]) \
                if cross_traffic else contextlib.nullcontext()
            with other:
                result = torch_runs.train_run(
                    run, url=url, tmp=tmp, nodes=hosts, per_node=1, epochs=epochs, seed=seed,
                    loss_budget=loss_budget, timeout=timeout, console=console, model=model,
                    drop_classes=() if cross_traffic else range(R.PRIORITY_CLASSES),
                    **place)
                if cross_traffic:
                    result["cross_goodput_bps"] = other.stop()["goodput_bps"]
            moved = [a - b for a, b in zip(cluster.counters(), before)]
            steps = result["steps"]
            result["switch_cpu_per_step"] = (_cpu_seconds(switch_process) - switch_cpu) / steps
            result["cpu_per_step"] = float(np.mean([r["cpu_seconds"] for r in result["ranks"]]
                                                   )) / steps
            result["step_seconds"] = _step_seconds(result["seconds_at_step"])
            result["host_bytes_per_step"] = {"sent": [m.tx_bytes / steps for m in moved],
                                             "received": [m.rx_bytes / steps for m in moved]}
            result["queue_drops"] = sum(m.drops for m in moved)
            report["runs"][run.name] = result
    first = next(iter(report["runs"].values()), None)
    if first:
        report["parameters"] = first["parameters"]
        report["gradient_bytes"] = 4 * first["parameters"]
        report["link_seconds_per_step"] = 8 * report["gradient_bytes"] / report["rate_bits"]
    gaps = torch_runs.accuracy_gaps(report["runs"])
    if gaps:
        report["accuracy_gap_points"] = gaps
        gloo = report["runs"]["gloo"]["time_per_step"]
        report["time_per_step_over_gloo"] = {n: r["time_per_step"] / gloo
                                             for n, r in report["runs"].items() if n != "gloo"}
    return report


def summary(report: dict) -> str:
    runs = report["runs"]
    fabric = report.get("fabric")
    where = "" if not fabric else (
        f" on a {fabric['topology']} leaf and spine fabric ({fabric['hosts_per_leaf']} a leaf, "
        f"uplinks {fabric['oversubscription']:g}:1, "
        + ("sprayed" if fabric["spray"] else "ECMP") + ")")
    lines = [f"DDP on an emulated cluster: {report['hosts']} hosts{where}, one process each, "
             f"links {report['rate']} each way, {report['switch']} switch, {report['epochs']} "
             f"epochs ({report['date']}, {report['machine']})"]
    if runs:
        compute = max(r["compute_per_step"] for r in runs.values())
        lines.append(
            f"model: DigitsCNN {report['channels']}/{report['hidden']}, "
            f"{report['parameters']:,} parameters: {report['gradient_bytes'] / 1e6:.2f} MB of "
            f"gradients a step, {report['link_seconds_per_step'] * 1e3:.0f} ms at the link's "
            f"rate against {compute * 1e3:.0f} ms of compute: "
            + ("the gradient exchange dominates" if report["link_seconds_per_step"] > compute
               else "compute dominates"))
    lines.append(f"{'run':12} {'accuracy':>8} {'vs gloo':>8} {'ms/step':>8} {'p50':>7} "
                 f"{'p99':>7} {'vs gloo':>7} {'steps':>5} {'MB sent/host/step':>17} "
                 f"{'MB received':>11} {'queue drops':>11} {'CPU ms/step: host':>17} "
                 f"{'switch':>6}")
    gaps = report.get("accuracy_gap_points", {})
    ratios = report.get("time_per_step_over_gloo", {})
    for name, r in runs.items():
        s, b = r["step_seconds"], r["host_bytes_per_step"]
        gap = f"{gaps[name]:+.2f}" if name in gaps else ""
        ratio = f"{ratios[name]:.2f}x" if name in ratios else ""
        lines.append(f"{name:12} {r['test_accuracy']:>8.2%} {gap:>8} "
                     f"{r['time_per_step'] * 1e3:>8.0f} {s['p50'] * 1e3:>7.0f} "
                     f"{s['p99'] * 1e3:>7.0f} {ratio:>7} {r['steps']:>5} "
                     f"{np.mean(b['sent']) / 1e6:>17.2f} {np.mean(b['received']) / 1e6:>11.2f} "
                     f"{r['queue_drops']:>11} {r['cpu_per_step'] * 1e3:>17.0f} "
                     f"{r['switch_cpu_per_step'] * 1e3:>6.0f}")
    if report.get("cross_traffic"):
        lines.append("under another job's traffic (long TCP flows and an incast; DSCP honoured): "
                     + ", ".join(f"{n} {r['cross_goodput_bps'] / 1e6:.1f} Mb/s"
                                 for n, r in runs.items()) + " of it got through")
    drop = runs.get("netagg_drop")
    if drop and report.get("cross_traffic"):
        sent = sum(r.get("droppable_sent", 0) for r in drop["ranks"])
        given = sum(r.get("given_up", 0) for r in drop["ranks"])
        lines.append(f"netagg_drop: {given:,} of {sent:,} droppable contributions given up "
                     f"(zeros in their place)")
    elif drop:
        lines.append(f"netagg_drop: {drop['drop_fraction']:.2%} of the contributions dropped "
                     f"by priority")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """The training loss of every run against the seconds of training."""
    torch_runs.plot(report, path, against="seconds",
                    title=f"digits CNN ({report['parameters']:,} parameters), "
                          f"{report['hosts']} hosts on {report['rate']} links, "
                          f"{report['switch']} switch")
