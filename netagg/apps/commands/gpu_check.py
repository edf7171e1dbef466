"""`netagg gpu-check`: the torch backend's CUDA path on this machine's GPU (`apps.gpu_check`):
2 processes on cuda:0 through a simulated switch, against the CPU path and gloo."""

from __future__ import annotations

import argparse
import json

from netagg.apps import arguments as A
from netagg.apps.commands import command

# `apps.gpu_check.LAYOUTS`' names.
LAYOUTS = ("hierarchical", "flat")


def add_parser(subparsers) -> None:
    p = command(subparsers, "gpu-check", run,
                help="the torch backend's CUDA path on this machine's GPU: 2 processes on "
                     "cuda:0 through a simulated switch, against the CPU path and gloo")
    p.add_argument("--values", type=A.count, default=4 << 20,
                   help="float32 values of the staging's timed all_reduce")
    p.add_argument("--layouts", type=A.comma_list(A.one_of(LAYOUTS)),
                   default="hierarchical,flat",
                   help="hierarchical (one torchrun agent of 2), flat (2 agents of 1)")
    p.add_argument("--timeout", type=A.positive_float, default=420.0,
                   help="seconds for every layout together")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from netagg.apps import gpu_check
    report = gpu_check.gpu_check(values=args.values, layouts=args.layouts,
                                 timeout=args.timeout, quiet=args.json)
    print(json.dumps(report) if args.json else gpu_check.summary(report))
    return 0 if report["verified"] else 2 if "error" in report else 1
