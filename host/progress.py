"""Background progress: a thread that drives one worker's engine while it has work, so that
`allreduce_async` sends at once and the allreduce completes while the caller computes.

The engine is only ever touched under `lock`: the thread holds it for one `Engine.step`
(which waits for the socket at most `POLL` seconds), the caller for a submission or a look
at the counters. Waiters sleep on `changed`, which the thread notifies after a step that
finished a work or failed, so a finished allreduce, or the engine's failure
(`Engine.failed`: a timeout naming what is missing, or any error a step raised), reaches
them within a step. The thread idles on an event while the engine has nothing to do, and
stops with `stop()`. While the worker is open it also keeps the engine's heartbeat
(`host.liveness`): a step when a beat is due, even without work, and after a failure the
beat alone (the process is there: the other ranks must not take it for gone).

Used for workers whose transport has no driver of its own (UDP); in-process workers keep
being driven cooperatively from `wait`.
"""

from __future__ import annotations

import threading
import time

POLL = 0.002            # seconds the thread waits for the socket per step


class Progress:
    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self._work = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="netagg-progress", daemon=True)
        self._thread.start()

    def kick(self):
        """There is work: step now rather than at the next idle check."""
        self._work.set()

    def _run(self):
        live = self.engine.liveness
        while not self._stopped:
            if self.engine.failed:
                with self.lock:
                    live.keep_beating()
            if not (self.engine.busy() or live.beat_due(time.monotonic())) \
                    or self.engine.failed:
                self._work.wait(0.05)
                self._work.clear()
                continue
            with self.lock:
                pending = self.engine.pending_works
                try:
                    self.engine.step(POLL)
                except Exception as e:  # raised to the waiters (a NetaggError is kept
                    if self.engine.failed is None:      # by the engine itself)
                        self.engine.failed = e
                if self.engine.pending_works != pending or self.engine.failed:
                    self.changed.notify_all()

    def wait_for(self, ready, timeout: float | None) -> bool:
        """Wait until `ready()` (called under the lock) or the engine failed; False if
        `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while not ready() and not self.engine.failed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.changed.wait(0.05 if left is None else min(left, 0.05))
        return True

    def stop(self):
        self._stopped = True
        self._work.set()
        self._thread.join(5)
