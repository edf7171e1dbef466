"""Priority classes at a port of the emulated fabric: the DSCP a packet carries picks its
queue, as a network that honours DSCP does.

A classed port (`shape_port(..., classes=True)`) is an htb qdisc at the link's rate with two
classes, each with a FIFO of its own (pfifo, the port's `queue` bytes in full-size frames):

- **high** (`HIGH`, htb priority 0): IPv4 packets whose priority class (DSCP >> 3) is
  `HIGH_FROM` or more, and everything netagg's switch sends (its results carry the canonical
  IPv4 header, DSCP 0: the switch's port is trusted, as a fabric trusts a port by its role);
  guaranteed `HIGH_SHARE` of the rate, and first to borrow the rest;
- **low** (`LOW`, htb priority 1, the default): everything else (ordinary traffic, DSCP 0, and
  netagg's lower classes); guaranteed the rest of the rate, so it never starves, and it may
  borrow up to the whole rate when the high class leaves it idle.

Each class's queue is as deep as the port's: a packet the high class takes never
waits behind the low class's, and what arrives at a full queue is dropped there. The u32
filters match the IPv4 TOS byte's top bit (classes 4 to 7) and the source address. A port
without classes is one token bucket (tbf) with one queue, as `sim.cluster_links` describes.

Counters: `class_counters` gives each class's packets sent and dropped at a port (the htb
root counts the drops' sum, which `sim.cluster.link_counters` reads).
"""

from __future__ import annotations

import dataclasses
import ipaddress

from netagg.sim.cluster_links import Shape

HIGH, LOW = 0x10, 0x20          # the classes' minor numbers under htb's 1:
HIGH_FROM = 4                   # priority classes 4..7 are high: the TOS byte's top bit
HIGH_SHARE = 0.9                # of the rate, guaranteed to the high class
ETH_P_IP = 0x0800
FULL_FRAME = 1514               # a class's queue holds the port's bytes as full-size frames
_ROOT = 0x10000                 # htb's handle, 1:
_HIGH_TOS = "0x00800000/0x00800000+0"       # u32 key: TOS & 0x80 (DSCP >= 32)


def shape_port(ns, index: int, shape: Shape, classes: bool = False, trusted: str | None = None):
    """Shape device `index` of pyroute2 namespace `ns` to `shape`: one tbf, or (`classes`)
    the two priority classes, with `trusted` (an IPv4 address: netagg's switch) a source
    whose packets are high whatever their DSCP."""
    if not classes:
        ns.tc("add", "tbf", index=index, handle="1:", **shape.tc())
        return
    rate, burst = shape.rate // 8, shape.burst
    high = int(rate * HIGH_SHARE)
    ns.tc("add", "htb", index=index, handle=_ROOT, default=LOW)
    ns.tc("add-class", "htb", index=index, handle=_ROOT | 1, parent=_ROOT, rate=rate,
          ceil=rate, burst=burst, cburst=burst)
    for minor, guaranteed, prio in ((HIGH, high, 0), (LOW, rate - high, 1)):
        ns.tc("add-class", "htb", index=index, handle=_ROOT | minor, parent=_ROOT | 1,
              rate=guaranteed, ceil=rate, burst=burst, cburst=burst, prio=prio)
        ns.tc("add", "pfifo", index=index, handle=minor << 16, parent=_ROOT | minor,
              limit=max(2, shape.queue // FULL_FRAME))
    keys = [[_HIGH_TOS]]
    if trusted is not None:
        address = int(ipaddress.IPv4Address(trusted))
        keys.append([f"0x{address:08x}/0xffffffff+12"])         # the IPv4 source
    for prio, key in enumerate(keys, start=1):
        ns.tc("add-filter", "u32", index=index, parent=_ROOT, prio=prio, protocol=ETH_P_IP,
              target=_ROOT | HIGH, keys=key)


@dataclasses.dataclass(frozen=True)
class ClassCounters:
    """What one class's queue at a port sent and dropped."""

    packets: int = 0
    drops: int = 0


def class_counters(ns, index: int) -> dict[str, ClassCounters]:
    """Each class's counters at device `index` of `ns` (empty without classes)."""
    out = {}
    for q in ns.get_qdiscs(index=index):
        name = {HIGH: "high", LOW: "low"}.get(q["parent"] & 0xFFFF)
        if q.get_attr("TCA_KIND") != "pfifo" or name is None:
            continue
        stats = q.get_attr("TCA_STATS2")
        basic = stats.get_attr("TCA_STATS_BASIC") if stats else None
        queue = stats.get_attr("TCA_STATS_QUEUE") if stats else None
        out[name] = ClassCounters(basic["packets"] if basic else 0,
                                  queue["drops"] if queue else 0)
    return out
