"""A congested link in front of a switch: the place where priority drop matters.

`Bottleneck(switch, rate=..., capacity=...)` is a switch backend (`send`/`advance`/`busy`,
as `SimServer` drives them) that puts every frame through one FIFO of `capacity` bytes
drained at `rate` bytes per second of wall-clock time, before the switch applies it, the way
a switch port's ingress queue fills when more arrives than it drains:

- a contribution the switch's own rule (`GoldenSwitch.drops_payload`, with the thresholds the
  host configured as on a board) drops with the bytes queued ahead of it loses its payload:
  it goes on as a null contribution (`receive(..., null=True)`)
  and takes only its headers' room (`NULL_BYTES`) in the queue;
- any other frame that does not fit is dropped at the tail and counted (`tail_drops`): the
  sender's retransmission timeout recovers it.

Cross traffic (`burst` bytes every `period` seconds) shares the queue and the rate without
going to the switch, so that a steady allreduce meets queues it did not build itself.
Counters: `stats` (frames in, nulled, tail drops, cross-traffic bytes dropped).
"""

from __future__ import annotations

import collections
import time

NULL_BYTES = 70       # Ethernet + IPv4 + UDP + BTH + RETH + ImmDt + ICRC of a contribution


class Bottleneck:
    def __init__(self, switch, *, rate: float, capacity: int, burst: int = 0,
                 period: float = 0.0, clock=time.monotonic):
        if rate <= 0 or capacity <= 0:
            raise ValueError("the bottleneck needs a positive rate and capacity")
        self.switch, self.rate, self.capacity = switch, float(rate), capacity
        self.burst, self.period, self.clock = burst, period, clock
        self.ports = switch.ports
        self.queue = collections.deque()      # (departure time, port, frame, null)
        self.free_at = 0.0                    # when the link has sent everything queued
        self.next_burst = clock() + period if burst and period else float("inf")
        self.stats = collections.Counter()

    # --- the backend interface ----------------------------------------------------------

    def send(self, port: int, frame: bytes):
        now = self.clock()
        self._cross_traffic(now)
        ahead = self._queued(now)
        null = self.switch.drops_payload(frame, int(ahead))
        size = NULL_BYTES if null else len(frame)
        self.stats["frames_in"] += 1
        if ahead + size > self.capacity:
            self.stats["tail_drops"] += 1
            return
        self.stats["nulled"] += null
        self.free_at = max(self.free_at, now) + size / self.rate
        self.queue.append((self.free_at, port, bytes(frame), null))

    def advance(self) -> list:
        """The switch's output for every frame the link has delivered by now."""
        now = self.clock()
        self._cross_traffic(now)
        out = []
        while self.queue and self.queue[0][0] <= now:
            _, port, frame, null = self.queue.popleft()
            if frame:
                out += self.switch.receive(port, frame, null=null)
        return out

    def run(self) -> list:
        return self.advance()

    @property
    def busy(self) -> bool:
        return bool(self.queue)

    def __getattr__(self, name):
        # Registers, counters and parameters are the switch's.
        return getattr(self.switch, name)

    # --- the queue ----------------------------------------------------------------------

    def _queued(self, now: float) -> float:
        return max(0.0, self.free_at - now) * self.rate

    def _cross_traffic(self, now: float):
        while now >= self.next_burst:
            ahead = self._queued(self.next_burst)
            room = max(0, min(self.burst, self.capacity - int(ahead)))
            self.stats["cross_bytes_dropped"] += self.burst - room
            if room:
                self.free_at = max(self.free_at, self.next_burst) + room / self.rate
                self.queue.append((self.free_at, 0, b"", False))
            self.next_burst += self.period
