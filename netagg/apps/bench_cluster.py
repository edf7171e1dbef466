"""`netagg bench cluster`: netagg against the ring on an emulated cluster where the wire is
the bottleneck.

For each number of hosts it makes a cluster (`sim.cluster`: hosts on links shaped to
`rate` both ways, a top-of-rack bridge, netagg's switch on the rack's port) and, per size,
runs `apps.cluster_allreduce` on every host, through torch's gloo (a ring over TCP through
the bridge) and then through netagg (`host.Worker` over UDP to the switch), on the same hosts
and links in the same run. Per size it reports:

- both times (the median over `repeat` allreduces, each the slowest rank's, from a barrier
  to its result) and their ratio, gloo's over netagg's;
- the ratio the bytes on the wire predict: a ring sends 2(N-1)/N x S of payload each way
  in TCP segments (`RING_FRAME` bytes of frame per `RING_PAYLOAD` of data), netagg S in
  packets of `numerics.LANES` values (`NETAGG_FRAME` bytes of frame each), so with every
  link busy the times are in the ratio of the frame bytes;
- each host link's utilisation both ways: the bytes its NIC sent and received during the
  run (the kernel's interface counters) per allreduce, over what the link carries in the
  median time; and the packets the links' queues dropped;
- the CPU time one allreduce costs: a host's own (the median round, the mean host), and, for
  netagg, the switch process's (its whole run over the allreduces in it), which carries the
  kernel's work for what it sends.

Every result is checked (netagg within the fixed-point bound, gloo against float64 sums).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from netagg.contract import wire as W
from netagg.host import numerics as N
from netagg.sim.cluster import Cluster
from netagg.sim.cluster_links import rate_text

LIBRARIES = ("gloo", "netagg")
DEFAULT_SIZES = (1 << 20, 8 << 20, 32 << 20)
# A TCP segment of a 1500-byte MTU with timestamps: 1448 bytes of data in a 1514-byte frame.
RING_PAYLOAD, RING_FRAME = 1448, 1514
# A netagg packet: LANES values and the check lane, in Ethernet, IPv4, UDP, BTH, RETH, ImmDt
# and the ICRC.
NETAGG_PAYLOAD = 4 * N.LANES
NETAGG_FRAME = W.ETH_LEN + W.IP_LEN + W.UDP_LEN + W.BTH_LEN + W.RETH_LEN + W.IMM_LEN + \
    W.MAX_PAYLOAD + W.ICRC_LEN
GLOO_PORT = 29500
# Time dilation by switch: the RTL in Verilator takes about 1,300 contributions a second on 2
# cores, so its links run 50 times slower than the rate named (2 Mb/s for 100 Mb/s).
DILATION = {"rtl": 50.0}


def predicted_ratio(hosts: int) -> float:
    """gloo's time over netagg's that the frame bytes each host sends predict."""
    ring = 2 * (hosts - 1) / hosts * RING_FRAME / RING_PAYLOAD
    return ring / (NETAGG_FRAME / NETAGG_PAYLOAD)


def run_hosts(cluster: Cluster, library: str, size: int, repeat: int, url: str | None,
              timeout: float, options: tuple[str, ...] = (),
              session: str | None = None) -> list[dict]:
    """`apps.cluster_allreduce` on every host (with `options`; netagg's in `session`,
    by default one named by the hosts and the size); each rank's report. A rank that fails
    ends the others and raises with what it said."""
    hosts = len(cluster.hosts)
    procs = []
    for h in cluster.hosts:
        argv = [sys.executable, "-m", "netagg.apps.cluster_allreduce", library, str(h.index),
                str(hosts), "--sizes", str(size), "--repeat", str(repeat),
                "--master", f"{cluster.hosts[0].ip}:{GLOO_PORT}", "--timeout", str(timeout)]
        if url:
            argv += ["--switch", url, "--session", session or f"bench-{hosts}-{size}"]
        argv += options
        procs.append(cluster.run(h.index, argv, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True))
    # the whole run: its allreduces at a quarter of the link's rate, and the start
    slowest = (repeat + 1) * 4 * 2 * size * 8 / cluster.shape.rate
    reports, deadline = [], time.monotonic() + timeout + 60 + slowest
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            out, err = "", "no result in time"
        if proc.returncode != 0:
            for p in procs:
                p.kill()
            tail = err.strip().splitlines()[-1:] or ["(nothing)"]
            raise RuntimeError(f"{library} rank {rank} on {cluster.hosts[rank].namespace} "
                               f"failed: {tail[0]}")
        reports.append(json.loads(out))
    return reports


def _cpu_seconds(pid: int | None) -> float:
    """The CPU time (user and system) process `pid` has used; 0 without one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except (OSError, TypeError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(cluster: Cluster, library: str, size: int, repeat: int, url: str | None,
             timeout: float) -> dict:
    """One library's allreduces of `size` bytes on every host: the median time (in the
    undilated time of a dilated cluster: measured / D), each round's, the CPU time a host
    and the switch spend on one, and what the links carried."""
    before, switch_before = cluster.counters(), _cpu_seconds(cluster.switch_pid)
    reports = run_hosts(cluster, library, size, repeat, url, timeout)
    moved = [a - b for a, b in zip(cluster.counters(), before)]
    switch_cpu = _cpu_seconds(cluster.switch_pid) - switch_before
    measured = [max(r["sizes"][0]["seconds"][i] for r in reports) for i in range(repeat)]
    host_cpu = [statistics.mean(r["sizes"][0]["cpu_seconds"][i] for r in reports)
                for i in range(repeat)]
    seconds = statistics.median(measured)
    runs = repeat + 1       # the checked allreduce and the timed ones (barriers are tiny)
    sent = [m.tx_bytes / runs for m in moved]
    received = [m.rx_bytes / runs for m in moved]
    capacity = cluster.shape.rate / 8 * seconds
    rounds = [t / cluster.dilation for t in measured]
    return {"seconds": seconds / cluster.dilation, "rounds": rounds,
            "verified": all(r["sizes"][0]["verified"] for r in reports),
            "retransmissions": sum(r["sizes"][0]["retransmissions"] for r in reports),
            # a host's own CPU in a timed allreduce (median of the rounds, mean of the
            # hosts); the switch's is its whole run's over the allreduces in it
            "host_cpu_seconds": round(statistics.median(host_cpu), 3),
            "switch_cpu_seconds": round(switch_cpu / runs, 3) if library == "netagg" else 0.0,
            "bytes_sent_per_host": statistics.mean(sent),
            "utilisation_sent": [round(s / capacity, 3) for s in sent],
            "utilisation_received": [round(r / capacity, 3) for r in received],
            "queue_drops": sum(m.drops for m in moved)}


def bench_cluster(hosts: list[int], rate: str = "100mbit", sizes=DEFAULT_SIZES,
                  switch: str = "fast", repeat: int = 3, queue=None, name: str = "naggbench",
                  quiet: bool = False, timeout: float = 120.0,
                  dilation: float | None = None) -> dict:
    """The benchmark; `dilation` slows the links (`sim.cluster.Cluster`) for a switch
    slower than the wire, by default `DILATION`'s for the switch."""
    from rich.progress import Progress
    dilation = DILATION.get(switch, 1.0) if dilation is None else dilation
    report = {"date": datetime.date.today().isoformat(),
              "machine": f"{os.cpu_count()} cores, {platform.machine()}, Linux "
                         f"{platform.release()}",
              "rate": rate, "switch": switch, "dilation": dilation, "repeat": repeat,
              "runs": []}
    steps = len(hosts) * len(sizes) * len(LIBRARIES)
    with Progress(disable=quiet, transient=True) as progress:
        task = progress.add_task("cluster", total=steps)
        for n in hosts:
            with Cluster(n, rate, queue, name, dilation) as cluster:
                report["link_rate"] = rate_text(cluster.shape.rate)
                report["queue_bytes"] = cluster.shape.queue
                url = cluster.serve(switch, max_workers=max(8, n))
                for size in sizes:
                    row = {"hosts": n, "bytes": size, "predicted": round(predicted_ratio(n), 3)}
                    for lib in LIBRARIES:
                        progress.update(task, description=f"{n} hosts, {size >> 20} MiB, {lib}")
                        row[lib] = _measure(cluster, lib, size, repeat,
                                            url if lib == "netagg" else None, timeout)
                        progress.advance(task)
                    row["ratio"] = round(row["gloo"]["seconds"] / row["netagg"]["seconds"], 3)
                    row["of_prediction"] = round(row["ratio"] / row["predicted"], 3)
                    report["runs"].append(row)
    if not quiet:
        print(summary(report))
    return report


def summary(report: dict) -> str:
    dilated = f" (dilated {report['dilation']:g}x: links at {report['link_rate']}, times " \
        "divided back)" if report["dilation"] != 1 else ""
    lines = [f"allreduce of float32 on an emulated cluster, links {report['rate']} each way"
             f"{dilated}, {report['switch']} switch ({report['date']}, {report['machine']})",
             "hosts     size     gloo   netagg  ratio  the bytes say  of it  "
             "link use up/down: netagg, gloo  CPU s: host gloo, host netagg, switch"]
    for r in report["runs"]:
        use = [f"{max(r[lib]['utilisation_sent']):.2f}/{max(r[lib]['utilisation_received']):.2f}"
               for lib in LIBRARIES[::-1]]
        checked = r["gloo"]["verified"] and r["netagg"]["verified"]
        lines.append(f"{r['hosts']:>5} {r['bytes'] >> 20:>4} MiB {r['gloo']['seconds']:>7.3f}s "
                     f"{r['netagg']['seconds']:>7.3f}s {r['ratio']:>6.2f} "
                     f"{r['predicted']:>14.2f} {r['of_prediction']:>6.2f}  "
                     f"{use[0]}, {use[1]}         "
                     f"{r['gloo']['host_cpu_seconds']:.2f}, {r['netagg']['host_cpu_seconds']:.2f}, "
                     f"{r['netagg']['switch_cpu_seconds']:.2f}"
                     + ("" if checked else "  RESULT WRONG"))
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for size in sorted({r["bytes"] for r in report["runs"]}):
        rows = [r for r in report["runs"] if r["bytes"] == size]
        hosts = [r["hosts"] for r in rows]
        for lib, style in (("gloo", "--"), ("netagg", "-")):
            ax.plot(hosts, [r[lib]["seconds"] for r in rows], style, marker="o",
                    label=f"{lib}, {size >> 20} MiB")
    ax.set_xlabel("hosts")
    ax.set_ylabel("allreduce time (s)")
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["hosts"] for r in report["runs"]}))
    ax.set_title(f"float32 allreduce, {report['rate']} links, {report['switch']} switch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
