"""The `netagg` command's commands, one module each (`bench`, `demo`, `sim`, ...): each has
`add_parser(subparsers)`, which declares its options, every one checked where it is parsed
(`apps.arguments`), and a `run(args) -> int` for each command it declares, which imports what
the command needs only when it runs. So `netagg --help`, and the commands that only talk to a
switch (`demo --switch`, `probe`, `bench host`), never import the simulation stack.

`command` declares one: its parser, whose defaults carry its `run` and the parser itself (for
a usage error found after parsing); `dispatch` runs the one parsed. A command whose run needs
the simulation stack where it is not installed ends in one line saying so, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

Run = Callable[[argparse.Namespace], int]

# What `pip install 'netagg[sim]'` adds: an ImportError naming one of these (or a module in
# one) means the simulation stack is missing, not that netagg is broken.
SIM_STACK = ("amaranth", "amaranth_boards", "cocotb", "cocotbext", "scapy", "pyroute2",
             "netagg.sim", "netagg.hw", "netagg.bitstreams")


class _DefaultsShown(argparse.HelpFormatter):
    """Help that gives each option's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if (text is not None and "%(default)" not in text and action.option_strings
                and action.default not in (None, False, "", argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


def command(subparsers, name: str, run: Run, **kwargs) -> argparse.ArgumentParser:
    """Declare the command `name` (its parser; `kwargs` are `add_parser`'s), run by `run`."""
    kwargs.setdefault("formatter_class", _DefaultsShown)
    parser = subparsers.add_parser(name, **kwargs)
    parser.set_defaults(run=run, parser=parser)
    return parser


def needs_sim_stack(error: ImportError) -> bool:
    """Whether `error` is the simulation stack missing (see SIM_STACK)."""
    missing = error.name or ""
    return any(missing == m or missing.startswith(m + ".") for m in SIM_STACK)


def dispatch(args: argparse.Namespace) -> int:
    """Run the command `args` was parsed for: its exit status."""
    try:
        return args.run(args)
    except ImportError as e:
        if not needs_sim_stack(e):
            raise
        print(f"{args.parser.prog}: needs the simulation stack (pip install 'netagg[sim]')",
              file=sys.stderr)
        return 2
