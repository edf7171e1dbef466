"""The `netagg` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from netagg.apps import arguments as A

# Allreduce benchmark sizes: 4 KB .. 64 MB.
ALLREDUCE_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
# Simulated switches are slow (the golden model tens of thousands of contributions per
# second, the RTL at 64 bits a few hundred): their default sizes stop here unless --sizes
# asks for more.
MAX_DEFAULT_SIZE = {"golden": 4 << 20, "rtl": 1 << 20}


def main(argv=None) -> int:
    from netagg.bitstreams import BOARDS

    parser = argparse.ArgumentParser(prog="netagg", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark and print its figures")
    bench.add_argument("what", choices=["datapath", "switch", "allreduce", "congestion",
                                        "board", "host", "leafspine", "cluster", "fast",
                                        "loss", "failures", "fabric"])
    bench.add_argument("--ports", type=A.positive, default=4, help="switch: ports")
    bench.add_argument("--width", type=A.positive, default=512, help="switch: bits per port")
    bench.add_argument("--rounds", type=A.positive, default=4,
                       help="switch: rounds of 16 slots of contributions on every port")
    bench.add_argument("--widths", default="64,128,256,512",
                       help="datapath: widths in bits, comma-separated")
    bench.add_argument("--sizes", type=A.sizes, default=None,
                       help="allreduce: tensor sizes (e.g. 4K,1M); default 4 KB..64 MB, "
                            "capped at 4 MB for the golden model, 1 MB for the RTL; "
                            "host: default 1M,8M,32M")
    bench.add_argument("--workers", type=A.positive, default=None,
                       help="allreduce, host, loss: workers (default 4); fast: workers and UDP "
                            "senders (default 8)")
    bench.add_argument("--seconds", type=float, default=2.0,
                       help="fast: seconds of each measurement")
    bench.add_argument("--backend", choices=["golden", "rtl"], default="golden")
    bench.add_argument("--transports", default="inproc,udp", help="allreduce: inproc,udp")
    bench.add_argument("--paths", default="1,2,4",
                       help="congestion: path counts to spray over, comma-separated")
    bench.add_argument("--spray", choices=["round_robin", "least_loaded"], default="round_robin",
                       help="congestion: how packets are spread over the paths")
    bench.add_argument("--size", type=A.size, default=None,
                       help="congestion: float32 bytes per worker (e.g. 256K; default 1M); "
                            "fabric: per host (default 8M)")
    bench.add_argument("--repeat", type=A.positive, default=None,
                       help="congestion: runs per path count (default 3); cluster: runs of "
                            "each (default 3); loss: runs of each (default 1); the median is "
                            "reported; failures: runs of each scenario (default 10); fabric: "
                            "runs of each mode (default 5)")
    bench.add_argument("--backends", default="golden,rtl",
                       help="failures: the simulated switches, comma-separated")
    bench.add_argument("--losses", default="1,5,20",
                       help="loss: loss rates each way, in percent, comma-separated")
    bench.add_argument("--experiments", default="priority_drop,spraying",
                       help="congestion: priority_drop, spraying (comma-separated)")
    bench.add_argument("--loss-budget", type=float, default=0.1,
                       help="congestion, fabric: share of each tensor's chunks sent droppable")
    bench.add_argument("--steps", type=A.positive, default=40,
                       help="congestion, fabric: allreduces per priority-drop mode")
    bench.add_argument("--board", default="versa_ecp5_5g", choices=BOARDS,
                       help="board: the board whose RTL runs behind TAP devices")
    bench.add_argument("--values", type=A.positive, default=None,
                       help="board: float32 values per worker (default 200,000); loss: the "
                            "same in 6 tensors (default 1,000,000)")
    bench.add_argument("--nodes", type=A.positive, default=None,
                       help="board: nodes (with --workers); default: a worker on each port")
    bench.add_argument("--hosts", type=A.positives, default="4,8",
                       help="cluster: host counts, comma-separated (needs root)")
    bench.add_argument("--rate", default=None,
                       help="cluster, fabric: each host link's rate (default 100mbit; fabric "
                            "40mbit)")
    bench.add_argument("--topology", default="2x2", help="fabric: LEAVESxSPINES")
    bench.add_argument("--hosts-per-leaf", type=A.positive, default=2, help="fabric: hosts a leaf")
    bench.add_argument("--oversubscription", type=float, default=2.0,
                       help="fabric: a leaf's host links' rate over its uplinks'")
    bench.add_argument("--queue", default=None,
                       help="cluster: bytes of queue at each end of a link (default 10 ms)")
    bench.add_argument("--switch", default="fast", choices=["fast", "golden", "rtl"],
                       help="cluster: netagg's switch on the rack; loss: the simulated switch")
    bench.add_argument("--plot", default=None, help="cluster: draw time against hosts here")
    bench.add_argument("--dilation", type=float, default=None,
                       help="cluster: slow the links this many times (default: 50 for the "
                            "RTL, else 1)")
    bench.add_argument("--json", action="store_true", help="print one JSON object")

    demo = sub.add_parser("demo", help="allreduce through a switch (simulated unless "
                                         "--switch), checked")
    demo.add_argument("--workers", type=A.positive, default=4)
    demo.add_argument("--nodes", type=A.positive, default=2,
                      help="nodes the workers are grouped into (hierarchical allreduce)")
    demo.add_argument("--values", type=A.positive, default=2_000_000,
                      help="float32 values per worker")
    demo.add_argument("--steps", type=A.positive, default=8,
                      help="tensors the values are split into")
    demo.add_argument("--backend", choices=["golden", "rtl"], default=None,
                      help="rtl: the switch's Verilator model (default; with --topology the "
                           "leaves' and spines'); golden: the Python model, no compiler needed")
    demo.add_argument("--pcap", default=None, help="write every switch frame to this file")
    demo.add_argument("--paths", type=A.positive, default=1,
                      help="UDP source ports each worker sprays its packets over")
    demo.add_argument("--spray", choices=["round_robin", "least_loaded"], default="round_robin")
    demo.add_argument("--switch", type=A.switch_url, default=None,
                      help="udp://HOST:PORT of an existing switch (a board, sim board, sim "
                           "serve) instead of starting one")
    demo.add_argument("--bind", default=None,
                      help="local IPv4 addresses the nodes send from, comma-separated (node i "
                           "from the i-th, round robin); default: one per switch port reached")
    demo.add_argument("--topology", default=None,
                      help="LEAVESxSPINES (2x2, say): the workers over a simulated leaf and "
                           "spine fabric, their ranks in blocks over the leaves")
    demo.add_argument("--fabric", default=None,
                      help="a leaf and spine fabric's description (JSON file, as `sim serve "
                           "--topology --describe` writes it): worker processes over UDP, each "
                           "naming its leaf")
    demo.add_argument("--uplink-down-at", type=float, default=None,
                      help="with --topology: the share of the run (0.5: halfway) at which "
                           "every leaf's uplink to the last spine goes down")
    demo.add_argument("--json", action="store_true", help="print one JSON object")

    train = sub.add_parser("train", help="DDP training of a small CNN through gloo, netagg, "
                                         "and netagg with priority drop, side by side")
    train.add_argument("--workers", type=A.positive, default=4, help="torchrun processes")
    train.add_argument("--nodes", type=A.positive, default=2, help="torchrun agents (nodes)")
    train.add_argument("--epochs", type=A.positive, default=None, help="default 15; --cluster 3")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--loss-budget", type=float, default=0.05,
                       help="the drop run's share of each gradient's chunks sent droppable")
    train.add_argument("--runs", default="gloo,netagg,netagg_drop",
                       help="runs, comma-separated: gloo, netagg, netagg_drop")
    train.add_argument("--backend", choices=["golden", "rtl"], default="golden",
                       help="the simulated switch")
    train.add_argument("--plot", default=None, help="write the loss curves to this image")
    train.add_argument("--json", action="store_true", help="print one JSON object")
    train.add_argument("--cluster", action="store_true",
                       help="on an emulated cluster (needs root): a process per host, each "
                            "under its own torchrun agent, on shaped links")
    train.add_argument("--hosts", type=A.positive, default=4, help="cluster: hosts")
    train.add_argument("--topology", default=None,
                       help="cluster: LEAVESxSPINES, a leaf and spine fabric (--hosts-per-leaf "
                            "hosts a leaf) instead of one rack")
    train.add_argument("--hosts-per-leaf", type=A.positive, default=2,
                       help="cluster --topology: hosts a leaf")
    train.add_argument("--oversubscription", type=float, default=1.0,
                       help="cluster --topology: a leaf's host links' rate over its uplinks'")
    train.add_argument("--spray", action="store_true",
                       help="cluster --topology: spray netagg's packets over the spines")
    train.add_argument("--cross-traffic", action="store_true",
                       help="cluster --topology: another job's TCP flows and incast through "
                            "every run, the fabric honouring DSCP")
    train.add_argument("--rate", default="100mbit", help="cluster: each host link's rate")
    train.add_argument("--switch", choices=["fast", "golden"], default="fast",
                       help="cluster: netagg's switch on the rack")
    train.add_argument("--channels", type=A.positive, default=None,
                       help="the CNN's first convolution's channels (default 16; --cluster 64)")
    train.add_argument("--hidden", type=A.positive, default=None,
                       help="the CNN's hidden layer's width (default 128; --cluster 2048)")

    gpu = sub.add_parser("gpu-check", help="the torch backend's CUDA path on this machine's "
                                           "GPU: 2 processes on cuda:0 through a simulated "
                                           "switch, against the CPU path and gloo")
    gpu.add_argument("--values", type=A.positive, default=4 << 20,
                     help="float32 values of the staging's timed all_reduce")
    gpu.add_argument("--layouts", default="hierarchical,flat",
                     help="hierarchical (one torchrun agent of 2), flat (2 agents of 1)")
    gpu.add_argument("--timeout", type=float, default=420.0,
                     help="seconds for every layout together")
    gpu.add_argument("--json", action="store_true", help="print one JSON object")

    probe = sub.add_parser("probe", help="read a switch's parameters, addresses and counters")
    probe.add_argument("url", type=A.switch_url, help="udp://HOST:PORT")
    probe.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for it")
    probe.add_argument("--json", action="store_true", help="print one JSON object")

    sim = sub.add_parser("sim", help="the simulated switch")
    simsub = sim.add_subparsers(dest="sim_command", required=True)
    serve = simsub.add_parser("serve", help="serve a simulated switch on UDP")
    serve.add_argument("--backend", choices=["golden", "rtl", "echo", "fast"], default=None,
                       help="default rtl; golden with --topology; fast: the golden model "
                            "with its common contribution compiled")
    serve.add_argument("--host", default=None,
                       help="the switch's IPv4 address, UDP port 4791 (default: a free "
                            "127.x.y.z)")
    serve.add_argument("--pcap", default=None, help="write every frame in and out to this file "
                                                    "(with --topology: leaf0's)")
    serve.add_argument("--ports", type=A.positive, default=4, help="switch ports")
    serve.add_argument("--jobs", type=A.positive, default=4)
    serve.add_argument("--slots", type=A.positive, default=64, help="slots per version")
    serve.add_argument("--max-workers", type=A.positive, default=8)
    serve.add_argument("--topology", default=None,
                       help="LEAVESxSPINES (2x2, say): a leaf and spine fabric, one endpoint "
                            "per switch (golden); prints its description, JSON, first")
    serve.add_argument("--describe", default=None,
                       help="with --topology: also write the fabric's description (JSON) here")
    board = simsub.add_parser(
        "board", help="a board's top level in Verilator, its Ethernet ports on TAP devices")
    board.add_argument("--board", required=True, choices=BOARDS)
    board.add_argument("--netns", default=None,
                       help="run in this network namespace (created and deleted if new)")
    board.add_argument("--tap", default="nagg",
                       help="TAP device name prefix: port n is <prefix>n (default nagg)")
    fuzz = sub.add_parser("fuzz", help="differential fuzzing: the switch's RTL (or the fast "
                                       "switch) against its golden model on good and mutated "
                                       "frames")
    fuzz.add_argument("--frames", type=A.positive, default=10_000)
    fuzz.add_argument("--seed", type=int, default=0)
    fuzz.add_argument("--width", type=A.positive, default=64, help="bits per port")
    fuzz.add_argument("--minimise", action="store_true",
                      help="shrink the first difference to the fewest frames that show it")
    fuzz.add_argument("--json", action="store_true", help="print one JSON object")
    fuzz.add_argument("--spine", action="store_true",
                      help="a switch built as a spine against the golden spine, on leaves' "
                           "partials")
    fuzz.add_argument("--against", choices=["rtl", "fast"], default="rtl",
                      help="the switch held to the golden model: its RTL, or the fast switch "
                           "(sim/fast.py, a single switch)")
    fuzz.add_argument("--leaf", action="store_true",
                      help="a switch built with uplinks against the golden leaf, on its "
                           "local workers' traffic and a spine's (partials up, results and "
                           "pulls down)")
    from netagg.apps.scale.cli import add_parser as add_scale
    add_scale(sub)
    from netagg.apps.cluster import add_parser as add_cluster
    add_cluster(sub)
    from netagg.apps.prove import add_parser as add_prove
    add_prove(sub)
    args = parser.parse_args(argv)

    if args.command == "prove":
        from netagg.apps.prove import main as prove_main
        return prove_main(args)

    if args.command == "scale":
        from netagg.apps.scale.cli import main as scale_main
        return scale_main(args)
    if args.command == "cluster":
        from netagg.apps.cluster import main as cluster_main
        return cluster_main(args)
    if args.command == "bench" and args.what == "cluster":
        from netagg.apps import bench_cluster
        report = bench_cluster.bench_cluster(
            args.hosts, args.rate or "100mbit",
            args.sizes if args.sizes else
            bench_cluster.DEFAULT_SIZES, args.switch, args.repeat or 3, args.queue,
            quiet=args.json, dilation=args.dilation)
        if args.plot:
            bench_cluster.plot(report, args.plot)
        if args.json:
            print(json.dumps(report))
        return 0 if all(r[lib]["verified"] for r in report["runs"]
                        for lib in bench_cluster.LIBRARIES) else 1
    if args.command == "bench" and args.what == "fabric":
        from netagg.apps.bench_fabric import bench_fabric
        report = bench_fabric(args.topology, args.hosts_per_leaf, args.rate or "40mbit",
                              args.oversubscription, args.size or 8 << 20,
                              args.repeat or 5, quiet=args.json, steps=args.steps,
                              loss_budget=args.loss_budget)
        if args.json:
            print(json.dumps(report))
        return 0 if report["verified"] else 1
    if args.command == "bench" and args.what == "loss":
        from netagg.apps.bench_loss import bench_loss
        report = bench_loss([float(p) / 100 for p in args.losses.split(",")],
                            workers=args.workers or 4, values=args.values or 1_000_000,
                            repeat=args.repeat or 1, backend=args.switch, quiet=args.json)
        if args.json:
            print(json.dumps(report))
        return 0 if all(r[k]["verified"] for r in report["runs"]
                        for k in ("early", "timers")) else 1
    if args.command == "bench" and args.what == "failures":
        from netagg.apps.bench_failures import bench_failures
        report = bench_failures(args.backends.split(","), runs=args.repeat or 10,
                                quiet=args.json)
        if args.json:
            print(json.dumps(report))
        return 0 if all(s["right"] == s["named"] for s in report["scenarios"]) else 1
    if args.command == "demo" and args.fabric:
        from netagg.apps.demo_fabric import demo_described
        report = demo_described(args.fabric, workers=args.workers, values=args.values,
                                steps=args.steps, quiet=args.json)
        if args.json:
            print(json.dumps(report))
        return 0 if report["verified"] else 1
    if args.command == "demo" and args.topology:
        from netagg.apps.demo_fabric import demo_fabric
        report = demo_fabric(args.topology, workers=args.workers, values=args.values,
                             steps=args.steps, backend=args.backend or "rtl",
                             uplink_down_at=args.uplink_down_at, quiet=args.json)
        if args.json:
            print(json.dumps(report))
        return 0 if report["verified"] else 1
    if args.command == "demo":
        from netagg.apps.demo import demo as run_demo
        report = run_demo(workers=args.workers, nodes=args.nodes, values=args.values,
                          backend=args.backend or "rtl", steps=args.steps, as_json=args.json,
                          pcap=args.pcap, paths=args.paths, spray=args.spray,
                          switch=args.switch,
                          binds=args.bind.split(",") if args.bind else None)
        if args.json:
            print(json.dumps(report))
        return 0 if report["verified"] else 1
    if args.command == "train":
        from netagg.apps import torch_runs
        runs = {r.name: r for r in torch_runs.RUNS}
        chosen = args.runs.split(",")
        unknown = [r for r in chosen if r not in runs]
        if unknown:
            parser.error(f"unknown runs {', '.join(unknown)}: choose from {', '.join(runs)}")
        given = {k: getattr(args, k) for k in ("epochs", "channels", "hidden")
                 if getattr(args, k) is not None}
        if args.cluster:
            from netagg.apps import train_cluster
            report = train_cluster.train_cluster(
                hosts=args.hosts, rate=args.rate, switch=args.switch, seed=args.seed,
                loss_budget=args.loss_budget, runs=[runs[r] for r in chosen],
                fabric=None if args.topology is None else dict(
                    topology=args.topology, hosts_per_leaf=args.hosts_per_leaf,
                    oversubscription=args.oversubscription, spray=args.spray),
                cross_traffic=args.cross_traffic, quiet=args.json, **given)
            if args.plot:
                train_cluster.plot(report, args.plot)
            print(json.dumps(report) if args.json else train_cluster.summary(report))
            return 0
        report = torch_runs.train_runs(workers=args.workers, nodes=args.nodes,
                                       seed=args.seed, loss_budget=args.loss_budget,
                                       backend=args.backend, runs=[runs[r] for r in chosen],
                                       quiet=args.json, **given)
        if args.plot:
            torch_runs.plot(report, args.plot)
        print(json.dumps(report) if args.json else torch_runs.summary(report))
        return 0
    if args.command == "gpu-check":
        from netagg.apps import gpu_check
        layouts = args.layouts.split(",")
        unknown = [x for x in layouts if x not in gpu_check.LAYOUTS]
        if unknown:
            parser.error(f"unknown layouts {', '.join(unknown)}: choose from "
                         f"{', '.join(gpu_check.LAYOUTS)}")
        report = gpu_check.gpu_check(values=args.values, layouts=layouts,
                                     timeout=args.timeout, quiet=args.json)
        print(json.dumps(report) if args.json else gpu_check.summary(report))
        return 0 if report["verified"] else 2 if "error" in report else 1
    if args.command == "fuzz":
        from netagg.sim.fuzz import main as fuzz_main
        if args.against == "fast" and (args.spine or args.leaf):
            parser.error("--against fast is a single switch: no --spine or --leaf")
        return fuzz_main(args.frames, args.seed, args.json, args.width, args.minimise,
                         spine=args.spine, leaf=args.leaf, against=args.against)
    if args.command == "probe":
        from netagg.apps.probe import probe_main
        return probe_main(args.url, args.json, args.timeout)
    if args.command == "sim" and args.sim_command == "board":
        from netagg.sim.board import main as board_main
        return board_main(args.board, tap=args.tap, netns=args.netns)
    if args.command == "sim" and args.topology:
        from netagg.sim.topology_serve import serve_topology_main
        return serve_topology_main(args.topology, args.backend or "golden", args.pcap,
                                   args.describe, jobs=args.jobs, slots=args.slots,
                                   max_workers=args.max_workers)
    if args.command == "sim":
        from netagg.sim.serve import serve_main
        return serve_main(args.backend or "rtl", args.host, args.pcap, ports=args.ports,
                          jobs=args.jobs, slots=args.slots, max_workers=args.max_workers)
    if args.command == "bench" and args.what == "allreduce":
        from netagg.apps.demo import bench_allreduce
        if args.sizes:
            sizes = args.sizes
        else:
            sizes = [s for s in ALLREDUCE_SIZES
                     if s <= MAX_DEFAULT_SIZE.get(args.backend, s)]
        report = bench_allreduce(sizes, workers=args.workers or 4, backend=args.backend,
                                 transports=args.transports.split(","), quiet=args.json)
        if args.json:
            print(json.dumps(report))
        return 0
    if args.command == "bench" and args.what == "leafspine":
        from netagg.apps.bench_leafspine import bench_leafspine
        report = bench_leafspine(quiet=args.json)
        if args.json:
            print(json.dumps(report))
        return 0
    if args.command == "bench" and args.what == "host":
        from netagg.apps.bench_host import bench_host
        report = bench_host(args.sizes,
                            workers=args.workers or 4)
        if args.json:
            print(json.dumps(report))
        return 0
    if args.command == "bench" and args.what == "board":
        from netagg.apps.bench_board import bench_board
        report = bench_board(args.board, values=args.values or 200_000,
                             workers=args.workers or 4 if args.nodes else None,
                             nodes=args.nodes,
                             quiet=args.json)
        if args.json:
            print(json.dumps(report))
        return 0
    if args.command == "bench" and args.what == "congestion":
        from netagg.apps.congestion import bench_congestion
        report = bench_congestion(args.backend, [int(p) for p in args.paths.split(",")],
                                  workers=args.workers or 4, size=args.size or 1 << 20,
                                  spray=args.spray, repeat=args.repeat or 3, quiet=args.json,
                                  experiments=args.experiments.split(","),
                                  priority={"loss_budget": args.loss_budget,
                                            "steps": args.steps})
        if args.json:
            print(json.dumps(report))
        return 0
    if args.command == "bench" and args.what == "fast":
        from netagg.sim.bench_fast import bench_fast
        report = bench_fast(args.workers or 8, seconds=args.seconds, quiet=args.json)
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
    if args.command == "bench" and args.what == "switch":
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
    if args.command == "bench":
        from netagg.apps.bench_line_rate import bench_datapath
        widths = [int(w) for w in args.widths.split(",")]
        report = bench_datapath(widths, quiet=False)
        if args.json:
            print(json.dumps(report))
        else:
            print("\n".join(
                f"{w:>4} bits: {r['in_beats_per_cycle']:.3f} beats/cycle in, "
                f"{r['out_beats_per_cycle']:.3f} beats/cycle out, "
                f"{r['sim_cycles_per_second']:,.0f} simulated cycles/s"
                for w, r in report["widths"].items()))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    sys.exit(main())
