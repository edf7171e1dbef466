"""A shaped link of the emulated cluster: its rate, its queues, and what crossed it.

A host's NIC is one end of a veth pair; the switch's port is the other. Each end's egress
has a token bucket (tbf) at the link's rate, whose queue is a byte FIFO (bfifo): at the
switch's port `queue` bytes (a port's share of a switch's buffer), at the host's NIC
`NIC_QUEUE` (Linux's transmit queue of 1000 frames); what arrives at a full queue is
dropped. Shaping both ends makes the link a full-duplex wire of that rate, each direction
with a queue of its own. `burst` is the bucket's depth: the bytes that may leave back to back
at the veth's own speed after the link was idle (one kernel timer's worth); a packet larger
than it (a GSO or TSO buffer) is cut into its segments by tbf before it queues.

Rates and sizes are given as tc writes them: ``100mbit``, ``1gbit``, ``25mbit``, ``256kb``.
"""

from __future__ import annotations

import dataclasses
import re

# A host NIC's queue: Linux's default transmit queue of 1000 frames (txqueuelen), full-size.
NIC_QUEUE = 1000 * 1514
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_SIZE_UNITS = {"b": 1, "kb": 1024, "mb": 1024**2}
# Layer-2 bytes a datagram's frame adds (Ethernet header; tbf counts the frame without FCS).
ETHERNET_HEADER = 14


def parse_rate(text: str | int) -> int:
    """Bits per second of ``100mbit``, ``1gbit``, ``25mbit``, or a plain number."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?bit)?\s*", text.lower())
    if not m:
        raise ValueError(f"a rate is a number and a unit (bit, kbit, mbit, gbit), not {text!r}")
    return int(float(m.group(1)) * _RATE_UNITS[m.group(2) or "bit"])


def parse_size(text: str | int) -> int:
    """Bytes of ``256kb``, ``1mb``, or a plain number."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([km]?b)?\s*", text.lower())
    if not m:
        raise ValueError(f"a size is a number and a unit (b, kb, mb), not {text!r}")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2) or "b"]


def rate_text(bits: int) -> str:
    for unit in ("gbit", "mbit", "kbit"):
        if bits % _RATE_UNITS[unit] == 0:
            return f"{bits // _RATE_UNITS[unit]}{unit}"
    return f"{bits}bit"


@dataclasses.dataclass(frozen=True)
class Shape:
    """One direction of a link: `rate` bits per second, a queue of `queue` bytes, and a
    bucket of `burst` bytes."""

    rate: int
    queue: int
    burst: int

    def __post_init__(self):
        if self.rate < 64_000:
            raise ValueError(f"a link's rate is at least 64kbit, not {self.rate} bit/s")
        if self.burst < 1600:
            raise ValueError(f"a link's burst holds a full frame (1600 bytes), not {self.burst}")
        if self.queue < self.burst:
            raise ValueError(f"a link's queue ({self.queue} bytes) holds at least its burst "
                             f"({self.burst} bytes)")

    @classmethod
    def of(cls, rate: str | int, queue: str | int | None = None) -> Shape:
        """A link at `rate` with `queue` bytes of queue (default: 10 ms of the rate, at least
        64 KB: a switch port's share of its buffer, or a NIC's ring), and a bucket of 1 ms of
        the rate (at least two full frames)."""
        bits = parse_rate(rate)
        burst = max(3200, bits // 8 // 1000)
        depth = parse_size(queue) if queue is not None else max(64 << 10, bits // 8 // 100)
        return cls(bits, depth, burst)

    def with_queue(self, queue: int) -> Shape:
        return dataclasses.replace(self, queue=queue)

    def tc(self) -> dict:
        """The tbf qdisc's parameters, as `pyroute2`'s ``tc("add", "tbf", ...)`` takes them."""
        return {"rate": self.rate // 8, "burst": self.burst, "limit": self.queue}

    def seconds(self, frame_bytes: int) -> float:
        """How long `frame_bytes` of layer-2 frames take on the wire at this rate."""
        return frame_bytes * 8 / self.rate


@dataclasses.dataclass(frozen=True)
class Counters:
    """What crossed one host's NIC, from the kernel's counters of the interface."""

    tx_bytes: int = 0
    rx_bytes: int = 0
    tx_packets: int = 0
    rx_packets: int = 0
    drops: int = 0          # dropped by the queues of both ends of the link

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(dataclasses.astuple(self),
                                                dataclasses.astuple(other))))

    def utilisation(self, shape: Shape, seconds: float) -> tuple[float, float]:
        """(sent, received) as fractions of the link's rate over `seconds`."""
        capacity = shape.rate / 8 * seconds
        return self.tx_bytes / capacity, self.rx_bytes / capacity
