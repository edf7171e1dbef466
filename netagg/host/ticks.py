"""The deadlines' clock of a simulated switch, kept by the wall clock.

A board ticks its switch every `netagg.contract.regmap.TICK_SECONDS` of its core clock; a simulated
switch (the golden model, the RTL) has no time of its own, so whoever drives it (`sim serve`, the
in-process transport) applies the ticks the wall clock says are due, after the frames it
handed over (`WallClock.catch_up`). Ages count modulo 2**DEADLINE_BITS ticks, so after a long
idle time only the ticks due modulo that are applied: the same clock, at a bounded cost. A
backend without a `tick` has no deadlines.

Cost: one clock read a call; per tick, one call of the backend's (one cycle of the RTL).
"""

from __future__ import annotations

import time

from netagg.contract import regmap as R


class WallClock:
    def __init__(self, backend):
        self._tick = getattr(backend, "tick", None)
        self._started, self._ticks = time.monotonic(), 0

    def catch_up(self) -> list[tuple[int, bytes]]:
        """Apply the ticks due since the last call; the frames the backend sent meanwhile."""
        if self._tick is None:
            return []
        due = int((time.monotonic() - self._started) / R.TICK_SECONDS)
        out = []
        for _ in range((due - self._ticks) % (1 << R.DEADLINE_BITS)):
            out += self._tick() or []
        self._ticks = due
        return out
