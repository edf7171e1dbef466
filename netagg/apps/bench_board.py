"""`netagg bench board`: the demo through a board's own RTL on the wire, beside the same demo
through `netagg sim serve`'s RTL, in one run.

The board runs as `netagg sim board` (its top level in Verilator behind TAP devices) in a
network namespace this benchmark makes for itself, and the demo (`netagg demo --switch`) in
that namespace too, its nodes spread over the board's ports; every datagram goes through
the kernel's IPv4 and UDP, the TAPs, the board's MACs (GMII, FCS) and its switch. Then the
same demo, same sizes, runs against `netagg sim serve --backend rtl` with the board's
switch parameters (its ports, jobs, slots and payload size; the ICRC in the ports instead
of the MACs) on loopback. Reported per run: goodput per worker (tensor bytes / time),
seconds, packets and retransmissions, and whether the result was verified; and the ratio of
the two goodputs. Needs root (TAP devices, a network namespace).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from netagg.apps.demo import demo

# Demo shapes that put a worker on each of a board's two ports: the Versa's one job of four
# workers takes a node leader each, the Colorlight's two workers are flat.
SHAPES = {"versa_ecp5_5g": (4, 2), "colorlight_5a75b": (2, 2)}
KEYS = ("goodput_MBps", "seconds", "packets_sent", "retransmissions", "verified",
        "port_contributions", "errors")


def _board_demo(board: str, workers: int, nodes: int, values: int, steps: int,
                timeout: float) -> dict:
    from netagg.sim import tap

    netns = f"netagg-bench-{os.getpid()}"
    tap.create_netns(netns)
    inside = ["ip", "netns", "exec", netns, sys.executable, "-m", "netagg.apps.cli"]
    proc = subprocess.Popen([*inside, "sim", "board", "--board", board],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        url = proc.stdout.readline().strip()
        if not url.startswith("udp://"):
            raise SystemExit(f"netagg bench board: netagg sim board --board {board} did not "
                             f"start (exit {proc.wait()})")
        run = subprocess.run([*inside, "demo", "--switch", url, "--workers", str(workers),
                              "--nodes", str(nodes), "--values", str(values), "--steps",
                              str(steps), "--json"], capture_output=True, text=True,
                             timeout=timeout + 300)
        if run.returncode not in (0, 1) or not run.stdout.strip():
            raise SystemExit(f"netagg bench board: the demo against {url} failed:\n"
                             f"{run.stderr[-2000:]}")
        report = json.loads(run.stdout)
        report["url"] = url
        return report
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        tap.delete_netns(netns)


def bench_board(board: str = "versa_ecp5_5g", values: int = 200_000, steps: int = 4,
                workers: int | None = None, nodes: int | None = None, timeout: float = 300.0,
                quiet: bool = False) -> dict:
    from rich.console import Console

    from netagg.bitstreams import target

    if os.geteuid() != 0:
        raise SystemExit("netagg bench board: TAP devices and a network namespace need root")
    console = Console(stderr=True, quiet=quiet)
    t = target(board)
    workers = workers or SHAPES[board][0]
    nodes = nodes or SHAPES[board][1]
    with console.status(f"{board} on TAP devices (sim board): {workers} workers in {nodes} "
                        "nodes ..."):
        on_board = _board_demo(board, workers, nodes, values, steps, timeout)
    params = {k: v for k, v in t.switch.items()
              if k in ("jobs", "max_workers", "slots", "max_payload")}
    with console.status("the same demo through sim serve --backend rtl ..."):
        served = demo(workers=workers, nodes=nodes, values=values, backend="rtl", steps=steps,
                      as_json=True, timeout=timeout, switch_params={"ports": len(t.ports),
                                                                    **params})
    report = {"bench": "board", "board": board, "workers": workers, "nodes": nodes,
              "values": values, "steps": steps, "switch": {"ports": len(t.ports), **params},
              "sim_board": {k: on_board.get(k) for k in KEYS},
              "sim_serve_rtl": {k: served.get(k) for k in KEYS}}
    a, b = on_board["goodput_MBps"], served["goodput_MBps"]
    report["board_over_serve"] = round(a / b, 3) if b else None
    for name in ("sim_board", "sim_serve_rtl"):
        r = report[name]
        console.print(f"{name:14} {r['goodput_MBps']:8.3f} MB/s per worker, {r['seconds']:.2f} s,"
                      f" {r['packets_sent']:,} packets, {r['retransmissions']:,} retransmitted, "
                      f"per port {r['port_contributions']}, verified {r['verified']}")
    console.print(f"board / serve: {report['board_over_serve']}")
    return report
