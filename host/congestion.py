"""`netagg bench congestion`: the host under congestion, one section per experiment.

- `spraying`: goodput of a float32 allreduce with every worker spraying its packets over 1, 2
  and 4 paths (UDP source ports; in `netagg sim serve` each enters the switch port
  `switch_port_for(ip, port, ports)`), worker processes over UDP against the simulated switch
  (`SimServer` in this process), `repeat` runs per path count, interleaved. Per path count:
  median goodput and time, each run's goodput, retransmissions and packets, packets per path
  and contributions the switch took on each port (its rx counters, read through the control
  path, less the control requests) in the last run, and whether every result is bit for bit
  the first run's.

Still to come (issue 5): `priority_drop`, allreduce completion time (median, 99th
percentile) under congestion with priority drop on and off.
"""

from __future__ import annotations

from host.demo import run_workers


def _port_contributions(ctl) -> list[int]:
    ports = ctl.counters(jobs=[])["ports"]
    return [ports[p]["rx"] - ports[p]["control"] for p in sorted(ports)]


def bench_spraying(server, paths_list=(1, 2, 4), workers: int = 4, values: int = 1 << 18,
                   spray: str = "round_robin", repeat: int = 3, console=None,
                   timeout: float = 60.0) -> dict:
    """Allreduce of `values` float32 per worker over `server`, `repeat` times per path count
    (the path counts interleaved, so that a machine's changing load falls on all alike)."""
    import statistics

    from host import SwitchControl

    ctl = SwitchControl(server.url)
    out = {"policy": spray, "workers": workers, "tensor_bytes": values * 4, "repeat": repeat,
           "paths": {}}
    runs = {paths: [] for paths in paths_list}
    reference = None
    try:
        for _ in range(repeat):
            for paths in paths_list:
                before = _port_contributions(ctl)
                r = run_workers(server.url, workers=workers, nodes=workers, values=values,
                                steps=1, seed=1, verify=True, timeout=timeout, paths=paths,
                                spray=spray)
                if r["errors"] or not r["verified"]:
                    raise SystemExit(f"the allreduce sprayed over {paths} paths failed: "
                                     f"{r['errors'] or 'results not verified'}")
                after = _port_contributions(ctl)
                reference = reference or r["digest"]
                r["switch_port_contributions"] = [a - b for a, b in zip(after, before)]
                r["same"] = r["digest"] == reference
                runs[paths].append(r)
                if console is not None:
                    console.print(
                        f"spraying over {paths} path{'s' if paths > 1 else ' '} ({spray}): "
                        f"{r['goodput_MBps']:8.3f} MB/s per worker ({r['seconds']:.3f} s), "
                        f"{r['retransmissions']} retransmissions, contributions per switch "
                        f"port {r['switch_port_contributions']}")
    finally:
        ctl.close()
    for paths, rs in runs.items():
        out["paths"][str(paths)] = {
            "goodput_MBps": statistics.median(r["goodput_MBps"] for r in rs),
            "seconds": statistics.median(r["seconds"] for r in rs),
            "goodput_MBps_runs": [r["goodput_MBps"] for r in rs],
            "retransmissions_runs": [r["retransmissions"] for r in rs],
            "packets_runs": [r["packets_sent"] for r in rs],
            "packets_per_path": rs[-1]["packets_sent_per_path"],
            "switch_port_contributions": rs[-1]["switch_port_contributions"],
            "same_result_as_first": all(r["same"] for r in rs),
        }
    return out


def bench_congestion(backend: str = "golden", paths_list=(1, 2, 4), workers: int = 4,
                     size: int = 1 << 20, spray: str = "round_robin", repeat: int = 3,
                     quiet: bool = False) -> dict:
    from rich.console import Console

    from host.serve import SimServer, make_backend

    console = Console(stderr=True, quiet=quiet)
    with console.status(f"starting the {backend} switch"):
        switch = make_backend(backend)
    report = {"bench": "congestion", "backend": backend}
    with SimServer(switch, "127.0.0.1", 0).start() as server:
        report["switch_ports"] = server.ports
        report["spraying"] = bench_spraying(server, paths_list, workers, max(1, size // 4),
                                            spray, repeat, console)
    if not quiet:
        for paths, row in report["spraying"]["paths"].items():
            print(f"{paths} path{'s' if paths != '1' else ' '}: {row['goodput_MBps']:8.3f} MB/s "
                  f"per worker (median of {repeat}), retransmissions "
                  f"{row['retransmissions_runs']}, contributions per switch port (last run) "
                  f"{row['switch_port_contributions']}")
    return report
