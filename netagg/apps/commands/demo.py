"""`netagg demo`: an allreduce through a switch, checked against numpy. A simulated switch
(`--backend`), a simulated leaf and spine fabric (`--topology`), a described fabric's
switches (`--fabric`), or an existing switch (`--switch udp://HOST:PORT`, which needs only
the host software); a switch that does not answer ends in one line naming it."""

from __future__ import annotations

import argparse
import json
import sys

from netagg.apps import arguments as A
from netagg.apps.commands import command


def add_parser(subparsers) -> None:
    p = command(subparsers, "demo", run,
                help="allreduce through a switch (simulated unless --switch), checked")
    p.add_argument("--workers", type=A.positive, default=4)
    p.add_argument("--nodes", type=A.positive, default=2,
                   help="nodes the workers are grouped into (hierarchical allreduce)")
    p.add_argument("--values", type=A.count, default=2_000_000,
                   help="float32 values per worker")
    p.add_argument("--steps", type=A.positive, default=8,
                   help="tensors the values are split into")
    p.add_argument("--backend", choices=["golden", "rtl"], default=None,
                   help="rtl: the switch's Verilator model (default; with --topology the "
                        "leaves' and spines'); golden: the Python model, no compiler needed")
    p.add_argument("--pcap", default=None, help="write every switch frame to this file")
    p.add_argument("--paths", type=A.positive, default=1,
                   help="UDP source ports each worker sprays its packets over")
    p.add_argument("--spray", choices=["round_robin", "least_loaded"], default="round_robin")
    p.add_argument("--switch", type=A.switch_url, default=None,
                   help="udp://HOST:PORT of an existing switch (a board, sim board, sim "
                        "serve) instead of starting one")
    p.add_argument("--bind", type=A.ipv4s, default=None,
                   help="local IPv4 addresses the nodes send from, comma-separated (node i "
                        "from the i-th, round robin); default: one per switch port reached")
    p.add_argument("--topology", type=A.simulated_fabric, default=None,
                   help="LEAVESxSPINES (2x2, say): the workers over a simulated leaf and "
                        "spine fabric, their ranks in blocks over the leaves")
    p.add_argument("--fabric", type=A.existing_file, default=None,
                   help="a leaf and spine fabric's description (JSON file, as `sim serve "
                        "--topology --describe` writes it): worker processes over UDP, each "
                        "naming its leaf")
    p.add_argument("--uplink-down-at", type=A.inner_share, default=None,
                   help="with --topology: the share of the run (0.5: halfway) at which "
                        "every leaf's uplink to the last spine goes down")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.fabric:
        from netagg.apps.demo_fabric import demo_described
        report = demo_described(args.fabric, workers=args.workers, values=args.values,
                                steps=args.steps, quiet=args.json)
    elif args.topology:
        from netagg.apps.demo_fabric import demo_fabric
        report = demo_fabric(args.topology, workers=args.workers, values=args.values,
                             steps=args.steps, backend=args.backend or "rtl",
                             uplink_down_at=args.uplink_down_at, quiet=args.json)
    else:
        if args.workers % args.nodes:
            args.parser.error(f"argument --nodes: {args.workers} workers do not split into "
                              f"{args.nodes} nodes")
        from netagg.apps.demo import demo
        from netagg.host.errors import NetaggError
        try:
            report = demo(workers=args.workers, nodes=args.nodes, values=args.values,
                          backend=args.backend or "rtl", steps=args.steps, as_json=args.json,
                          pcap=args.pcap, paths=args.paths, spray=args.spray,
                          switch=args.switch, binds=args.bind)
        except (NetaggError, OSError) as e:
            if args.switch is None:
                raise
            print(f"netagg demo: {e}", file=sys.stderr)    # names the switch and what it did
            return 1
    if args.json:
        print(json.dumps(report))
    return 0 if report["verified"] else 1
