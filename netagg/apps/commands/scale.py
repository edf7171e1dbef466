"""`netagg scale`: gradient synchronisation at scale (`apps.scale`): ring, tree, parameter
server, BML, in-network aggregation, in the flow-level model and ns-3. Its options; the sweep
and its output are `apps.scale.cli`'s."""

from __future__ import annotations

import argparse

from netagg.apps import arguments as A
from netagg.apps.commands import command
from netagg.apps.scale.cluster import MODELS, Topology

DEFAULT_WORKERS = "8,16,32,64,128,256,512,1024"


def _model_key(text: str) -> str:
    """A named model as a user spells it (ResNet-50, resnet50, BERT-large...): its key."""
    def plain(name: str) -> str:
        return "".join(c for c in name.lower() if c.isalnum())
    return next((key for key in MODELS if plain(key) == plain(text)), text)


def _scheme(text: str) -> str:
    """One of `apps.scale.flow.Scheme`'s names (that module imports numpy: read when parsed,
    not when the parser is built)."""
    from netagg.apps.scale.flow import Scheme
    return A.one_of(s.value for s in Scheme)(text)


def _gbps(text: str) -> float:
    value = A.positive_float(text)
    if not 1 <= value <= 400:
        raise argparse.ArgumentTypeError(f"a link rate from 1 to 400 Gb/s, not {text!r}")
    return value


def _bcube(text: str) -> tuple[int, int]:
    parts = A.positives(text)
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"n,k: two whole numbers (8,2), not {text!r}")
    return parts[0], parts[1]


def _calibration(text: str) -> str:
    return text if text == "run" else A.existing_file(text)


def add_parser(subparsers) -> None:
    p = command(subparsers, "scale", run,
                help="gradient synchronisation at scale: ring, tree, parameter server, BML, "
                     "in-network aggregation (flow model, ns-3)")
    p.add_argument("--model", default="resnet50", choices=sorted(MODELS), type=_model_key)
    p.add_argument("--params", type=A.positive_float, default=None,
                   help="parameter count instead of a named model (e.g. 2.5e7)")
    p.add_argument("--compute-ms", type=A.positive_float, default=None,
                   help="compute time of one iteration on one worker (default: the model's)")
    p.add_argument("--workers", type=A.positives, default=DEFAULT_WORKERS,
                   help="comma-separated, 8..1024")
    p.add_argument("--gbps", type=A.comma_list(_gbps), default="100",
                   help="link rates, comma-separated, 1..400")
    p.add_argument("--topology", choices=[t.value for t in Topology], default="fat-tree")
    p.add_argument("--radix", type=A.positive, default=64, help="ports per switch")
    p.add_argument("--bcube", type=_bcube, default="8,2",
                   help="BCube n,k (k levels, n^k servers)")
    p.add_argument("--oversubscription", type=A.positive_float, default=1.0, help="leaf-spine")
    p.add_argument("--no-spray", action="store_true", help="ECMP: one hashed path a flow")
    p.add_argument("--gpus-per-node", type=A.positive, default=1)
    p.add_argument("--intra-gbps", type=A.positive_float, default=1200.0)
    p.add_argument("--ps-servers", type=A.natural, default=0,
                   help="dedicated parameter servers (0: a shard on every worker)")
    p.add_argument("--window", type=A.positive, default=128, help="aggregation slots per worker")
    p.add_argument("--no-overlap", action="store_true",
                   help="synchronise after the backward pass, not during it")
    p.add_argument("--schemes", type=A.comma_list(_scheme), default=None,
                   help="comma-separated (default: every one)")
    p.add_argument("--switch-mhz", type=A.positive_float, default=250.0,
                   help="the RTL's clock, turning cycles into time")
    p.add_argument("--calibration", type=_calibration, default=None,
                   help="FILE from `netagg bench switch --json`, or 'run' to measure now")
    p.add_argument("--engine", choices=["flow", "ns3", "both"], default="flow",
                   help="ns3/both: also the packet-level simulation (ring, ps, ina; <= 64 "
                        "workers, <= 4 M packets; `pip install -e .[scale]`)")
    p.add_argument("--loss", type=A.share, default=0.0, help="random loss rate on the path")
    p.add_argument("--overload", type=A.positive_float, default=1.0,
                   help="offered load over capacity at the bottleneck port")
    p.add_argument("--buffer", type=A.natural, default=0,
                   help="switch port buffer in packets for incast (0: deep, lossless)")
    p.add_argument("--loss-budget", type=A.share, default=0.1)
    p.add_argument("--rto-ms", type=A.positive_float, default=200.0)
    p.add_argument("--reproduce", action="store_true",
                   help="the papers' claims beside the model")
    p.add_argument("--plot", default=None, help="write time per iteration and scaling factor "
                                                "against workers to this file")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from netagg.apps.scale.cli import main
    return main(args)
