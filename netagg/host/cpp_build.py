"""Building and loading the project's compiled C++ (`netagg/host/cpp/step.cpp`,
`netagg/sim/cpp/fast.cpp`).

`CompiledLibrary(source, header_name, header, where, bind=...)` is one such library: built
and loaded at its first use (`get`), None where it cannot be (`unavailable` says why), its
functions' ctypes signatures set by `bind`.

`build_and_load(source, header_name, header, where, flags, includes)` compiles `source` with
the machine's C++ compiler (CXX, or c++ on PATH), with its generated ABI header written
beside it as `header_name` and the headers `includes` from their folders, into the build cache
(`netagg.cache.cache_dir()` / `where`, named by a hash of the source, its includes, the
header, the compiler's version and flags and the machine's CPU),
under the cache's lock (`netagg.cache.locked`), and loads it with ctypes (which releases the
GIL for each call). It raises `Unavailable` with the reason where it cannot: no compiler, a
failed build or load (NETAGG_COMPILED=0 is `CompiledLibrary.get`'s to check, before it tries).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from netagg.cache import cache_dir, locked

CRC_SLICED = Path(__file__).resolve().parent / "cpp" / "crc_sliced.h"   # both libraries'
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno"]


class Unavailable(RuntimeError):
    """The compiled library cannot be had here; the message says why."""


def enabled() -> bool:
    return os.environ.get("NETAGG_COMPILED", "1") != "0"


@functools.cache
def _compiler() -> tuple[str, str] | None:
    path = shutil.which(os.environ.get("CXX", "c++"))
    if path is None:
        return None
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return path, version


def _cpu() -> str:
    """The CPU model and flags (the build is for this machine's instruction set)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") or line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


class CompiledLibrary:
    """The library of `source` with its generated ABI header (`header()`, written as
    `header_name`), in the cache's `where` folder; `bind(lib)` sets its functions'
    signatures once it is loaded."""

    def __init__(self, source: Path, header_name: str, header: Callable[[], str], where: str,
                 bind: Callable[[ctypes.CDLL], None], flags: list[str] = FLAGS,
                 includes: list[Path] = ()):
        self.source, self.header_name, self.header, self.where = source, header_name, header, where
        self.bind, self.flags, self.includes = bind, flags, includes
        self.reason: str | None = None
        self.loaded: ctypes.CDLL | None = None
        self.tried = False

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, built if need be; None where it cannot be (`unavailable`)."""
        if not enabled():
            self.reason = "NETAGG_COMPILED=0"
            return None
        if not self.tried:
            self.tried = True
            try:
                self.loaded = build_and_load(self.source, self.header_name, self.header(),
                                             self.where, self.flags, self.includes)
            except Unavailable as e:
                self.reason = str(e)
            else:
                self.reason = None
                self.bind(self.loaded)
        return self.loaded

    def unavailable(self) -> str | None:
        """Why `get()` is None (None when it is not)."""
        self.get()
        return self.reason

    def forget(self):
        """Look again at the next `get` (the compiler or the environment changed)."""
        self.loaded, self.tried = None, False
        _compiler.cache_clear()


def build_and_load(source: Path, header_name: str, header: str, where: str,
                   flags: list[str] = FLAGS, includes: list[Path] = ()) -> ctypes.CDLL:
    """The library of `source` (which may include `includes`, from their folders), built into
    the cache's `where` folder if need be."""
    compiler = _compiler()
    if compiler is None:
        raise Unavailable("no C++ compiler")
    key = hashlib.sha256(b"\0".join([
        source.read_bytes(), *(p.read_bytes() for p in includes), header.encode(),
        compiler[0].encode(), compiler[1].encode(),
        " ".join(flags).encode(), platform.machine().encode(), _cpu().encode()])).hexdigest()
    try:
        out = cache_dir() / where / f"{source.stem}-{key[:16]}.so"
        if not out.exists():
            with locked(out):
                if not out.exists():
                    _build(compiler[0], source, header_name, header, flags, includes, out)
        return ctypes.CDLL(str(out))
    except (OSError, RuntimeError) as e:
        raise Unavailable(f"{source.parent.parent.name}/cpp/{source.name} did not build or "
                          f"load: {e}") from None


def _build(compiler: str, source: Path, header_name: str, header: str, flags: list[str],
           includes: list[Path], out: Path):
    work = out.with_name(f"{out.stem}.{os.getpid()}.d")
    work.mkdir(parents=True, exist_ok=True)
    (work / header_name).write_text(header)
    tmp = work / out.name
    folders = dict.fromkeys([work, source.parent, *(p.parent for p in includes)])
    result = subprocess.run([compiler, *flags, *(f"-I{f}" for f in folders), str(source),
                             "-o", str(tmp)],
                            capture_output=True, text=True)
    if result.returncode:
        shutil.rmtree(work, ignore_errors=True)
        raise RuntimeError(result.stderr[-2000:])
    tmp.replace(out)
    shutil.rmtree(work, ignore_errors=True)


@functools.cache
def crc32_address() -> int:
    """The address of zlib-ng's CRC-32 (the one `netagg.contract.wire.crc32` is, with carry-less
    multiply), 0 if it cannot be found (the C++ then uses its own, sliced by 8)."""
    try:
        import zlib_ng.zlib_ng as z

        return ctypes.cast(ctypes.CDLL(z.__file__).zng_crc32, ctypes.c_void_p).value or 0
    except (ImportError, OSError, AttributeError):
        return 0
