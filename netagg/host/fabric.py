"""A leaf and spine fabric as the hosts see it: its description, where a rank sits in it, and
the transports that reach its switches.

The description (`Fabric`, JSON as `netagg sim serve --topology` writes it with `--describe`,
or written by hand for boards)::

    {"leaves": [{"name": "leaf0", "url": "udp://127.1.2.3:4791", "ip": "127.1.2.3",
                 "mac": "024e41000100", "udp_port": 49152, "host_ports": [0, 1, 2, 3],
                 "uplinks": [{"uplink": 0, "port": 4, "spine": "spine0", "ip": "127.4.5.6",
                              "mac": "024e41000200", "udp_port": 4791}, ...]}, ...],
     "spines": [{"name": "spine0", "url": "udp://127.4.5.6:4791", "ip": "127.4.5.6",
                 "mac": "024e41000200", "udp_port": 49152, "host_ports": [2],
                 "leaf_ports": [0, 1]}, ...]}

A switch's `udp_port` is its REG_UDP_SPORT (the source port of its results and partials;
default its reset value, 49152), an uplink's the spine's UDP port (default, and what a
switch's parser takes: the RoCEv2 port, 4791).

Two levels only: a spine with uplinks, a leaf with leaf ports, a switch both a leaf and a
spine, or a level beside "leaves" and "spines" is a NetaggError (`Fabric.check`): a switch
of a middle level would send a child's `final` up as an ordinary partial (docs/leafspine.md).

Leaf l's uplink i goes to spine i, whose port `leaf_ports[l]` it arrives at; a spine's job
table entry of leaf l sends the spine's results there, to the leaf's `ip` and `mac` (its
REG_IP, REG_MAC: also the source of its partials) and the RoCEv2 UDP port. `url` is how
hosts reach a switch's control path: `udp://IP:PORT`, or `sim://NAME` for an in-process
`sim.topology.Topology` (`Fabric.in_process`).

Ranks sit on the leaves in blocks, in the description's order: leaf l holds the world's ranks
`l * world // leaves` .. `(l + 1) * world // leaves - 1` (`Placement`), its rank at the leaf
(the ImmDt rank of its contributions) counting from 0 there. Hierarchical workers
(`local_size` L > 1) sit by node: the nodes (ranks `node * L` .. `node * L + L - 1`) in
blocks over the leaves, a node's rank at its leaf counting from 0 there, in each of its
switch jobs alike.
"""

from __future__ import annotations

import dataclasses
import json
import os

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import transport as T
from netagg.host.errors import NetaggError


@dataclasses.dataclass(frozen=True)
class Uplink:
    uplink: int
    port: int
    spine: str
    ip: str
    mac: int
    udp_port: int


@dataclasses.dataclass(frozen=True)
class FabricSwitch:
    name: str
    url: str
    ip: str
    mac: int
    udp_port: int
    host_ports: tuple[int, ...]
    uplinks: tuple[Uplink, ...] = ()
    leaf_ports: tuple[int, ...] = ()


def _mac(value) -> int:
    return value if isinstance(value, int) else int(str(value).replace(":", ""), 16)


def _switch(d: dict) -> FabricSwitch:
    return FabricSwitch(
        d["name"], d["url"], d["ip"], _mac(d["mac"]), int(d.get("udp_port", R.UDP_SPORT_RESET)),
        tuple(d.get("host_ports", ())),
        tuple(Uplink(int(u["uplink"]), int(u["port"]), u["spine"], u["ip"], _mac(u["mac"]),
                     int(u.get("udp_port", W.ROCEV2_PORT))) for u in d.get("uplinks", ())),
        tuple(d.get("leaf_ports", ())))


@dataclasses.dataclass
class Fabric:
    """Leaves and spines (see the module's docstring); `backend`: the in-process topology
    its `sim://` URLs name, if any."""

    leaves: list[FabricSwitch]
    spines: list[FabricSwitch]
    backend: object = None

    @classmethod
    def from_dict(cls, d: dict, backend=None) -> Fabric:
        levels = sorted(set(d) - {"leaves", "spines"})
        if levels:
            raise NetaggError(f"a fabric's description has two levels, 'leaves' and "
                              f"'spines', not {levels}: three-level fabrics are not supported "
                              f"(docs/leafspine.md)")
        fabric = cls([_switch(s) for s in d["leaves"]], [_switch(s) for s in d["spines"]],
                     backend)
        fabric.check()
        return fabric

    @classmethod
    def load(cls, source) -> Fabric:
        """A Fabric from itself, a dict, a JSON string or a JSON file's path, or an
        in-process topology."""
        if isinstance(source, Fabric):
            return source
        if hasattr(source, "describe") and hasattr(source, "run"):
            return cls.in_process(source)
        if isinstance(source, dict):
            return cls.from_dict(source)
        text = str(source)
        if not text.lstrip().startswith("{") and os.path.exists(text):
            with open(text) as f:
                text = f.read()
        return cls.from_dict(json.loads(text))

    @classmethod
    def in_process(cls, topology) -> Fabric:
        return cls.from_dict(topology.describe(), backend=topology)

    def check(self):
        if not self.leaves or not self.spines:
            raise NetaggError("a fabric needs at least one leaf and one spine")
        names = [s.name for s in self.spines]
        self._two_levels()
        for leaf in self.leaves:
            if [u.spine for u in leaf.uplinks] != names:
                raise NetaggError(f"{leaf.name}'s uplinks go to "
                                  f"{[u.spine for u in leaf.uplinks]}: uplink i must go to "
                                  f"spine i of {names}")
        for spine in self.spines:
            if len(spine.leaf_ports) != len(self.leaves):
                raise NetaggError(f"{spine.name} names {len(spine.leaf_ports)} leaf ports for "
                                  f"{len(self.leaves)} leaves")

    def _two_levels(self):
        """Refuse a description of more than two levels: a spine with uplinks (a switch
        above it), a leaf with leaf ports (switches below it), a switch that is both. A
        switch of a middle level would take its children's partials and send its own up,
        but it sends a child's `final` up as an ordinary partial: three levels are wrong,
        and not supported (docs/leafspine.md)."""
        why = "three-level fabrics are not supported: leaves under spines only " \
              "(docs/leafspine.md)"
        for spine in self.spines:
            if spine.uplinks:
                raise NetaggError(f"spine {spine.name} has uplinks (to "
                                  f"{[u.spine for u in spine.uplinks]}): {why}")
        for leaf in self.leaves:
            if leaf.leaf_ports:
                raise NetaggError(f"leaf {leaf.name} has leaf ports {list(leaf.leaf_ports)} "
                                  f"(switches under it): {why}")
        for spine in self.spines:
            for leaf in self.leaves:
                if spine.name == leaf.name or spine.ip == leaf.ip or spine.url == leaf.url:
                    raise NetaggError(f"{spine.name} is both a spine and a leaf "
                                      f"({leaf.name}, {leaf.ip}, {leaf.url}): {why}")

    def to_dict(self) -> dict:
        def switch(s: FabricSwitch) -> dict:
            d = {"name": s.name, "url": s.url, "ip": s.ip, "mac": f"{s.mac:012x}",
                 "udp_port": s.udp_port, "host_ports": list(s.host_ports)}
            if s.uplinks:
                d["uplinks"] = [{**dataclasses.asdict(u), "mac": f"{u.mac:012x}"}
                                for u in s.uplinks]
            if s.leaf_ports:
                d["leaf_ports"] = list(s.leaf_ports)
            return d
        return {"leaves": [switch(s) for s in self.leaves],
                "spines": [switch(s) for s in self.spines]}

    def leaf_named(self, url_or_name) -> int | None:
        for i, leaf in enumerate(self.leaves):
            if url_or_name in (leaf.url, leaf.name):
                return i
        return None

    # --- reaching a switch ----------------------------------------------------------------

    def transport(self, switch: FabricSwitch, ip: str, udp_port: int = W.ROCEV2_PORT,
                  paths: int = 1, bind: str | None = None) -> T.Transport:
        """A transport to `switch`'s control path (and, for a leaf, its aggregation): UDP to
        its URL, or in process into its first host port that `ip`'s frames may enter."""
        if switch.url.startswith("udp://"):
            return T.UdpTransport(switch.url, bind_ip=bind, paths=paths)
        if not switch.url.startswith("sim://") or self.backend is None:
            raise NetaggError(f"{switch.name}'s URL {switch.url!r} is neither udp:// nor an "
                              f"in-process topology's sim://")
        if paths != 1:
            raise NetaggError("in-process fabric workers send by one path")
        topology = self.backend
        ports = switch.host_ports
        port = ports[(W.ip_to_int(ip) + udp_port) % len(ports)]
        return FabricTransport(hub_for(topology), ip, udp_port, switch.ip,
                               topology.host_port(switch.name, port))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a worker sits in the fabric's job: its rank there (`rank` of `world`: the world
    rank, or hierarchical, `local_size` > 1, its node among the world's nodes, the switch
    workers), its leaf, its rank there and the leaf's ranks; `local_rank` of `local_size`
    its place in its node (its switch job is the job's + `local_rank`)."""

    rank: int
    world: int
    leaf: int
    leaf_rank: int
    first: int          # the leaf's first rank in the fabric's job
    leaf_workers: int
    local_rank: int = 0
    local_size: int = 1

    @classmethod
    def of(cls, rank: int, world: int, leaves: int, local_size: int = 1) -> Placement:
        """World rank `rank` of `world`, in nodes of `local_size` consecutive ranks (1:
        flat), over `leaves` leaves: the nodes in blocks, leaf by leaf."""
        node, local_rank = divmod(rank, local_size)
        nodes = world // local_size
        if nodes < leaves:
            what = "workers" if local_size == 1 else f"nodes ({world} workers in nodes of " \
                                                     f"{local_size})"
            raise NetaggError(f"{nodes} {what} cannot fill {leaves} leaves")
        leaf = next(lf for lf in range(leaves) if node < (lf + 1) * nodes // leaves)
        first = leaf * nodes // leaves
        return cls(node, nodes, leaf, node - first, first,
                   (leaf + 1) * nodes // leaves - first, local_rank, local_size)

    @staticmethod
    def ranks_of(leaf: int, world: int, leaves: int) -> range:
        """The ranks of the fabric's job (world ranks, or nodes) leaf `leaf` of `leaves`
        holds among `world`."""
        return range(leaf * world // leaves, (leaf + 1) * world // leaves)

    def world_rank(self, rank: int) -> int:
        """The world rank of rank `rank` of the fabric's job in this worker's switch job (a
        node's local worker `local_rank`, hierarchical)."""
        return rank * self.local_size + self.local_rank

    def who(self, rank: int, leaf_rank: int, leaf: str, note: str = "") -> str:
        """Rank `rank` of the fabric's job (in this worker's switch job), at `leaf` as
        `leaf_rank`, for errors after "rank ": "6 (rank 2 at leaf1)", or hierarchical "7
        (node 3, rank 1 at leaf1)" (its world rank first); `note` ends the parenthesis."""
        if self.local_size == 1:
            return f"{rank} (rank {leaf_rank} at {leaf}{note})"
        return f"{self.world_rank(rank)} (node {rank}, rank {leaf_rank} at {leaf}{note})"

    def me(self, leaf: str) -> str:
        """This worker, for errors: "rank 4 (rank 0 at leaf1)", or "rank 5 (node 2, ...)"."""
        return "rank " + self.who(self.rank, self.leaf_rank, leaf)


# --- in process ----------------------------------------------------------------------------

class FabricHub(T.InProcessHub):
    """The in-process workers around one topology: its frames out of fabric host port p go
    to the transport whose frames enter port p, by destination address. Each run of the
    topology is a slice of its time (`Topology.advance`): results leave while the switches
    work, and the workers answer them between slices."""

    def run_backend(self) -> list[tuple[int, bytes]]:
        return self.backend.advance()

    @staticmethod
    def reaches(transport, port: int) -> bool:
        return getattr(transport, "fabric_port", None) == port


def hub_for(topology) -> FabricHub:
    """The one hub of a topology, while its transports hold it (`transport.hub_for`)."""
    return T.hub_for(topology, FabricHub)


class FabricTransport(T.InProcessTransport):
    """An in-process transport into fabric host port `fabric_port` (a switch's own port, as
    the switch reports it in REG_PORT, is `switch_port`: what a job-table entry names)."""

    def __init__(self, hub: FabricHub, ip: str, udp_port: int, switch_ip: str,
                 fabric_port: int):
        self.fabric_port = fabric_port
        super().__init__(hub, ip, udp_port, switch_port=fabric_port, switch_ip=switch_ip)

    def send(self, datagram: bytes, path: int = 0, dscp: int = 0):
        frame = W.wrap_datagram(self._sources[0], self.switch, datagram, dscp)
        with self.hub.lock:
            self.hub.backend.send(self.fabric_port, frame)

