"""`netagg probe udp://HOST:PORT`: a switch's parameters, addresses and counters
(`apps.probe`); a switch that does not answer within `--timeout` is one line naming it."""

from __future__ import annotations

import argparse

from netagg.apps import arguments as A
from netagg.apps.commands import command


def add_parser(subparsers) -> None:
    p = command(subparsers, "probe", run,
                help="read a switch's parameters, addresses and counters")
    p.add_argument("url", type=A.switch_url, help="udp://HOST:PORT")
    p.add_argument("--timeout", type=A.positive_float, default=3.0,
                   help="seconds to wait for it")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from netagg.apps.probe import probe_main
    return probe_main(args.url, args.json, args.timeout)
