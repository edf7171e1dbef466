"""Shared memory between the local workers of one node, for the hierarchical allreduce.

Two segments per node and session (names `netagg_<session hash>_<node>_c` and `..._d<gen>`):

- control: per local worker an int64 epoch (the barrier), the epoch of a step it failed in,
  and its process id. A worker arrives by writing its own epoch (one writer per word, so no
  atomic operation is needed), and waits until every epoch has reached its own. A worker
  whose step failed (its allreduce raised) says so as it arrives, and the others then raise
  `NetaggError` naming it instead of taking a result it did not complete. Waiting polls; it
  raises at once for a local worker whose process is gone (no longer there, or a zombie),
  and gives up with `NetaggTimeout` after `timeout` seconds naming the local workers that
  did not arrive.
- data: the local workers' inputs (one region each) and the result, for one step. It grows
  (a new generation, the same decision on every local worker since all see the same tensor
  sizes) when a step needs more.

Local worker 0 creates and finally unlinks both; the others attach, waiting for them to exist.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from netagg.host.errors import NetaggError, NetaggTimeout

# The creator owns a segment: an attaching worker must not register it with the resource
# tracker (which would unlink it at exit, or complain when the creator unlinks it). Attaching
# turns registration off for a moment; the lock keeps that moment from overlapping another
# thread's creation (workers of one process: a test's, or a node's in threads).
_TRACKER = threading.Lock()


def _attach(name: str, timeout: float) -> shared_memory.SharedMemory:
    deadline = time.monotonic() + timeout
    while True:
        with _TRACKER:
            register = resource_tracker.register
            resource_tracker.register = lambda *args, **kwargs: None
            try:
                return shared_memory.SharedMemory(name=name)
            except (FileNotFoundError, ValueError):   # not there yet, or not yet sized
                pass
            finally:
                resource_tracker.register = register
        if time.monotonic() > deadline:
            raise NetaggTimeout(f"shared memory {name} was not created by local worker 0 "
                                f"within {timeout:.1f} s")
        time.sleep(0.005)


def _create(name: str, size: int) -> shared_memory.SharedMemory:
    with _TRACKER:
        try:
            old = shared_memory.SharedMemory(name=name)
            old.close()
            old.unlink()            # left by a run that crashed with the same session
        except FileNotFoundError:
            pass
        return shared_memory.SharedMemory(name=name, create=True, size=size)


def _alive(pid: int) -> bool:
    """Whether process `pid` (0: not known yet) is there and not a zombie."""
    if pid <= 0 or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class Region:
    def __init__(self, buf, local_size: int, capacity: int):
        self.buf, self.local_size, self.capacity = buf, local_size, capacity

    def _view(self, index: int, offset: int, like: np.ndarray) -> np.ndarray:
        start = index * self.capacity + offset
        return np.ndarray(like.size, like.dtype, buffer=self.buf, offset=start)

    def input(self, local_rank: int, offset: int, like: np.ndarray) -> np.ndarray:
        return self._view(local_rank, offset, like)

    def result(self, offset: int, like: np.ndarray) -> np.ndarray:
        return self._view(self.local_size, offset, like)


class NodeShm:
    def __init__(self, session, node: int, local_rank: int, local_size: int,
                 timeout: float = 20.0, job: int = 0):
        self.prefix = f"netagg_{zlib.crc32(str(session).encode()):08x}_{node}"
        self.local_rank, self.local_size, self.timeout = local_rank, local_size, timeout
        self.node, self.job = node, job
        size = 3 * 8 * local_size
        name = self.prefix + "_c"
        self.ctl = _create(name, size) if local_rank == 0 else _attach(name, timeout)
        words = np.ndarray(3 * local_size, np.int64, buffer=self.ctl.buf)
        self.epochs, self.failed, self.pids = words.reshape(3, local_size)
        self.pids[local_rank] = os.getpid()
        self.epoch = 0
        self.data = None
        self.gen = 0
        self.capacity = 0

    def region(self, nbytes: int) -> Region:
        """The data segment for a step of `nbytes` per local worker."""
        if nbytes > self.capacity:
            self.capacity = max(nbytes, 2 * self.capacity, 1 << 16)
            self.gen += 1
            name = f"{self.prefix}_d{self.gen}"
            old = self.data
            if self.local_rank == 0:
                self.data = _create(name, self.capacity * (self.local_size + 1))
                if old is not None:
                    old.unlink()
            else:
                self.data = _attach(name, self.timeout)
            if old is not None:
                self._close(old)
        return Region(self.data.buf, self.local_size, self.capacity)

    @staticmethod
    def _close(shm):
        try:
            shm.close()
        except BufferError:     # numpy views still alive: the mapping goes with them
            pass

    def arrive(self, failed: bool = False):
        """This worker is at the next step (`failed`: its allreduce raised)."""
        self.epoch += 1
        if failed:
            self.failed[self.local_rank] = self.epoch
        self.epochs[self.local_rank] = self.epoch

    def wait_all(self):
        deadline = time.monotonic() + self.timeout
        spins, look = 0, time.monotonic()
        while True:
            behind = np.flatnonzero(self.epochs < self.epoch)
            if behind.size == 0:
                failed = np.flatnonzero(self.failed == self.epoch).tolist()
                if failed:
                    raise NetaggError(
                        f"ranks {self._ranks(failed)} of job {self.job} (local workers "
                        f"{failed} of node {self.node}) failed in step {self.epoch} (their "
                        f"own errors say why): the node's result is incomplete")
                return
            if time.monotonic() > look:
                look = time.monotonic() + 0.05
                gone = [int(i) for i in behind if not _alive(int(self.pids[i]))]
                if gone:
                    raise NetaggError(
                        f"ranks {self._ranks(gone)} of job {self.job} (local workers {gone} "
                        f"of node {self.node}) are gone: their processes ended before step "
                        f"{self.epoch}")
            if time.monotonic() > deadline:
                raise NetaggTimeout(
                    f"ranks {self._ranks(behind.tolist())} of job {self.job} (local workers "
                    f"{behind.tolist()} of node {self.node}) did not reach step {self.epoch} "
                    f"within {self.timeout:.1f} s")
            spins += 1
            time.sleep(0 if spins < 100 else 0.0002)

    def _ranks(self, local: list[int]) -> list[int]:
        """The world ranks of local workers of this node."""
        return [self.node * self.local_size + int(i) for i in local]

    def close(self):
        self.epochs = None
        for shm in (self.data, self.ctl):
            if shm is None:
                continue
            self._close(shm)
            if self.local_rank == 0:
                try:
                    shm.unlink()
                except FileNotFoundError:
                    pass
