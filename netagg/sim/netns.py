"""Network namespaces: entering one, running a program in one, and what runs in one.

A named namespace is the bind mount ``/run/netns/NAME`` that ``ip netns add`` and
`pyroute2.netns.create` make. A process joins one with setns(2) (`enter`); a program runs in
one as ``python -m netagg.sim.netns NAME PROGRAM ARGS...`` (`command` builds that line), which
joins the namespace and replaces itself with the program, so the program's pid is the one
its parent holds and its signals reach it. `pids` lists the processes whose network namespace
is a named one, by the namespace file's inode, as ``ip netns pids`` does; `kill_all` ends them.

Joining a namespace needs CAP_SYS_ADMIN (root): without it `enter` raises `PermissionError`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import time
from pathlib import Path

RUN_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000


def path(name: str) -> Path:
    return RUN_DIR / name


def enter(name: str) -> None:
    """Move this process (this thread, and every process it starts) into namespace `name`."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fd = os.open(path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise PermissionError(err, f"joining network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def command(name: str, argv: list[str]) -> list[str]:
    """The command line that runs `argv` in namespace `name`."""
    return [sys.executable, "-m", "netagg.sim.netns", name, *argv]


def _inode(p: Path) -> int | None:
    try:
        return os.stat(p).st_ino
    except OSError:
        return None


def pids(name: str) -> list[int]:
    """The processes in namespace `name` (none when it does not exist)."""
    inode = _inode(path(name))
    if inode is None:
        return []
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _inode(entry / "ns" / "net") == inode:
            found.append(int(entry.name))
    return found


def kill_all(names: list[str], grace: float = 2.0) -> int:
    """End every process in the namespaces `names`: SIGTERM, then SIGKILL after `grace`
    seconds for those still there. Returns how many there were."""
    targets = {pid for name in names for pid in pids(name)} - {os.getpid()}
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p) for p in targets):
            time.sleep(0.02)
    return len(targets)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m netagg.sim.netns NAMESPACE PROGRAM [ARGS...]")
    try:
        enter(argv[0])
    except FileNotFoundError:
        sys.exit(f"no network namespace {argv[0]} (is the cluster up?)")
    except PermissionError as e:
        sys.exit(f"{e.strerror}: joining a network namespace needs root")
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
