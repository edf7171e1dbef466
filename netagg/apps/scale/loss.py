"""Loss and congestion: the mean and tail of a synchronisation when packets are lost, on a
lossy link or at an incast-bound port, with and without netagg's priority drop and bounded
loss (docs/host.md, "Credits, priority drop and bounded loss").

A synchronisation of M packets ends when the last of them got through. A packet lost is sent
again after a timeout that doubles per retry up to `rto_max` (netagg/host/retransmit.py), so a
synchronisation that needed r retries of its unluckiest packet takes
T = T_sync + sum_{i<r} min(rto 2^i, rto_max). With independent losses of probability f per
try, P(r <= x) = prod over packet classes (1 - f_c^(x+1))^(M_c): the mean wait is
sum_x P(r > x) min(rto 2^x, rto_max), the p99 the wait of the smallest x with
P(r <= x) >= 0.99. Resent packets add their share to T_sync.

What a synchronisation waits timeouts for, a loss rate p on the path:
- plain (every scheme; in-network aggregation without a loss budget): each of its M packets,
  f = p;
- bounded loss (in-network aggregation with loss budget b and quorum N - A, A = ceil(b N)):
  a slot closes once N - A contributions are in; the missing ones are rescaled (droppable
  chunks) or refilled in the slot's next use, without a timeout. A chunk waits a timeout
  only when more than A of its N contributions were lost: f = P(Binomial(N, p) > A);
- priority drop as well: an overloaded port takes droppable payloads first and forwards
  their headers (null contributions: no timeout), so congestion loss up to b lands there; a
  droppable chunk with more than A nulls is refilled in its next use. What congestion is
  left, max(0, p_c - b) / (1 - b), and random loss drop whole packets, as above. On a
  randomly lossy link (no congestion) priority drop changes nothing.
Packets sent again (refills, retries) add their share to T_sync.

Congestion: a port offered `overload` times its capacity without deep buffers drops
1 - 1/overload of its packets. Incast-bound: F synchronised senders with W packets in flight
each into a port buffer of Q packets lose the share of a round's burst that does not fit:
p = max(0, 1 - (Q + W) / (F W)) (one window drains while the burst arrives).

Cost: a loop over retry counts, at most 64, and a binomial sum of N terms.
"""

from __future__ import annotations

import dataclasses
import math

from netagg.apps.scale.flow import Estimate, Scheme, iteration, packets


@dataclasses.dataclass(frozen=True)
class LossSetup:
    loss: float = 0.0               # loss rate on the path (random), or 0
    overload: float = 1.0           # offered load over capacity at the bottleneck port
    buffer_packets: int = 0         # incast: a switch port's buffer (0: deep, lossless)
    loss_budget: float = 0.1        # netagg's loss budget, when bounded loss is on
    rto_s: float = 0.2              # netagg/host/retransmit.py: rto_initial
    rto_max_s: float = 1.0


@dataclasses.dataclass(frozen=True)
class Tail:
    mode: str
    loss: float
    mean_sync_s: float
    p99_sync_s: float
    mean_iteration_s: float
    p99_iteration_s: float


@dataclasses.dataclass(frozen=True)
class PacketClass:
    count: float                    # packets (or chunks) whose loss delays the sync
    fail: float                     # probability a try does not get it through


def incast_loss(fan_in: int, window: int, buffer_packets: int) -> float:
    if buffer_packets <= 0 or fan_in <= 1:
        return 0.0
    return max(0.0, 1.0 - (buffer_packets + window) / (fan_in * window))


def binomial_tail(n: int, p: float, a: int) -> float:
    """P(Binomial(n, p) > a)."""
    if p <= 0:
        return 0.0
    return max(0.0, 1.0 - sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i)
                              for i in range(min(a, n) + 1)))


def classes(mode: str, random: float, congestion: float, total: int, chunks: int,
            workers: int, budget: float) -> tuple[list[PacketClass], float]:
    """What a synchronisation waits timeouts for, and the share of its packets sent again,
    from the random loss rate and the share of packets an overloaded port must drop."""
    either = 1 - (1 - random) * (1 - congestion)
    if mode == "plain" or budget <= 0:
        return [PacketClass(total, either)], either
    allowed = math.ceil(budget * workers)
    if mode == "bounded loss":
        return [PacketClass(chunks, binomial_tail(workers, either, allowed))], either
    # Priority drop: congestion takes droppable payloads (nulls, no timeout) first.
    nulls = min(1.0, congestion / budget)
    lost = 1 - (1 - random) * (1 - max(0.0, congestion - budget) / (1 - budget))
    refilled = budget * binomial_tail(workers, nulls, allowed) * nulls + (1 - budget) * lost
    return [PacketClass(chunks, binomial_tail(workers, lost, allowed))], refilled


def timeout(i: int, setup: LossSetup) -> float:
    """The i-th retry's timeout (0-based), doubled per retry up to rto_max."""
    return min(setup.rto_s * 2 ** i, setup.rto_max_s)


def wait(cls: list[PacketClass], setup: LossSetup, quantile: float | None) -> float:
    """Time spent waiting for timeouts: its mean (quantile None), or its quantile. The
    unluckiest packet needs more than x retries with probability 1 - P(r <= x), and each
    retry beyond x adds timeout(x)."""
    mean = spent = 0.0
    for x in range(64):
        done = math.prod((1 - c.fail ** (x + 1)) ** c.count for c in cls if c.count)
        if quantile is not None and done >= quantile:
            return spent
        mean += (1 - done) * timeout(x, setup)
        spent += timeout(x, setup)
        if 1 - done < 1e-12:
            break
    return mean if quantile is None else spent


def fan_in(e: Estimate, ps_servers: int, window: int) -> int:
    if e.scheme is Scheme.PS:
        return e.workers if ps_servers else e.workers - 1
    return 1                        # ring, tree, BML, aggregation: one sender a port


MODES = ("plain", "bounded loss", "priority drop + bounded loss")


def tails(e: Estimate, gradient_bytes: int, compute_s: float, overlap: bool,
          setup: LossSetup, ps_servers: int = 0, window: int = 128) -> list[Tail]:
    """The synchronisation's and iteration's mean and p99 per mode (modes other than plain
    only for in-network aggregation, whose switch has the loss budget)."""
    congestion = min(0.999, max(0.0, 1 - 1 / setup.overload)
                     + incast_loss(fan_in(e, ps_servers, window), window, setup.buffer_packets))
    p = 1 - (1 - setup.loss) * (1 - congestion)
    chunks = packets(gradient_bytes)
    total = chunks * e.workers
    if e.scheme in (Scheme.RING, Scheme.PS):
        total = 2 * chunks * e.workers             # reduce and gather each lose packets
    modes = MODES if e.scheme in (Scheme.INA, Scheme.INA_LEAF_SPINE,
                                  Scheme.HIERARCHICAL) else MODES[:1]
    out = []
    for mode in modes:
        cls, resent = classes(mode, setup.loss, congestion, total, chunks, e.workers,
                              setup.loss_budget)
        base = e.sync_s * (1 + resent)
        mean = base + wait(cls, setup, None)
        p99 = base + wait(cls, setup, 0.99)
        out.append(Tail(mode, p, mean, p99, iteration(compute_s, mean, overlap),
                        iteration(compute_s, p99, overlap)))
    return out
