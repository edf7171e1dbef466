"""`netagg sim serve|board`: the simulated switch on UDP (`sim.serve`; a leaf and spine
fabric with `--topology`, `sim.topology_serve`), and a board's top level in Verilator on TAP
devices (`sim.board`)."""

from __future__ import annotations

import argparse
import ipaddress
import re

from netagg.apps import arguments as A
from netagg.apps.commands import command


def _switch_address(text: str) -> str:
    """The one IPv4 address the served switch has (a board has one): not 0.0.0.0."""
    if ipaddress.IPv4Address(A.ipv4(text)).is_unspecified:
        raise argparse.ArgumentTypeError("the one address the switch has (127.0.0.1, say), as "
                                         "a board has one, not 0.0.0.0")
    return text


def _tap_prefix(text: str) -> str:
    """A TAP devices' name prefix: with a port's number, an interface name (15 characters)."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,12}", text):
        raise argparse.ArgumentTypeError(f"a letter, then up to 12 letters, digits or _, "
                                         f"not {text!r}")
    return text


def add_parser(subparsers) -> None:
    sim = subparsers.add_parser("sim", help="the simulated switch")
    which = sim.add_subparsers(dest="sim_command", required=True)
    serve = command(which, "serve", run_serve, help="serve a simulated switch on UDP")
    serve.add_argument("--backend", choices=["golden", "rtl", "echo", "fast"], default=None,
                       help="default rtl; golden with --topology; fast: the golden model "
                            "with its common contribution compiled")
    serve.add_argument("--host", type=_switch_address, default=None,
                       help="the switch's IPv4 address, UDP port 4791 (default: a free "
                            "127.x.y.z)")
    serve.add_argument("--pcap", default=None, help="write every frame in and out to this file "
                                                    "(with --topology: leaf0's)")
    serve.add_argument("--ports", type=A.between(*A.PORTS), default=4, help="switch ports")
    serve.add_argument("--jobs", type=A.between(*A.JOBS), default=4)
    serve.add_argument("--slots", type=A.between(*A.SLOTS), default=64, help="slots per version")
    serve.add_argument("--max-workers", type=A.between(*A.MAX_WORKERS), default=8)
    serve.add_argument("--topology", type=A.simulated_fabric, default=None,
                       help="LEAVESxSPINES (2x2, say): a leaf and spine fabric, one endpoint "
                            "per switch (golden); prints its description, JSON, first")
    serve.add_argument("--describe", default=None,
                       help="with --topology: also write the fabric's description (JSON) here")
    board = command(which, "board", run_board,
                    help="a board's top level in Verilator, its Ethernet ports on TAP devices")
    board.add_argument("--board", required=True, choices=A.BOARDS)
    board.add_argument("--netns", default=None,
                       help="run in this network namespace (created and deleted if new)")
    board.add_argument("--tap", type=_tap_prefix, default="nagg",
                       help="TAP device name prefix: port n is <prefix>n")


def run_serve(args: argparse.Namespace) -> int:
    if args.topology:
        from netagg.sim.topology_serve import serve_topology_main
        return serve_topology_main(args.topology, args.backend or "golden", args.pcap,
                                   args.describe, jobs=args.jobs, slots=args.slots,
                                   max_workers=args.max_workers)
    from netagg.sim.serve import serve_main
    return serve_main(args.backend or "rtl", args.host, args.pcap, ports=args.ports,
                      jobs=args.jobs, slots=args.slots, max_workers=args.max_workers)


def run_board(args: argparse.Namespace) -> int:
    from netagg.sim.board import main as board_main
    return board_main(args.board, tap=args.tap, netns=args.netns)
