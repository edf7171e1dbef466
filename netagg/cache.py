"""Where netagg keeps what it builds (compiled C++ steps, Verilog, Verilator models), and the
lock under which one process builds a file while another that wants it waits."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    """`NETAGG_CACHE`, else `$XDG_CACHE_HOME/netagg`, else ``~/.cache/netagg`` (made)."""
    base = os.environ.get("NETAGG_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "netagg"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` for the block: while one process builds
    `path`, another that wants it waits, then finds it built."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
