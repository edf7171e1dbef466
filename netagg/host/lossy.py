"""A transport with faults, for tests and measurements: `LossyTransport` wraps another and
drops, duplicates and delays (reorders) packets in each direction, seeded."""

from __future__ import annotations

import heapq
import random
import time

from netagg.contract import wire as W
from netagg.host.control import CONTROL_LIFETIME
from netagg.host.transport import Transport


class LossyTransport(Transport):
    """Another transport with loss: each packet, in each direction, is dropped with `drop`,
    sent twice with `duplicate`, and held back by a random delay up to `max_delay` seconds
    with `reorder` (so packets behind it overtake it; below the control requests' lifetime,
    `host.control.CONTROL_LIFETIME`). Seeded: the same seed, the same faults.
    `path_delay`: packets sprayed over path i are held back `i * path_delay` seconds more
    (paths of different lengths, so that a message's packets arrive out of order)."""

    def __init__(self, inner: Transport, drop: float = 0.0, duplicate: float = 0.0,
                 reorder: float = 0.0, max_delay: float = 0.005, seed: int = 0,
                 path_delay: float = 0.0):
        super().__init__()
        if max_delay >= CONTROL_LIFETIME:
            raise ValueError(f"max_delay must be below the control requests' lifetime, "
                             f"{CONTROL_LIFETIME} s, not {max_delay}")
        self.inner = inner
        self.local, self.switch, self.switch_port = inner.local, inner.switch, inner.switch_port
        self.driver = inner.driver
        self.paths = inner.paths
        self.drop, self.duplicate, self.reorder, self.max_delay = drop, duplicate, reorder, \
            max_delay
        self.duplicates = duplicate > 0
        self.path_delay = path_delay
        self.rng = random.Random(seed)
        self._out, self._in = [], []           # heaps of (due, n, packet)
        self._n = 0
        self.faults = {"dropped": 0, "duplicated": 0, "delayed": 0}

    @property
    def result_source(self):
        return self.inner.result_source

    @result_source.setter
    def result_source(self, value):
        if hasattr(self, "inner"):
            self.inner.result_source = value

    def path_endpoints(self) -> list[W.Endpoint]:
        return self.inner.path_endpoints()

    def attach_switch(self, ports: int, port: int):
        self.inner.attach_switch(ports, port)
        self.switch_port = self.inner.switch_port

    def _fault(self, heap, pkt, now, extra: float = 0.0):
        if self.rng.random() < self.drop:
            self.faults["dropped"] += 1
            return
        copies = 1
        if self.rng.random() < self.duplicate:
            self.faults["duplicated"] += 1
            copies = 2
        for _ in range(copies):
            due = now + extra
            if self.rng.random() < self.reorder:
                self.faults["delayed"] += 1
                due += self.rng.uniform(0, self.max_delay)
            self._n += 1
            heapq.heappush(heap, (due, self._n, pkt))

    def _flush(self, now):
        while self._out and self._out[0][0] <= now:
            self.inner.send(*heapq.heappop(self._out)[2])

    def send(self, datagram: bytes, path: int = 0, dscp: int = 0):
        now = time.monotonic()
        self._fault(self._out, (datagram, path, dscp), now, path * self.path_delay)
        self._flush(now)

    def recv(self, timeout: float) -> list[bytes]:
        now = time.monotonic()
        self._flush(now)
        if self._in or self._out:
            nxt = min(h[0][0] for h in (self._in, self._out) if h)
            timeout = max(0.0, min(timeout, nxt - now))
        for pkt in self.inner.recv(timeout):
            self._fault(self._in, pkt, time.monotonic())
        now = time.monotonic()
        self._flush(now)
        out = []
        while self._in and self._in[0][0] <= now:
            out.append(heapq.heappop(self._in)[2])
        return out

    @property
    def bad(self):
        return getattr(self, "inner", None) and self.inner.bad or 0

    @bad.setter
    def bad(self, value):
        pass

    def close(self):
        self.inner.close()
