"""torch Work objects and futures for netagg allreduces, completed by one thread per group.

torch's collectives return a `Work` at once and DDP's reducer waits on its future (its comm
hooks return futures); a netagg allreduce is a `host.worker.Handle` that only completes when
someone waits on it. `Completer` is that someone: a thread that takes the group's allreduces
in the order they were started, waits for each (a bounded wait: the worker's own timeout
turns a missing peer or switch into an error), runs its `finish` (copying results into the
tensors) and sets its `torch.futures.Future`, or sets the error, prefixed with the rank and
the job (`where`), so that `Work.wait()`, `Future.wait()` and DDP raise it in the caller: a
`NetaggError` keeps its class (`NetaggRankGone`, `NetaggSwitchGone`...) and its fields,
any other error becomes a `NetaggError`.

A flat worker's allreduce of host tensors is started by the caller (`allreduce_async` sends
at once and the worker's progress thread completes it while the caller computes; later ones
are sent meanwhile). A hierarchical worker's steps share the node's memory one at a time, so
the thread starts those itself (`start`), after the previous one: every call on such a
worker happens on this one thread. The thread also runs the staging of CUDA tensors
(`host.torch_staging`: each chunk's allreduce starts once its copy is on the host). Every
rank must start the group's allreduces in the same order, so the caller starts one only
when none submitted before it is still waiting for the thread to start it; else the
thread starts it, after those.

Cost: one thread per process group, idle on its queue when nothing is pending. Callbacks
chained on the futures (DDP's, `Future.then`) run on this thread; a host allreduce submitted
behind a staged one waits for the thread to start it.
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import threading
from typing import Callable

import torch
import torch.distributed as dist

from netagg.host.errors import NetaggError

CLOSE_WAIT = 10.0       # seconds `close` waits for the thread to finish what is queued


@dataclasses.dataclass
class Pending:
    """One allreduce: its handle (flat: started by the caller) or how to start it, what to
    do with the handle's result, and the future that gets the outcome."""

    future: torch.futures.Future
    finish: Callable[[object], object]
    handle: object = None
    start: Callable[[], object] | None = None
    # sets the future's value (a CUDA future: on the stream its tensors were written on)
    complete: Callable[[torch.futures.Future, object], None] | None = None


class Done:
    """A handle whose result is there already (a staged allreduce's, `host.torch_staging`)."""

    def __init__(self, value):
        self.value = value

    def wait(self, timeout: float | None = None):
        return self.value


class Completer:
    def __init__(self, where: str, timeout: float):
        self.where, self.timeout = where, timeout
        self._queue: queue.Queue[Pending | None] = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self._unstarted = 0         # submitted, for the thread to start
        self._thread = threading.Thread(target=self._run, name="netagg-completer", daemon=True)
        self._thread.start()

    def submit(self, pending: Pending, now: bool = False) -> torch.futures.Future:
        """Queue `pending`; with `now`, the caller starts it here unless an allreduce
        submitted before it is still to be started by the thread."""
        with self._lock:
            if self._closed:
                raise NetaggError(f"{self.where}: the process group is shut down")
            if now and self._unstarted == 0:
                pending.handle, pending.start = pending.start(), None
            elif pending.start is not None:
                self._unstarted += 1
            self._queue.put(pending)
        return pending.future

    def _run(self):
        while (p := self._queue.get()) is not None:
            try:
                if p.start is None:
                    handle = p.handle
                else:
                    try:
                        handle = p.start()
                    finally:
                        with self._lock:
                            self._unstarted -= 1
                value = p.finish(handle.wait(self.timeout))
            except BaseException as e:      # the caller's wait raises it
                p.future.set_exception(located(e, self.where))
            else:
                (p.complete or type(p.future).set_result)(p.future, value)

    def close(self):
        """Finish what is queued (each wait is bounded), then stop."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._queue.put(None)
        self._thread.join(CLOSE_WAIT + self.timeout)


def located(e: BaseException, where: str) -> NetaggError:
    """`e` as the caller's wait raises it: its message prefixed with `where` and its class's
    name; a `NetaggError` of the same class and fields, anything else a `NetaggError`."""
    message = f"{where}: {type(e).__name__}: {e}"
    if isinstance(e, NetaggError):
        error = copy.copy(e)
        error.args = (message,)
    else:
        error = NetaggError(message)
    error.__cause__ = e
    return error


class NetaggWork(dist.Work):
    """A collective's Work: done when its future is; `wait` raises the allreduce's error."""

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future
