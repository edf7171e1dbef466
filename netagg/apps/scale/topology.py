"""The topologies' shapes: switch counts, path lengths, and what a leaf's uplinks carry.

- Fat-Tree of n-port switches (Al-Fares et al.): n/2 hosts an edge switch, n/2 edge and n/2
  aggregation switches a pod, (n/2)^2 core switches for n pods: n^3/4 hosts and 5n^2/4
  switches when full, 5/n switches a host. A partial one is counted by the same rule (edge
  switches for the hosts, as many aggregation switches, cores for their uplinks). Full
  bisection: the model gives it no congestion beyond the hosts' own links.
- Leaf-spine of `radix`-port switches: a leaf splits its ports between hosts and uplinks by
  the oversubscription o (hosts = radix * o / (1 + o)), one uplink to each spine.
- BCube(n, k) as BML writes it: k levels of n-port switches, n^k servers with k NICs each,
  k * n^(k-1) switches; two servers that differ in one digit share that level's switch.

Cost: arithmetic, and for ECMP a fixed-seed Monte Carlo of a few hundred hashings.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from netagg.apps.scale.cluster import Cluster, Topology


@dataclasses.dataclass(frozen=True)
class LeafSpine:
    hosts_per_leaf: int
    leaves: int
    spines: int                     # = uplinks per leaf

    @classmethod
    def of(cls, cluster: Cluster) -> LeafSpine:
        o = cluster.oversubscription
        hosts = max(1, min(cluster.radix - 1, round(cluster.radix * o / (1 + o))))
        nodes = cluster.nodes
        return cls(min(hosts, nodes), math.ceil(nodes / hosts), cluster.radix - hosts)

    @property
    def uplink_share(self) -> float:
        """A leaf's uplink capacity over its hosts' (1 / oversubscription)."""
        return self.spines / self.hosts_per_leaf


def fat_tree_switches(hosts: int, n: int) -> int:
    edges = math.ceil(hosts / (n // 2))
    aggregations = edges
    cores = math.ceil(aggregations * (n // 2) / n)
    return edges + aggregations + cores


def bcube_servers(n: int, k: int) -> int:
    return n ** k


def bcube_switches(n: int, k: int) -> int:
    return k * n ** (k - 1)


def switches(cluster: Cluster) -> int:
    if cluster.topology is Topology.BCUBE:
        return bcube_switches(cluster.bcube_n, cluster.bcube_k)
    if cluster.topology is Topology.LEAF_SPINE:
        ls = LeafSpine.of(cluster)
        return ls.leaves + ls.spines
    return fat_tree_switches(cluster.nodes, cluster.radix)


def links_between_neighbours(cluster: Cluster) -> int:
    """Links between two nodes next to each other (same edge switch, leaf, BCube switch)."""
    return 2


def links_across(cluster: Cluster) -> int:
    """Links on the longest host-to-host path: the latency of an all-to-all."""
    if cluster.topology is Topology.BCUBE:
        return 2 * cluster.bcube_k
    if cluster.topology is Topology.LEAF_SPINE:
        return 2 if LeafSpine.of(cluster).leaves == 1 else 4
    half = cluster.radix // 2
    if cluster.nodes <= half:
        return 2
    return 4 if cluster.nodes <= half * half else 6


def ecmp_efficiency(flows: int, paths: int, trials: int = 400) -> float:
    """Mean over max load of `flows` equal flows hashed onto `paths` paths: the share of the
    paths' capacity the busiest one lets the flows use (1 with spraying)."""
    if paths <= 1 or flows <= 0:
        return 1.0
    mean = flows / paths
    if flows * trials > 2_000_000:          # many flows: the balls-into-bins estimate
        return mean / (mean + math.sqrt(2 * mean * math.log(paths)))
    rng = np.random.default_rng(23)
    hashed = rng.integers(0, paths, size=(trials, flows))
    busiest = np.array([np.bincount(row, minlength=paths).max() for row in hashed])
    return float(mean / busiest.mean())


def uplink_slowdown(cluster: Cluster, remote_share: float, flows_per_leaf: int) -> float:
    """How much longer than its hosts' own links a leaf's uplinks take when `remote_share` of
    the hosts' traffic leaves the leaf in `flows_per_leaf` flows (>= 1: never faster). 1 on a
    Fat-Tree and on BCube (no oversubscription in the model)."""
    if cluster.topology is not Topology.LEAF_SPINE:
        return 1.0
    ls = LeafSpine.of(cluster)
    if ls.leaves == 1:
        return 1.0
    efficiency = 1.0 if cluster.spraying else ecmp_efficiency(flows_per_leaf, ls.spines)
    return max(1.0, remote_share / ls.uplink_share / efficiency)
