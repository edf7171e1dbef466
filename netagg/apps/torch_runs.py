"""`netagg train`: the same DDP training through gloo, through netagg, and through netagg
with priority drop, side by side.

    netagg train [--workers 4 --nodes 2 --epochs 15 --seed 0 --loss-budget 0.05]
                 [--channels 16 --hidden 128] [--backend golden|rtl] [--plot FILE] [--json]

starts the simulated switch (`netagg sim serve`, the golden model by default) on a free
loopback address, writes scikit-learn's digits once (`apps.torch_train.digits`), and runs
`apps.torch_train` under torchrun, `workers` processes in `nodes` nodes (one torchrun agent
per node, static rendezvous on 127.0.0.1, node i sending from the i-th address that reaches
its own switch port, as `netagg demo` does), three times from the same seed:

- `gloo`: torch's gloo backend, DDP's own allreduce;
- `netagg`: the "netagg" backend, hierarchical inside a node, DDP's gradients through
  `host.torch_hook` (DLCP classes), no loss budget;
- `netagg_drop`: the same with `loss_budget` and every drop threshold of the switch at 0, so
  the switch drops every contribution a worker marks droppable (the floor(loss_budget x
  chunks) smallest chunks of each gradient): what a congested switch may do at most.

Per run it prints the final test accuracy, the time per training step (the slowest rank's
training-loop seconds over its steps), the bytes each worker sent (to the switch, and over
TCP: gloo's allreduce, and in the netagg runs what gloo still carries), and for the drop run
the share of the contributions the switch dropped; then the accuracy gaps to gloo in points.
`--json` prints one object (with each run's mean loss per step), `--plot FILE` draws the
loss curves of the runs on one figure (matplotlib). gloo's connections stay on the loopback
interface (GLOO_SOCKET_IFNAME=lo); every process has one OpenMP thread; each torchrun must
finish within `timeout` seconds, or every process of it is killed and the run is an error
naming it. Needs `pip install -e .[torch]` (torch, scikit-learn, matplotlib).

`train_run` (one run) and `torchrun` take where the agents start, the rendezvous address,
gloo's interface and how the switch is reached as parameters: `apps.train_cluster` runs the
same on an emulated cluster, an agent in each host.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from netagg.contract import regmap as R


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    backend: str            # torch's backend: "gloo" or "netagg"
    drop: bool = False      # the switch drops every droppable contribution


RUNS = (Run("gloo", "gloo"), Run("netagg", "netagg"), Run("netagg_drop", "netagg", drop=True))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_here(node: int, argv: list[str], **popen) -> subprocess.Popen:
    return subprocess.Popen(argv, **popen)


def torchrun(target: list[str], *, url: str, nodes: int, per_node: int, logs: Path,
             what: str, timeout: float, binds=(), master: str = "127.0.0.1",
             ifname: str = "lo", start=_start_here, paths: int = 1):
    """`torchrun ... target` as `nodes` agents of `per_node` processes each, started at once
    (static rendezvous at `master`, the switch at `url`, node i sending from `binds[i]` when
    given, over `paths` source ports, gloo on interface `ifname`, one OpenMP thread);
    `start(node, argv, **popen)` starts node i's agent (by default here: another starts it in
    node i's network namespace). Every agent must exit 0 within `timeout` seconds, or every
    process of the job is killed and the error names `what`, the node, and shows what its
    processes printed (logs in `logs`)."""
    port = _free_port()
    procs, files = [], []
    for node in range(nodes):
        env = {**os.environ, "NETAGG_SWITCH": url, "GLOO_SOCKET_IFNAME": ifname,
               "OMP_NUM_THREADS": "1", "NETAGG_PATHS": str(paths)}
        if binds:
            env["NETAGG_BIND"] = binds[node % len(binds)]
        files.append(logs / (re.sub(r"[^\w.]+", "-", what) + f"-node{node}.log"))
        with open(files[-1], "w") as out:
            procs.append(start(
                node, [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                       "--node-rank", str(node), "--nproc-per-node", str(per_node),
                       "--master-addr", master, "--master-port", str(port), *target],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        for node, p in enumerate(procs):
            try:
                code = p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{what}, node {node}: not finished after {timeout:.0f} s"
                                   f"\n{_tail(files[node])}") from None
            if code != 0:
                raise RuntimeError(f"{what}, node {node}: torchrun exited with {code}\n"
                                   f"{_tail(files[node])}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(10)


def _tail(log: Path, lines: int = 40) -> str:
    """The end of a torchrun log without the agent's own log records ("W1124 05:25:14..."):
    what the processes printed, the first of their errors' messages before it."""
    text = [t for t in log.read_text(errors="replace").splitlines()
            if not re.match(r"[DIWE]\d{4} ", t)]
    errors = [t for t in text if re.match(r"(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Timeout|"
                                         r"Gone|Unreachable|TakenOver)\w*: ", t)]
    return "\n".join(errors[:3] + text[-lines:])


def _drop_classes(url: str, classes, saved: list[int] | None = None) -> list[int]:
    """The drop threshold of each of `classes` to 0, or (`saved`) back to those values;
    returns the old ones."""
    from netagg.host.control import SwitchControl

    ctl = SwitchControl(url)
    try:
        regs = [R.drop_threshold(c) for c in classes]
        old = ctl.read(*regs)
        ctl.write(list(zip(regs, [0] * len(regs) if saved is None else saved)))
        return old
    finally:
        ctl.close()


def _here(call):
    return call()


def train_run(run: Run, *, url: str, tmp: Path, nodes: int, per_node: int, epochs: int,
              seed: int, loss_budget: float, timeout: float, console, model=(),
              at_switch=_here, drop_classes=range(R.PRIORITY_CLASSES), **launch) -> dict:
    """One run of `apps.torch_train` under torchrun (`torchrun`, `launch` its placement:
    binds, master, ifname, start) on the digits in `tmp`; `model` more arguments of it
    (``--channels 64``). For the drop run the drop threshold of each of `drop_classes` (every
    class by default; none where a congested network drops instead) is 0 while it trains.
    `at_switch(call)` calls `call` where the switch at `url` is reached (here, by default).
    Its report, with the contributions the switch dropped by priority."""
    from netagg.apps.train import switch_counters

    budget = loss_budget if run.drop else 0.0
    args = ["--data", str(tmp / "digits.npz"), "--out", str(tmp / f"{run.name}.json"),
            "--epochs", str(epochs), "--seed", str(seed), "--loss-budget", str(budget),
            *model]
    classes = list(drop_classes)
    saved = at_switch(lambda: _drop_classes(url, classes)) if run.drop and classes else None
    before = at_switch(lambda: switch_counters(url))
    try:
        with console.status(f"run {run.name}: {nodes * per_node} processes in {nodes} "
                            f"nodes under torchrun"):
            torchrun(["-m", "netagg.apps.torch_train", "--backend", run.backend, *args],
                     url=url, nodes=nodes, per_node=per_node, logs=tmp,
                     what=f"netagg train: run {run.name}", timeout=timeout, **launch)
    finally:
        if saved is not None:
            at_switch(lambda: _drop_classes(url, classes, saved))
    result = json.loads((tmp / f"{run.name}.json").read_text())
    after = at_switch(lambda: switch_counters(url))
    dropped = after["drop_priority"] - before["drop_priority"]
    sent = sum(r["packets_sent"] for r in result["ranks"])
    result["drop_priority"] = dropped
    result["drop_fraction"] = dropped / sent if sent else 0.0
    return result


def accuracy_gaps(runs: dict) -> dict:
    """Each run's test accuracy minus gloo's, in points (none without a gloo run)."""
    gloo = runs.get("gloo")
    if not gloo:
        return {}
    return {name: 100 * (r["test_accuracy"] - gloo["test_accuracy"])
            for name, r in runs.items() if name != "gloo"}


def train_runs(workers: int = 4, nodes: int = 2, epochs: int = 15, seed: int = 0,
               loss_budget: float = 0.05, backend: str = "golden", runs=RUNS,
               timeout: float = 600.0, quiet: bool = False, channels: int = 16,
               hidden: int = 128) -> dict:
    from rich.console import Console

    from netagg.apps.probe import sources
    from netagg.apps.torch_train import digits
    from netagg.sim.bench import start_server

    if workers % nodes:
        raise ValueError(f"{workers} workers do not split into {nodes} nodes")
    console = Console(stderr=True, quiet=quiet)
    report = {"command": "train", "switch": backend, "workers": workers, "nodes": nodes,
              "epochs": epochs, "seed": seed, "loss_budget": loss_budget,
              "channels": channels, "hidden": hidden, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="netagg-train-") as tmp_name:
        tmp = Path(tmp_name)
        np.savez(tmp / "digits.npz", **digits(seed))
        with console.status(f"starting the {backend} switch"):
            server, url = start_server(backend, max_workers=max(8, workers))
        try:
            binds = sources(url)
            for run in runs:
                report["runs"][run.name] = train_run(
                    run, url=url, tmp=tmp, nodes=nodes, per_node=workers // nodes,
                    epochs=epochs, seed=seed, loss_budget=loss_budget, timeout=timeout,
                    console=console, binds=binds,
                    model=["--channels", str(channels), "--hidden", str(hidden)])
        finally:
            server.terminate()
            server.wait(10)
            server.stdout.close()
    gaps = accuracy_gaps(report["runs"])
    if gaps:
        report["accuracy_gap_points"] = gaps
    return report


def _line(name: str, r: dict) -> str:
    b = r["bytes_sent_per_worker"]
    drop = f", {r['drop_fraction']:.2%} of contributions dropped" if r["drop_priority"] else ""
    return (f"{name:12} test accuracy {r['test_accuracy']:.2%}, {r['time_per_step'] * 1e3:.1f} "
            f"ms/step ({r['steps']} steps), sent per worker {b['switch'] / 1e6:.2f} MB to the "
            f"switch + {b['tcp'] / 1e6:.2f} MB over TCP{drop}")


def summary(report: dict) -> str:
    lines = [_line(n, r) for n, r in report["runs"].items()]
    gaps = report.get("accuracy_gap_points", {})
    if gaps:
        lines.append("accuracy minus gloo's: " + ", ".join(f"{n} {g:+.2f} points"
                                                           for n, g in gaps.items()))
    return "\n".join(lines)


def plot(report: dict, path: str, against: str = "step", title: str | None = None):
    """The mean training loss of every run, on one figure: against the step, or against the
    seconds since the training loop began (`against="seconds"`: the slowest rank's, at the
    end of each step)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in report["runs"].items():
        x = r["seconds_at_step"] if against == "seconds" else range(len(r["loss_per_step"]))
        ax.plot(x, r["loss_per_step"], label=f"{name} ({r['test_accuracy']:.1%})",
                linewidth=1)
    ax.set_xlabel("seconds of training" if against == "seconds" else "step")
    ax.set_ylabel("training loss (mean over workers)")
    ax.set_yscale("log")
    ax.set_title(title or f"digits CNN, {report['workers']} workers in {report['nodes']} "
                          f"nodes, {report['switch']} switch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
