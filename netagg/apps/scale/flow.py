"""The flow-level model: the time of one gradient synchronisation and of one iteration, per
scheme, from the bytes each scheme puts on its busiest link and the latency of its paths.

S is the gradient (bytes), N the workers, t = WIRE_BYTES * 8 / B one packet's time on a link
of B bit/s, m = ceil(bytes / PAYLOAD) packets, L(h) the one-way latency of an h-link path
(h propagations and serialisations, h - 1 forwardings). Every scheme sends packet by packet
and forwards a packet as soon as what it depends on arrived, so a scheme takes the longer of
its busiest link's packets back to back and its chain of dependent latencies:

- ring: 2(N-1) steps of S/N. T = max(2(N-1) m t, m t + (2N-3)(L + t)) + L, m = S/(N P):
  the bandwidth term is 2(N-1)/N * S/B in packets.
- tree (NCCL's double binary tree, pipelined): every node sends and receives 2S,
  T = 2 m t + 2 ceil(log2 N) (L + t), m = S/P.
- parameter server, push and pull pipelined packet by packet (full duplex): with a shard on
  every worker, a worker's link carries 2(N-1) m t, m = S/(N P); with P dedicated servers a
  server's link carries N m t in each direction, m = S/(P P_bytes), the N-to-P incast;
  T = that + 2 L(across), times the leaf uplinks' slowdown on leaf-spine.
- BML on BCube(n, k): the gradient in k parts, one per NIC, each reduced level by level in a
  rotated order then gathered back: a NIC sends (n-1)/n^(s+1) of S/k at stage s, 2k stages,
  T = sum over stages of (m_s t + L(2)) = 2(N-1)/N * S/(k B) in the limit.
- in-network aggregation on one switch: every worker sends S and gets S back through one
  switch, `window` slots in flight: a packet every max(t, t_switch, RTT / window),
  T = m * that + RTT, RTT = 2 L(1) + the RTL's latency and pipeline time.
- in-network aggregation on leaf and spine: leaves add their hosts', spines the leaves'
  partial sums (slots spread over the spines); T as on one switch with RTT over 4 links and
  two aggregations, the leaf's uplinks slowed by oversubscription unless packets are sprayed.
- hierarchical: reduce-scatter inside a node (G GPUs, intra bandwidth B_in), in-network
  aggregation of S across nodes through the node's NIC, all-gather inside the node:
  T = 2 (G-1)/G * S/B_in + T_ina(nodes).

With G GPUs a node sharing one NIC, the flat schemes put G workers' traffic on it (ring:
one flow in and out a node). Iteration: compute C split 1/3 forward, 2/3 backward; with
overlap T_iter = C/3 + max(2C/3, T_sync), else C + T_sync; scaling factor C / T_iter.
Utilisation: the gradient bytes the busiest link must carry over B * T_sync. Full
utilisation (Zhang et al. 2020's what-if): T_sync = those bytes / B, nothing else.

Cost: arithmetic per (scheme, cluster); no state.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from netagg.apps.scale import topology
from netagg.apps.scale.cluster import PAYLOAD, WIRE_BYTES, Cluster, Model, Topology


class Scheme(enum.Enum):
    RING = "ring"
    TREE = "tree"
    PS = "ps"
    BML = "bml"
    INA = "ina"
    INA_LEAF_SPINE = "ina-leaf-spine"
    HIERARCHICAL = "hierarchical"


@dataclasses.dataclass(frozen=True)
class Estimate:
    scheme: Scheme
    workers: int
    sync_s: float
    iteration_s: float
    scaling: float
    utilisation: float
    full_sync_s: float              # at full utilisation
    full_iteration_s: float
    full_scaling: float
    note: str = ""


def packets(nbytes: float) -> int:
    return math.ceil(nbytes / PAYLOAD)


@dataclasses.dataclass(frozen=True)
class Sync:
    """One scheme's synchronisation: its time, and the gradient bytes its busiest link carries
    at what rate (for utilisation and the full-utilisation what-if)."""

    seconds: float
    busiest_bytes: float
    busiest_gbps: float
    note: str = ""


def ring(c: Cluster, s: float) -> Sync:
    n = c.workers
    m = packets(s / n)
    t = max(c.packet_s, c.intra_packet_s) if c.gpus_per_node > 1 else c.packet_s
    lat = c.hop_s(topology.links_between_neighbours(c))
    seconds = max(2 * (n - 1) * m * t, m * t + (2 * n - 3) * (lat + t)) + lat
    rate = min(c.link_gbps, c.intra_gbps) if c.gpus_per_node > 1 else c.link_gbps
    return Sync(seconds, 2 * (n - 1) / n * s, rate)


def tree(c: Cluster, s: float) -> Sync:
    m = packets(s)
    lat = c.hop_s(topology.links_across(c))
    depth = math.ceil(math.log2(max(2, c.nodes)))
    return Sync(2 * m * c.packet_s + 2 * depth * (lat + c.packet_s), 2 * s, c.link_gbps)


def parameter_server(c: Cluster, s: float) -> Sync:
    n, g = c.workers, c.gpus_per_node
    lat = c.hop_s(topology.links_across(c))
    if c.ps_servers:
        p = c.ps_servers
        m = packets(s / p)
        load = max(n, p * g) * m            # a server's link, or a node's NIC
        note = f"{p} server(s): {n}-to-{p} incast"
    else:
        m = packets(s / n)
        load = g * 2 * (n - 1) * m * (n - g) / max(1, n - 1) if g > 1 else 2 * (n - 1) * m
        note = f"a shard on every worker: {n - 1}-to-1 incast at each"
    ls = topology.LeafSpine.of(c)
    remote = 1.0 if c.ps_servers else 1.0 - 1.0 / ls.leaves
    flows = ls.hosts_per_leaf * (c.ps_servers or c.nodes - ls.hosts_per_leaf)
    slowdown = topology.uplink_slowdown(c, remote, flows_per_leaf=max(1, flows))
    seconds = load * c.packet_s * slowdown + 2 * lat
    return Sync(seconds, load * PAYLOAD, c.link_gbps, note)


def bcube_shape(c: Cluster) -> tuple[int, int]:
    """The cluster's BCube(n, k) if it holds its workers, else the smallest n with k levels
    that does."""
    n, k = c.bcube_n, c.bcube_k
    if n ** k >= c.nodes:
        return n, k
    return math.ceil(c.nodes ** (1 / k) - 1e-9), k


def bml(c: Cluster, s: float) -> Sync:
    n, k = bcube_shape(c)
    lat = c.hop_s(2)
    seconds = 0.0
    for stage in range(k):
        m = packets((n - 1) * s / (k * n ** (stage + 1)))
        seconds += 2 * (m * c.packet_s + lat)          # reduce, then gather
    servers = n ** k
    note = "" if servers == c.nodes else f"BCube({n},{k}) holds {servers} servers"
    return Sync(seconds, 2 * (servers - 1) / servers * s / k, c.link_gbps, note)


def _ina(c: Cluster, s: float, links: int, aggregations: int) -> Sync:
    """Through `aggregations` aggregating switches, `links` links a round trip."""
    m = packets(s) * c.gpus_per_node           # a node's GPUs share its NIC
    sw = c.switch
    rtt = links * (c.prop_us * 1e-6 + c.packet_s) + aggregations * (sw.latency_s + sw.packet_s)
    per_packet = max(c.packet_s, sw.packet_s, rtt / c.window)
    limits = []
    if sw.packet_s > c.packet_s:
        limits.append(f"switch port {sw.port_gbps:.0f} Gb/s < link")
    if rtt / c.window > max(c.packet_s, sw.packet_s):
        limits.append(f"window {c.window} < RTT / packet time")
    rate = min(c.link_gbps, sw.port_gbps)
    return Sync(m * per_packet + rtt, m * PAYLOAD, rate, "; ".join(limits))


def ina(c: Cluster, s: float) -> Sync:
    sync = _ina(c, s, 2, 1)
    if c.nodes > c.radix:
        note = "; ".join(x for x in (f"needs a {c.nodes}-port switch", sync.note) if x)
        return dataclasses.replace(sync, note=note)
    return sync


def ina_leaf_spine(c: Cluster, s: float) -> Sync:
    """A leaf sends one host's worth of partial sums up, slots spread over the spines: its
    uplinks, at the hosts' rate, never hold it back, sprayed or not."""
    ls = topology.LeafSpine.of(dataclasses.replace(c, topology=Topology.LEAF_SPINE))
    if ls.leaves == 1:
        return _ina(c, s, 2, 1)
    return _ina(c, s, 4, 2)


def hierarchical(c: Cluster, s: float) -> Sync:
    g = c.gpus_per_node
    flat = dataclasses.replace(c, workers=c.nodes, gpus_per_node=1)
    inter = ina(flat, s)
    if g == 1:
        return inter
    intra = 2 * (g - 1) * packets(s / g) * c.intra_packet_s + 2 * (g - 1) * c.prop_us * 1e-6
    return Sync(intra + inter.seconds, inter.busiest_bytes, inter.busiest_gbps, inter.note)


SCHEMES = {
    Scheme.RING: ring, Scheme.TREE: tree, Scheme.PS: parameter_server, Scheme.BML: bml,
    Scheme.INA: ina, Scheme.INA_LEAF_SPINE: ina_leaf_spine, Scheme.HIERARCHICAL: hierarchical,
}


def iteration(compute_s: float, sync_s: float, overlap: bool) -> float:
    if overlap:
        return compute_s / 3 + max(2 * compute_s / 3, sync_s)
    return compute_s + sync_s


def estimate(scheme: Scheme, cluster: Cluster, model: Model) -> Estimate:
    """One scheme on one cluster: synchronisation, iteration, scaling, utilisation and the
    same at full utilisation."""
    if scheme is Scheme.BML:
        cluster = dataclasses.replace(cluster, topology=Topology.BCUBE)
    sync = SCHEMES[scheme](cluster, model.gradient_bytes)
    full = sync.busiest_bytes * 8 / (sync.busiest_gbps * 1e9)
    it = iteration(model.compute_s, sync.seconds, cluster.overlap)
    full_it = iteration(model.compute_s, full, cluster.overlap)
    utilisation = full / sync.seconds
    return Estimate(scheme, cluster.workers, sync.seconds, it, model.compute_s / it,
                    utilisation, full, full_it, model.compute_s / full_it, sync.note)


def goodput_share() -> float:
    return PAYLOAD / WIRE_BYTES
