"""`netagg cluster up|down`: the emulated rack, or leaf and spine fabric, of shaped links
(`apps.cluster`, needs root)."""

from __future__ import annotations

import argparse

from netagg.apps import arguments as A
from netagg.apps.commands import command


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("cluster",
                              help="an emulated rack of hosts on shaped links (needs root)")
    which = p.add_subparsers(dest="cluster_command", required=True)
    up = command(which, "up", run_up, help="make the cluster and hold it until Ctrl-C")
    up.add_argument("--hosts", type=A.positive, default=4)
    up.add_argument("--rate", type=A.rate, default="100mbit",
                    help="each host link's rate, both ways")
    up.add_argument("--queue", type=A.queue, default=None,
                    help="bytes of queue at each end of a link (default: 10 ms of the rate)")
    up.add_argument("--switch", default="fast", choices=["fast", "golden", "rtl", "none"],
                    help="netagg's switch on the rack's port ('none': no switch)")
    up.add_argument("--name", type=A.name, default="nagg",
                    help="the prefix of everything it makes")
    up.add_argument("--topology", type=A.emulated_fabric, default=None,
                    help="LEAVESxSPINES: a leaf and spine fabric instead of one rack")
    up.add_argument("--hosts-per-leaf", type=A.positive, default=2, help="fabric: hosts a leaf")
    up.add_argument("--oversubscription", type=A.positive_float, default=1.0,
                    help="fabric: a leaf's host links' rate over its uplinks'")
    up.add_argument("--spray", action="store_true",
                    help="fabric: spray netagg's packets over the spines (else ECMP's hash)")
    down = command(which, "down", run_down,
                   help="remove a cluster (what a crash left behind)")
    down.add_argument("--name", type=A.name, default="nagg")


def run_up(args: argparse.Namespace) -> int:
    from netagg.apps.cluster import up
    return up(args)


def run_down(args: argparse.Namespace) -> int:
    from netagg.apps.cluster import down
    return down(args)
