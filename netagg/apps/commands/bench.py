"""`netagg bench BENCHMARK`: a subcommand per benchmark, each with only its own options, its
run importing the benchmark's module (`apps.bench_*`, `apps.congestion`, `apps.demo`,
`sim.bench_fast`) and printing its figures, or one JSON object with `--json`."""

from __future__ import annotations

import argparse
import json

from netagg.apps import arguments as A
from netagg.apps.commands import command

# Allreduce benchmark sizes: 4 KB .. 64 MB.
ALLREDUCE_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
# Simulated switches are slow (the golden model tens of thousands of contributions per
# second, the RTL at 64 bits a few hundred): their default sizes stop here unless --sizes
# asks for more.
MAX_DEFAULT_SIZE = {"golden": 4 << 20, "rtl": 1 << 20}
CONGESTION_EXPERIMENTS = ("priority_drop", "spraying")
SPRAY = ("round_robin", "least_loaded")
SIMULATED = ("golden", "rtl")


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="run a benchmark and print its figures")
    which = bench.add_subparsers(dest="what", required=True, metavar="BENCHMARK")
    for add in (_datapath, _switch, _allreduce, _congestion, _board, _host, _leafspine,
                _cluster, _fast, _loss, _failures, _fabric):
        p = add(which)
        p.add_argument("--json", action="store_true", help="print one JSON object")


def _print_json(args: argparse.Namespace, report: dict) -> None:
    if args.json:
        print(json.dumps(report))


def _datapath(which) -> argparse.ArgumentParser:
    p = command(which, "datapath", run_datapath,
                help="one port's datapath in Verilator: beats per cycle in and out, per width")
    p.add_argument("--widths", type=A.widths, default="64,128,256,512",
                   help="widths in bits, comma-separated (64, 128, 256, 512)")
    return p


def run_datapath(args: argparse.Namespace) -> int:
    from netagg.apps.bench_line_rate import bench_datapath
    report = bench_datapath(args.widths, quiet=False)
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(
            f"{w:>4} bits: {r['in_beats_per_cycle']:.3f} beats/cycle in, "
            f"{r['out_beats_per_cycle']:.3f} beats/cycle out, "
            f"{r['sim_cycles_per_second']:,.0f} simulated cycles/s"
            for w, r in report["widths"].items()))
    return 0


def _switch(which) -> argparse.ArgumentParser:
    p = command(which, "switch", run_switch,
                help="the switch in Verilator, every port busy: beats per cycle, latency")
    p.add_argument("--ports", type=A.between(*A.PORTS), default=4, help="switch ports")
    p.add_argument("--width", type=A.one_of(A.WIDTHS), default=512,
                   help="bits per port (64, 128, 256, 512)")
    p.add_argument("--rounds", type=A.positive, default=4,
                   help="rounds of 16 slots of contributions on every port")
    return p


def run_switch(args: argparse.Namespace) -> int:
    from netagg.apps.bench_line_rate import bench_switch
    report = bench_switch(args.ports, args.width, args.rounds, quiet=args.json)
    if args.json:
        print(json.dumps(report))
    else:
        rates = ", ".join(f"{r:.3f}" for r in report["beats_per_cycle"])
        print(f"{report['ports']} ports x {report['width']} bits: beats/cycle per port "
              f"{rates}; latency {report['latency_cycles']} cycles from a slot's last "
              f"contribution to its first result beat; "
              f"{report['cycles_per_second']:,.0f} simulated cycles/s")
    return 0


def _allreduce(which) -> argparse.ArgumentParser:
    p = command(which, "allreduce", run_allreduce,
                help="allreduce time per tensor size through a simulated switch")
    p.add_argument("--sizes", type=A.sizes, default=None,
                   help="tensor sizes (e.g. 4K,1M); default 4 KB..64 MB, capped at 4 MB for "
                        "the golden model, 1 MB for the RTL")
    p.add_argument("--workers", type=A.positive, default=4)
    p.add_argument("--backend", choices=SIMULATED, default="golden")
    p.add_argument("--transports", type=A.comma_list(A.one_of(("inproc", "udp"))),
                   default="inproc,udp", help="inproc, udp (comma-separated)")
    return p


def run_allreduce(args: argparse.Namespace) -> int:
    from netagg.apps.demo import bench_allreduce
    sizes = args.sizes or [s for s in ALLREDUCE_SIZES
                           if s <= MAX_DEFAULT_SIZE.get(args.backend, s)]
    report = bench_allreduce(sizes, workers=args.workers, backend=args.backend,
                             transports=args.transports, quiet=args.json)
    _print_json(args, report)
    return 0


def _congestion(which) -> argparse.ArgumentParser:
    p = command(which, "congestion", run_congestion,
                help="priority drop and spraying under congestion, through a simulated switch")
    p.add_argument("--backend", choices=SIMULATED, default="golden")
    p.add_argument("--experiments", type=A.comma_list(A.one_of(CONGESTION_EXPERIMENTS)),
                   default="priority_drop,spraying",
                   help="priority_drop, spraying (comma-separated)")
    p.add_argument("--paths", type=A.positives, default="1,2,4",
                   help="path counts to spray over, comma-separated")
    p.add_argument("--spray", choices=SPRAY, default="round_robin",
                   help="how packets are spread over the paths")
    p.add_argument("--workers", type=A.positive, default=4)
    p.add_argument("--size", type=A.size, default="1M", help="float32 bytes per worker")
    p.add_argument("--repeat", type=A.positive, default=3,
                   help="runs per path count; the median is reported")
    _priority_drop_options(p)
    return p


def _priority_drop_options(p: argparse.ArgumentParser):
    """The options of a priority-drop experiment: its steps and its loss budget."""
    p.add_argument("--steps", type=A.positive, default=40,
                   help="allreduces per priority-drop mode")
    p.add_argument("--loss-budget", type=A.share, default=0.1,
                   help="share of each tensor's chunks sent droppable")


def run_congestion(args: argparse.Namespace) -> int:
    from netagg.apps.congestion import bench_congestion
    report = bench_congestion(args.backend, args.paths, workers=args.workers, size=args.size,
                              spray=args.spray, repeat=args.repeat, quiet=args.json,
                              experiments=args.experiments,
                              priority={"loss_budget": args.loss_budget, "steps": args.steps})
    _print_json(args, report)
    return 0


def _board(which) -> argparse.ArgumentParser:
    p = command(which, "board", run_board,
                help="the demo through a board's RTL behind TAP devices (needs root)")
    p.add_argument("--board", default="versa_ecp5_5g", choices=A.BOARDS,
                   help="the board whose RTL runs behind TAP devices")
    p.add_argument("--values", type=A.count, default=200_000,
                   help="float32 values per worker")
    p.add_argument("--nodes", type=A.positive, default=None,
                   help="nodes (with --workers); default: a worker on each port")
    p.add_argument("--workers", type=A.positive, default=None,
                   help="workers, with --nodes (default 4)")
    return p


def run_board(args: argparse.Namespace) -> int:
    from netagg.apps.bench_board import bench_board
    report = bench_board(args.board, values=args.values,
                         workers=(args.workers or 4) if args.nodes else None,
                         nodes=args.nodes, quiet=args.json)
    _print_json(args, report)
    return 0


def _host(which) -> argparse.ArgumentParser:
    p = command(which, "host", run_host,
                help="the host software against gloo, over UDP on this machine")
    p.add_argument("--sizes", type=A.sizes, default=None,
                   help="tensor sizes (e.g. 1M,8M); default 1M,8M,32M")
    p.add_argument("--workers", type=A.positive, default=4)
    return p


def run_host(args: argparse.Namespace) -> int:
    from netagg.apps import bench_host
    report = bench_host.bench_host(args.sizes, workers=args.workers)
    _print_json(args, report)
    return 0


def _leafspine(which) -> argparse.ArgumentParser:
    return command(which, "leafspine", run_leafspine,
                   help="what a leaf and spine fabric's second level costs, and its balance")


def run_leafspine(args: argparse.Namespace) -> int:
    from netagg.apps.bench_leafspine import bench_leafspine
    report = bench_leafspine(quiet=args.json)
    _print_json(args, report)
    return 0


def _cluster(which) -> argparse.ArgumentParser:
    p = command(which, "cluster", run_cluster,
                help="netagg against gloo on an emulated rack of shaped links (needs root)")
    p.add_argument("--hosts", type=A.positives, default="4,8",
                   help="host counts, comma-separated")
    p.add_argument("--rate", type=A.rate, default="100mbit", help="each host link's rate")
    p.add_argument("--sizes", type=A.sizes, default=None,
                   help="tensor sizes (e.g. 1M,8M); default 1M,8M,32M")
    p.add_argument("--switch", default="fast", choices=["fast", "golden", "rtl"],
                   help="netagg's switch on the rack")
    p.add_argument("--repeat", type=A.positive, default=3,
                   help="runs of each; the median is reported")
    p.add_argument("--queue", type=A.queue, default=None,
                   help="bytes of queue at each end of a link (default 10 ms of the rate)")
    p.add_argument("--dilation", type=A.positive_float, default=None,
                   help="slow the links this many times (default: 50 for the RTL, else 1)")
    p.add_argument("--plot", default=None, help="draw time against hosts here")
    return p


def run_cluster(args: argparse.Namespace) -> int:
    from netagg.apps import bench_cluster
    report = bench_cluster.bench_cluster(
        args.hosts, args.rate, args.sizes or bench_cluster.DEFAULT_SIZES, args.switch,
        args.repeat, args.queue, quiet=args.json, dilation=args.dilation)
    if args.plot:
        bench_cluster.plot(report, args.plot)
    _print_json(args, report)
    return 0 if all(r[lib]["verified"] for r in report["runs"]
                    for lib in bench_cluster.LIBRARIES) else 1


def _fast(which) -> argparse.ArgumentParser:
    p = command(which, "fast", run_fast,
                help="the fast switch's contributions per second, in memory and over UDP")
    p.add_argument("--workers", type=A.positive, default=8, help="workers and UDP senders")
    p.add_argument("--seconds", type=A.positive_float, default=2.0,
                   help="seconds of each measurement")
    return p


def run_fast(args: argparse.Namespace) -> int:
    from netagg.sim.bench_fast import bench_fast
    report = bench_fast(args.workers, seconds=args.seconds, quiet=args.json)
    if args.json:
        print(json.dumps(report))
    else:
        m, u = report["in_memory"], report["udp"]
        print(f"fast switch in memory, one core: {m['contributions_per_second']:,.0f} "
              f"contributions/s ({m['workers']} workers, {m['payload_bytes']} bytes a "
              f"contribution); over UDP: {u['contributions_per_second']:,.0f} "
              f"contributions/s ({u['senders']} senders, {u['slots']} slots each, "
              f"{u['switch_cpu_seconds']:.2f} s of the switch's CPU and "
              f"{u['senders_cpu_seconds']:.2f} s of the senders' in {u['seconds']:g} s); "
              f"{m['errors'] + u['errors']} wrong sums")
    return 0


def _loss(which) -> argparse.ArgumentParser:
    p = command(which, "loss", run_loss,
                help="allreduce under heavy loss: early loss recovery against timers alone")
    p.add_argument("--losses", type=A.percents, default="1,5,20",
                   help="loss rates each way, in percent, comma-separated")
    p.add_argument("--workers", type=A.positive, default=4)
    p.add_argument("--values", type=A.count, default=1_000_000,
                   help="float32 values per worker, in 6 tensors")
    p.add_argument("--repeat", type=A.positive, default=1,
                   help="runs of each; the median is reported")
    p.add_argument("--switch", default="fast", choices=["fast", "golden", "rtl"],
                   help="the simulated switch")
    return p


def run_loss(args: argparse.Namespace) -> int:
    from netagg.apps.bench_loss import bench_loss
    report = bench_loss(args.losses, workers=args.workers, values=args.values,
                        repeat=args.repeat, backend=args.switch, quiet=args.json)
    _print_json(args, report)
    return 0 if all(r[k]["verified"] for r in report["runs"]
                    for k in ("early", "timers")) else 1


def _failures(which) -> argparse.ArgumentParser:
    p = command(which, "failures", run_failures,
                help="how fast, and how rightly, the ranks name a switch that dies and a job "
                     "taken over")
    p.add_argument("--backends", type=A.comma_list(A.one_of(SIMULATED)), default="golden,rtl",
                   help="the simulated switches, comma-separated")
    p.add_argument("--repeat", type=A.positive, default=10, help="runs of each scenario")
    return p


def run_failures(args: argparse.Namespace) -> int:
    from netagg.apps.bench_failures import bench_failures
    report = bench_failures(args.backends, runs=args.repeat, quiet=args.json)
    _print_json(args, report)
    return 0 if all(s["right"] == s["named"] for s in report["scenarios"]) else 1


def _fabric(which) -> argparse.ArgumentParser:
    p = command(which, "fabric", run_fabric,
                help="netagg on an emulated leaf and spine fabric: ECMP, spraying, a ring, "
                     "priority drop (needs root)")
    p.add_argument("--topology", type=A.emulated_fabric, default="2x2", help="LEAVESxSPINES")
    p.add_argument("--hosts-per-leaf", type=A.positive, default=2, help="hosts a leaf")
    p.add_argument("--rate", type=A.rate, default="40mbit", help="each host link's rate")
    p.add_argument("--oversubscription", type=A.positive_float, default=2.0,
                   help="a leaf's host links' rate over its uplinks'")
    p.add_argument("--size", type=A.size, default="8M", help="float32 bytes per host")
    p.add_argument("--repeat", type=A.positive, default=5,
                   help="runs of each mode; the median is reported")
    _priority_drop_options(p)
    return p


def run_fabric(args: argparse.Namespace) -> int:
    from netagg.apps.bench_fabric import bench_fabric
    report = bench_fabric(args.topology, args.hosts_per_leaf, args.rate,
                          args.oversubscription, args.size, args.repeat, quiet=args.json,
                          steps=args.steps, loss_budget=args.loss_budget)
    _print_json(args, report)
    return 0 if report["verified"] else 1
