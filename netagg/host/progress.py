"""Background progress: a thread that drives one worker's engine while it has work, so that
`allreduce_async` sends at once and the allreduce completes while the caller computes.

The engine is only ever touched under `lock`: the thread holds it for one `Engine.step`
(which waits for the socket at most `POLL` seconds), the caller for a submission or a look
at the counters. Waiters do not take it: they sleep on `finished` (a condition of its own),
which the thread notifies after a step that finished a work or failed, and look at the
works' `done` flags (set under the lock once their results are written), so a finished
allreduce, or the engine's failure (`Engine.failed`: a timeout naming what is missing, or
any error a step raised), reaches them within a step, and a wait never interrupts a
compiled run. The thread idles on an event while the engine has nothing to do, and
stops with `stop()`. While the worker is open it also keeps the engine's heartbeat
(`host.liveness`): a step when a beat is due, even without work, and after a failure the
beat alone (the process is there: the other ranks must not take it for gone).

While a step runs the window's compiled steps (`host.compiled`: C++ that releases the GIL,
for up to a quarter of a second), a caller's Python runs on; while a caller waits for the
lock (to submit, or to read the counters) the compiled run returns at its next step
(`ProgressLock`, `wanted`), so that the caller gets the lock within a step, not at the end
of the run.

Used for workers whose transport has no driver of its own (UDP); in-process workers keep
being driven cooperatively from `wait`.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref

import numpy as np

POLL = 0.002            # seconds the thread waits for the socket per step
SWITCH_SECONDS = 0.0001     # the interpreter's switch interval while there is work
LOOK = 0.25             # a waiter looks again this often unless notified


class _SwitchInterval:
    """The interpreter's thread switch interval, `SWITCH_SECONDS` while a progress thread
    has work, the program's own otherwise. A thread that wants the GIL waits up to that
    interval for a thread running Python to let it go: the progress thread wants it back
    each time a compiled run returns, and a caller computing in Python would otherwise hold
    the network idle for 5 ms (Python's default) each time. Each of the thread's returns to
    Python costs it up to the interval (0.1 ms: at 0.5 ms, an 8 MiB allreduce beside a
    Python loop lost about a third more of its time); the caller's loop is interrupted only
    while the thread wants the GIL, which it does not while a compiled run goes on."""

    def __init__(self):
        self.lock = threading.Lock()
        self.busy: set = set()
        self.saved = None

    def enter(self, progress):
        if progress in self.busy:
            return
        with self.lock:
            if not self.busy:
                self.saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self.saved, SWITCH_SECONDS))
            self.busy.add(progress)

    def leave(self, progress):
        if progress not in self.busy:
            return
        with self.lock:
            self.busy.discard(progress)
            if not self.busy and self.saved is not None:
                sys.setswitchinterval(self.saved)
                self.saved = None


_SWITCH = _SwitchInterval()


_WANTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WANTED_LOCK = threading.Lock()


def wanted(engine) -> np.ndarray:
    """How many threads wait for `engine`'s lock: one int64 that a compiled run reads
    between its steps (`host.compiled`), returning while it is not 0."""
    with _WANTED_LOCK:
        cell = _WANTED.get(engine)
        if cell is None:
            cell = _WANTED[engine] = np.zeros(1, np.int64)
        return cell


class ProgressLock:
    """A lock whose `acquire`, while it would block, has the holder's compiled run return
    (`wanted`)."""

    def __init__(self, engine):
        self._lock = threading.Lock()
        self._wanted = wanted(engine)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            return True
        if not blocking:
            return False
        with _WANTED_LOCK:
            self._wanted[0] += 1
        try:
            return self._lock.acquire(True, timeout)
        finally:
            with _WANTED_LOCK:
                self._wanted[0] -= 1

    def release(self):
        self._lock.release()

    def let_waiters_in(self, seconds: float = 0.002):
        """Give a thread that waits for the lock (it was just released) the time to take
        it, before taking it again: a plain lock is not fair, and the stepping thread would
        take it back before the waiter wakes, step after step."""
        deadline = time.monotonic() + seconds
        while self._wanted[0] and time.monotonic() < deadline:
            time.sleep(0)

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


class Progress:
    def __init__(self, engine):
        self.engine = engine
        self.lock = ProgressLock(engine)
        self.finished = threading.Condition()
        self._work = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="netagg-progress", daemon=True)
        self._thread.start()

    def kick(self):
        """There is work: step now rather than at the next idle check (the switch interval
        short from now on, so that the thread wakes while the caller computes)."""
        _SWITCH.enter(self)
        self._work.set()

    def _run(self):
        live = self.engine.liveness
        while not self._stopped:
            if self.engine.failed:
                with self.lock:
                    live.keep_beating()
            if not (self.engine.busy() or live.beat_due(time.monotonic())) \
                    or self.engine.failed:
                _SWITCH.leave(self)
                self._work.wait(0.05)
                self._work.clear()
                continue
            if self.engine.busy():
                _SWITCH.enter(self)
            self.lock.let_waiters_in()
            with self.lock:
                pending = self.engine.pending_works
                try:
                    self.engine.step(POLL)
                except Exception as e:  # raised to the waiters (a NetaggError is kept
                    if self.engine.failed is None:      # by the engine itself)
                        self.engine.failed = e
                changed = self.engine.pending_works != pending or self.engine.failed
            if changed:
                with self.finished:
                    self.finished.notify_all()

    def wait_for(self, ready, timeout: float | None) -> bool:
        """Wait until `ready()` (called without the engine's lock: it reads flags the
        thread sets under it, before it notifies `finished`) or the engine failed; False if
        `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.finished:
            while not ready() and not self.engine.failed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.finished.wait(LOOK if left is None else min(left, LOOK))
        return True

    def stop(self):
        _SWITCH.leave(self)
        self._stopped = True
        self._work.set()
        self._thread.join(5)
