"""A Verilator model of a top and its C++ cycle loop, built into one cached shared library.

    library = build_library("board", harness, board="colorlight_5a75b")
    lib = ctypes.CDLL(str(library))

A `Harness` is the C++ that clocks the model (sources in ``netagg/sim/cpp/``) and a header writer:
a function that reads the verilated top's ports (name -> ("IN" or "OUT", bits)), checks them
against what the harness drives and returns the text of the header the harness includes
(named by ``Harness.header_name``), or raises `ContractError`. `sim.model` (frame ports,
``harness.cpp``) and `sim.board` (GMII ports and TAP devices, ``board.cpp``) each have one.

Build: `build_library` turns a harness into a `sim.build.Program` (position-independent, linked
as a shared library; -O2 for the model's evaluation code and the harness, the speed being the
point, -O0 for its run-once initialisation code, most of the compile time of a large design,
-Os for Verilator's runtime, little of which runs per cycle) and builds it with
`sim.build.verilate`, the one Verilator build: its cache (``<cache_dir>/builds/``, keyed by
the design, the parameters, the harness's sources and ABI number and the build's arguments),
its lock and its cache of Verilator's runtime objects. A build takes a few seconds (a small
top) to about half a minute (the switch, a board) on two cores; a cached one is found in well
under a second.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import build

HARNESS_DIR = Path(__file__).resolve().parent / "cpp"
LIBRARY = "libnetagg_model.so"

Signals = dict[str, tuple[str, int]]


class ContractError(ValueError):
    """The top does not have the ports the harness drives."""


@dataclass(frozen=True)
class Harness:
    """The C++ cycle loop of a model: `sources` (files of netagg/sim/cpp), `header` (writes the
    text of `header_name` from the top's ports and its name, checking them), and `abi`, part
    of every model's key: bump it when what `header` writes or the harness expects of it
    changes. Its builds are named after its first source."""
    sources: tuple[str, ...]
    header: Callable[[Signals, str], str]
    abi: int
    header_name: str = "netagg_ports.h"

    def program(self) -> build.Program:
        """The shared library that `sim.build.verilate` builds for this harness."""
        return build.Program(
            name=Path(self.sources[0]).stem, output=LIBRARY,
            cpp=tuple(str(HARNESS_DIR / name) for name in self.sources),
            args=("-CFLAGS", "-fPIC", "-LDFLAGS", "-shared"),
            make=("OPT_FAST=-O2", "OPT_SLOW=-O0", "OPT_GLOBAL=-Os"),
            prepare=self._write_header, version=self.abi)

    def _write_header(self, build_dir: Path, top: str) -> None:
        text = self.header(signals(build_dir / "Vtop.h"), top)
        (build_dir / self.header_name).write_text(text)


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
    return build.verilate(top, harness.program(), **params) / LIBRARY


def build_seconds(library: Path) -> float | None:
    """How long the build of `library` took, from its build record (None if unknown)."""
    return build.build_seconds(library.parent)


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
