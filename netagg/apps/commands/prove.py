"""`netagg prove`: the formal proofs of the switch's invariants (`apps.prove`: SymbiYosys,
Yices 2)."""

from __future__ import annotations

import argparse
from pathlib import Path

from netagg.apps import arguments as A
from netagg.apps.commands import command


def add_parser(subparsers) -> None:
    p = command(subparsers, "prove", run,
                help="prove the switch's invariants (SymbiYosys, Yices 2)")
    p.add_argument("--only", default="", help="run the checks whose name contains this")
    p.add_argument("--jobs", type=A.positive, default=2, help="checks run at once")
    p.add_argument("--build", type=Path, default=Path("build") / "formal",
                   help="the build folder")


def run(args: argparse.Namespace) -> int:
    from netagg.apps.prove import main
    return main(args)
