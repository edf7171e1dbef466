"""Building and loading the project's compiled C++ (`netagg/host/cpp/step.cpp`,
`netagg/sim/cpp/fast.cpp`).

`build_and_load(source, header_name, header, flags, where, includes)` compiles `source` with
the machine's C++ compiler (CXX, or c++ on PATH), with its generated ABI header written
beside it as `header_name` and the headers `includes` from its folder, into the build cache
(`sim.toolchain.cache_dir()` / `where`, named by a hash of the source, its includes, the
header, the compiler's version and flags and the machine's CPU),
under the cache's lock (`sim.build.locked`), and loads it with ctypes (which releases the
GIL for each call). It raises `Unavailable` with the reason where it cannot: NETAGG_COMPILED=0,
no compiler, a failed build or load.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from netagg.cache import cache_dir, locked

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


def build_and_load(source: Path, header_name: str, header: str, where: str,
                   flags: list[str] = FLAGS, includes: list[Path] = ()) -> ctypes.CDLL:
    """The library of `source` (which may include `includes`, beside it), built into the
    cache's `where` folder if need be."""
    if not enabled():
        raise Unavailable("NETAGG_COMPILED=0")
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
                    _build(compiler[0], source, header_name, header, flags, out)
        return ctypes.CDLL(str(out))
    except (OSError, RuntimeError) as e:
        raise Unavailable(f"{source.parent.parent.name}/cpp/{source.name} did not build or "
                          f"load: {e}") from None


def _build(compiler: str, source: Path, header_name: str, header: str, flags: list[str],
           out: Path):
    work = out.with_name(f"{out.stem}.{os.getpid()}.d")
    work.mkdir(parents=True, exist_ok=True)
    (work / header_name).write_text(header)
    tmp = work / out.name
    result = subprocess.run([compiler, *flags, "-I", str(work), "-I", str(source.parent),
                             str(source), "-o", str(tmp)],
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
