"""`netagg train`: DDP training of a small CNN through gloo, netagg, and netagg with priority
drop, side by side (`apps.torch_runs`), or on an emulated cluster (`--cluster`,
`apps.train_cluster`)."""

from __future__ import annotations

import argparse
import json

from netagg.apps import arguments as A
from netagg.apps.commands import command

# The runs `apps.torch_runs.RUNS` names (that module imports the simulated switch).
RUNS = ("gloo", "netagg", "netagg_drop")


def add_parser(subparsers) -> None:
    p = command(subparsers, "train", run,
                help="DDP training of a small CNN through gloo, netagg, and netagg with "
                     "priority drop, side by side")
    p.add_argument("--workers", type=A.positive, default=4, help="torchrun processes")
    p.add_argument("--nodes", type=A.positive, default=2, help="torchrun agents (nodes)")
    p.add_argument("--epochs", type=A.positive, default=None, help="default 15; --cluster 3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-budget", type=A.share, default=0.05,
                   help="the drop run's share of each gradient's chunks sent droppable")
    p.add_argument("--runs", type=A.comma_list(A.one_of(RUNS)),
                   default="gloo,netagg,netagg_drop",
                   help="runs, comma-separated: gloo, netagg, netagg_drop")
    p.add_argument("--backend", choices=["golden", "rtl"], default="golden",
                   help="the simulated switch")
    p.add_argument("--plot", default=None, help="write the loss curves to this image")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--cluster", action="store_true",
                   help="on an emulated cluster (needs root): a process per host, each under "
                        "its own torchrun agent, on shaped links")
    p.add_argument("--hosts", type=A.positive, default=4, help="cluster: hosts")
    p.add_argument("--topology", type=A.emulated_fabric, default=None,
                   help="cluster: LEAVESxSPINES, a leaf and spine fabric (--hosts-per-leaf "
                        "hosts a leaf) instead of one rack")
    p.add_argument("--hosts-per-leaf", type=A.positive, default=2,
                   help="cluster --topology: hosts a leaf")
    p.add_argument("--oversubscription", type=A.positive_float, default=1.0,
                   help="cluster --topology: a leaf's host links' rate over its uplinks'")
    p.add_argument("--spray", action="store_true",
                   help="cluster --topology: spray netagg's packets over the spines")
    p.add_argument("--cross-traffic", action="store_true",
                   help="cluster --topology: another job's TCP flows and incast through "
                        "every run, the fabric honouring DSCP")
    p.add_argument("--rate", type=A.rate, default="100mbit",
                   help="cluster: each host link's rate")
    p.add_argument("--switch", choices=["fast", "golden"], default="fast",
                   help="cluster: netagg's switch on the rack")
    p.add_argument("--channels", type=A.positive, default=None,
                   help="the CNN's first convolution's channels (default 16; --cluster 64)")
    p.add_argument("--hidden", type=A.positive, default=None,
                   help="the CNN's hidden layer's width (default 128; --cluster 2048)")


def run(args: argparse.Namespace) -> int:
    from netagg.apps import torch_runs
    runs = {r.name: r for r in torch_runs.RUNS}
    chosen = [runs[name] for name in args.runs]
    given = {k: getattr(args, k) for k in ("epochs", "channels", "hidden")
             if getattr(args, k) is not None}
    if args.cluster:
        from netagg.apps import train_cluster
        report = train_cluster.train_cluster(
            hosts=args.hosts, rate=args.rate, switch=args.switch, seed=args.seed,
            loss_budget=args.loss_budget, runs=chosen,
            fabric=None if args.topology is None else dict(
                topology=args.topology, hosts_per_leaf=args.hosts_per_leaf,
                oversubscription=args.oversubscription, spray=args.spray),
            cross_traffic=args.cross_traffic, quiet=args.json, **given)
        if args.plot:
            train_cluster.plot(report, args.plot)
        print(json.dumps(report) if args.json else train_cluster.summary(report))
        return 0
    report = torch_runs.train_runs(workers=args.workers, nodes=args.nodes, seed=args.seed,
                                   loss_budget=args.loss_budget, backend=args.backend,
                                   runs=chosen, quiet=args.json, **given)
    if args.plot:
        torch_runs.plot(report, args.plot)
    print(json.dumps(report) if args.json else torch_runs.summary(report))
    return 0
