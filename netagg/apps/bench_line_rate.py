"""`netagg bench datapath` and `netagg bench switch`: the RTL at line rate in Verilator. Each
builds its top (cached) and runs the cocotb testcase `line_rate` of `sim.bench_datapath` or
`sim.bench_switch` in it, which writes its figures as JSON, and returns them with the build
time."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from netagg.sim.build import cocotb_runner


def cocotb_run(top: str, module: str, params: dict, env: dict, console, what: str,
               testcase: str = "line_rate") -> dict:
    """Build `top` with `params` (cached) and run the cocotb testcase `testcase` of
    `module`, which writes its figures as JSON; return them with the build time."""
    with console.status(f"{what}: building (cached after the first run) ..."):
        t0 = time.perf_counter()
        runner, build_dir = cocotb_runner(top, **params)
        build_seconds = time.perf_counter() - t0
    with console.status(f"{what}: streaming frames ..."), tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        runner.test(
            test_module=module, hdl_toplevel="top", testcase=testcase,
            build_dir=build_dir, test_dir=tmp, extra_env={"NETAGG_BENCH_OUT": str(out), **env},
            log_file=Path(tmp) / "sim.log",
        )
        if not out.exists():
            log = (Path(tmp) / "sim.log").read_text(errors="replace")[-3000:]
            raise SystemExit(f"the {testcase} run of {what} failed:\n{log}")
        result = json.loads(out.read_text())
    result["build_seconds"] = round(build_seconds, 1)
    return result


def bench_datapath(widths, quiet: bool) -> dict:
    """Back-to-back RoCEv2 frames through one port's datapath (parser, queue, deparser) in
    Verilator, per width: beats per cycle in and out, and simulated cycles per second."""
    from rich.console import Console

    console = Console(stderr=True, quiet=quiet)
    results = {}
    for width in widths:
        result = cocotb_run("datapath", "netagg.sim.bench_datapath", {"width": width},
                                {"NETAGG_WIDTH": str(width)}, console, f"width {width}")
        results[str(width)] = result
        console.print(
            f"width {width:3}: {result['in_beats_per_cycle']:.3f} beats/cycle in, "
            f"{result['out_beats_per_cycle']:.3f} out, "
            f"{result['sim_cycles_per_second']:,.0f} simulated cycles/s")
    return {"bench": "datapath", "widths": results}


def bench_switch(ports: int, width: int, rounds: int, quiet: bool) -> dict:
    """Contributions of 1024-byte payloads back to back on every port of the switch in
    Verilator: input beats per cycle per port, latency from a slot's last contribution to its
    first result beat, and simulated cycles per second."""
    from rich.console import Console

    console = Console(stderr=True, quiet=quiet)
    params = {"ports": ports, "width": width, "jobs": 1, "max_workers": ports, "slots": 16}
    env = {"NETAGG_SWITCH": json.dumps(params), "NETAGG_ROUNDS": str(rounds),
           "NETAGG_WIDTH": str(width)}
    result = cocotb_run("switch", "netagg.sim.bench_switch", params, env, console,
                            f"{ports} x {width} bits")
    return {"bench": "switch", **result}
