"""The `netagg` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench_datapath(widths, quiet: bool) -> dict:
    """Back-to-back RoCEv2 frames through one port's datapath (parser, queue, deparser) in
    Verilator, per width: beats per cycle in and out, and simulated cycles per second."""
    from rich.console import Console

    from sim.build import cocotb_runner

    console = Console(stderr=True, quiet=quiet)
    if str(ROOT) not in sys.path:   # the runner hands sys.path to the simulator's Python
        sys.path.insert(0, str(ROOT))
    results = {}
    for width in widths:
        with console.status(f"width {width}: building (cached after the first run) ..."):
            t0 = time.perf_counter()
            runner, build_dir = cocotb_runner("datapath", width=width)
            build_seconds = time.perf_counter() - t0
        with console.status(f"width {width}: streaming frames ..."), \
                tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            runner.test(
                test_module="tests.cocotb_datapath", hdl_toplevel="top", testcase="line_rate",
                build_dir=build_dir, test_dir=tmp,
                extra_env={"PYTHONPATH": str(ROOT), "NETAGG_WIDTH": str(width),
                           "NETAGG_BENCH_OUT": str(out)},
                log_file=Path(tmp) / "sim.log",
            )
            if not out.exists():
                log = (Path(tmp) / "sim.log").read_text(errors="replace")[-3000:]
                raise SystemExit(f"the line-rate run at width {width} failed:\n{log}")
            result = json.loads(out.read_text())
        result["build_seconds"] = round(build_seconds, 1)
        results[str(width)] = result
        console.print(
            f"width {width:3}: {result['in_beats_per_cycle']:.3f} beats/cycle in, "
            f"{result['out_beats_per_cycle']:.3f} out, "
            f"{result['sim_cycles_per_second']:,.0f} simulated cycles/s")
    return {"bench": "datapath", "widths": results}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="netagg", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark and print its figures")
    bench.add_argument("what", choices=["datapath"])
    bench.add_argument("--widths", default="64,128,256,512",
                       help="datapath widths in bits, comma-separated")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    if args.command == "bench":
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
