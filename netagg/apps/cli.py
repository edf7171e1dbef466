"""The `netagg` command line."""

from __future__ import annotations

import argparse
import os
import sys

from netagg.apps import commands
from netagg.apps.commands import (
    bench,
    cluster,
    demo,
    fuzz,
    gpu_check,
    probe,
    prove,
    scale,
    sim,
    train,
)

# Each declares its command (`add_parser`) and what runs it; `netagg --help` lists them so.
COMMANDS = (bench, demo, train, gpu_check, probe, sim, fuzz, scale, cluster, prove)


def parser() -> argparse.ArgumentParser:
    """`netagg`'s parser: a subparser per command, each with only its own options."""
    top = argparse.ArgumentParser(prog="netagg", description=__doc__)
    subparsers = top.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.add_parser(subparsers)
    return top


def main(argv=None) -> int:
    args, unknown = parser().parse_known_args(argv)
    if unknown:     # told by the command's own parser: `netagg bench fabric: ... --widths`
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return commands.dispatch(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    sys.exit(main())
