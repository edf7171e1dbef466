"""`netagg fuzz`: differential fuzzing (`sim.fuzz`): the switch's RTL, or the fast switch,
against its golden model on good and mutated frames."""

from __future__ import annotations

import argparse

from netagg.apps import arguments as A
from netagg.apps.commands import command


def add_parser(subparsers) -> None:
    p = command(subparsers, "fuzz", run,
                help="differential fuzzing: the switch's RTL (or the fast switch) against its "
                     "golden model on good and mutated frames")
    p.add_argument("--frames", type=A.positive, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=A.one_of(A.WIDTHS), default=64,
                   help="bits per port (64, 128, 256, 512)")
    p.add_argument("--minimise", action="store_true",
                   help="shrink the first difference to the fewest frames that show it")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--spine", action="store_true",
                   help="a switch built as a spine against the golden spine, on leaves' "
                        "partials")
    p.add_argument("--against", choices=["rtl", "fast"], default="rtl",
                   help="the switch held to the golden model: its RTL, or the fast switch "
                        "(sim/fast.py, a single switch)")
    p.add_argument("--leaf", action="store_true",
                   help="a switch built with uplinks against the golden leaf, on its local "
                        "workers' traffic and a spine's (partials up, results and pulls down)")


def run(args: argparse.Namespace) -> int:
    if args.against == "fast" and (args.spine or args.leaf):
        args.parser.error("argument --against: fast is a single switch: no --spine or --leaf")
    from netagg.sim.fuzz import main as fuzz_main
    return fuzz_main(args.frames, args.seed, args.json, args.width, args.minimise,
                     spine=args.spine, leaf=args.leaf, against=args.against)
