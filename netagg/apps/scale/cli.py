"""`netagg scale`: the sweep over workers and link rates, and its output (a table, one JSON
object, plots, a progress bar on long runs); its arguments are `apps.commands.scale`'s.

Cost: the flow-level model is well under a millisecond a point; each ns-3 point (`--engine
ns3` or `both`, up to 64 workers) takes seconds, and the first one 15 to 40 s of import.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from netagg.apps.scale import loss as loss_model
from netagg.apps.scale.cluster import MODELS, PAYLOAD, Cluster, Model, SwitchCalibration, Topology
from netagg.apps.scale.flow import Scheme, estimate
from netagg.apps.scale.reproduce import claims


def _calibration(args) -> SwitchCalibration:
    if args.calibration is None:
        return SwitchCalibration(clock_mhz=args.switch_mhz)
    if args.calibration == "run":
        from netagg.apps.bench_line_rate import bench_switch
        report = bench_switch(4, 512, 4, quiet=args.json)
    else:
        with open(args.calibration) as f:
            report = json.load(f)
    return SwitchCalibration.from_bench(report, args.switch_mhz)


def _model(args) -> Model:
    base = MODELS[args.model]
    if args.params:
        base = Model(f"{args.params:.3g} parameters", int(args.params), base.compute_s)
    if args.compute_ms is not None:
        base = dataclasses.replace(base, compute_s=args.compute_ms / 1e3)
    return base


def _cluster(args, workers: int, gbps: float, switch: SwitchCalibration) -> Cluster:
    n, k = args.bcube
    return Cluster(workers, gbps, Topology(args.topology), radix=args.radix, bcube_n=n,
                   bcube_k=k, oversubscription=args.oversubscription,
                   spraying=not args.no_spray, gpus_per_node=args.gpus_per_node,
                   intra_gbps=args.intra_gbps, ps_servers=args.ps_servers,
                   window=args.window, overlap=not args.no_overlap, switch=switch)


def sweep(args, console) -> dict:
    from rich.progress import Progress

    model, switch = _model(args), _calibration(args)
    workers = args.workers
    rates = args.gbps
    schemes = [Scheme(s) for s in args.schemes] if args.schemes else list(Scheme)
    setup = loss_model.LossSetup(args.loss, args.overload, args.buffer, args.loss_budget,
                                 args.rto_ms / 1e3)
    lossy = args.loss > 0 or args.overload > 1 or args.buffer > 0
    points = [(g, n, s) for g in rates for n in workers for s in schemes]
    rows = []
    with Progress(console=console, transient=True,
                  disable=len(points) < 200 and args.engine == "flow") as progress:
        task = progress.add_task("scale", total=len(points))
        for gbps, n, scheme in points:
            cluster = _cluster(args, n, gbps, switch)
            e = estimate(scheme, cluster, model)
            row = {"gbps": gbps, **dataclasses.asdict(e), "scheme": scheme.value}
            if lossy:
                row["tails"] = [dataclasses.asdict(t) for t in loss_model.tails(
                    e, model.gradient_bytes, model.compute_s, cluster.overlap, setup,
                    cluster.ps_servers, cluster.window)]
            if args.engine != "flow":
                row["ns3"] = _packet_level(scheme, cluster, model)
            rows.append(row)
            progress.advance(task)
    return {"model": dataclasses.asdict(model), "switch": dataclasses.asdict(switch)
            | {"port_gbps": switch.port_gbps, "latency_s": switch.latency_s},
            "topology": args.topology, "rows": rows}


def _packet_level(scheme: Scheme, cluster: Cluster, model: Model) -> dict:
    from netagg.apps.scale import ns3
    if not ns3.available():
        return {"skipped": "ns3 is not installed (pip install -e .[scale])"}
    if scheme not in ns3.ENGINE_SCHEMES or cluster.workers > ns3.MAX_WORKERS:
        return {"skipped": f"ns-3 runs ring, ps, ina up to {ns3.MAX_WORKERS} workers"}
    if 2 * cluster.workers * model.gradient_bytes / PAYLOAD > ns3.MAX_PACKETS:
        return {"skipped": f"more than {ns3.MAX_PACKETS:,} packets: use --params"}
    c = ns3.comparable(cluster)
    r = ns3.simulate(scheme, c, model.gradient_bytes)
    flow = estimate(scheme, c, model).sync_s
    return {"sync_s": r.max_s, "mean_finish_s": r.mean_s, "flow_sync_s": flow,
            "difference": flow / r.max_s - 1, "packets": r.packets, "peak_queue": r.peak_queue}


def print_sweep(report: dict, console) -> None:
    from rich.table import Table

    m = report["model"]
    table = Table(title=f"{m['name']}: {m['params']:,} parameters, "
                        f"{m['compute_s'] * 1e3:.0f} ms compute, {report['topology']}")
    for col in ("Gb/s", "workers", "scheme", "sync ms", "iteration ms", "scaling",
                "utilisation", "full-util scaling", "note"):
        table.add_column(col)
    for r in report["rows"]:
        note = r["note"]
        if r.get("ns3", {}).get("skipped"):
            note = f"ns-3: {r['ns3']['skipped']} " + note
        elif r.get("ns3"):
            note = f"ns-3 {r['ns3']['sync_s'] * 1e3:.3f} ms ({r['ns3']['difference']:+.1%}) " + note
        for t in r.get("tails", []):
            note += f" [{t['mode']}: mean {t['mean_sync_s'] * 1e3:.1f}, p99 " \
                    f"{t['p99_sync_s'] * 1e3:.1f} ms]"
        table.add_row(f"{r['gbps']:g}", str(r["workers"]), r["scheme"],
                      f"{r['sync_s'] * 1e3:.3f}", f"{r['iteration_s'] * 1e3:.1f}",
                      f"{r['scaling']:.3f}", f"{r['utilisation']:.3f}",
                      f"{r['full_scaling']:.3f}", note)
    console.print(table)


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))
    gbps = report["rows"][0]["gbps"]
    for scheme in dict.fromkeys(r["scheme"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["scheme"] == scheme and r["gbps"] == gbps]
        x = [r["workers"] for r in rows]
        ax_t.plot(x, [r["iteration_s"] * 1e3 for r in rows], marker="o", label=scheme)
        ax_s.plot(x, [r["scaling"] for r in rows], marker="o", label=scheme)
    for ax, label in ((ax_t, "time per iteration (ms)"), (ax_s, "scaling factor")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_s.legend(fontsize=8)
    fig.suptitle(f"{report['model']['name']}, {report['topology']}, {gbps:g} Gb/s links")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_claims(rows: list, console) -> None:
    from rich.table import Table

    table = Table(title="The papers' claims in the flow-level model")
    for col in ("source", "claim", "setup", "paper / bound", "model", "holds", "why not"):
        table.add_column(col)
    for c in rows:
        table.add_row(c.source, c.claim, c.setup, c.paper, c.model,
                      "yes" if c.holds else "no", c.why)
    console.print(table)


def main(args) -> int:
    from rich.console import Console

    console = Console(stderr=args.json)
    if args.reproduce:
        rows = claims()
        if args.json:
            print(json.dumps({"claims": [dataclasses.asdict(c) for c in rows]}))
        else:
            print_claims(rows, Console(width=200))
        return 0
    report = sweep(args, console)
    if args.plot:
        plot(report, args.plot)
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report))
    else:
        print_sweep(report, Console(width=200))
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    """The `scale` arguments alone (for tests)."""
    from netagg.apps.commands.scale import add_parser

    parser = argparse.ArgumentParser(prog="netagg")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["scale", *argv])
