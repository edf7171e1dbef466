"""A simulated leaf and spine network of switches, behind the interface of one switch.

`Topology(leaves=2, spines=2)` cables a rack: leaf l's uplink i leaves by leaf port
`downlinks + i` and arrives at spine i's port l; each leaf's ports 0..downlinks-1 face the
hosts, and each spine's last port (`leaves`) is its management port, where hosts reach it
for control. Every switch gets its own MAC and IPv4 address (10.250.x.y by default, or the
ones given, such as the loopback addresses `sim serve --topology` binds) and the topology
writes, through each switch's control path as an operator would, its address and the uplink
table of every leaf (`UPLINK_*`: the port each uplink leaves by, the spine's MAC, IPv4
address and UDP port): that is cabling, and nothing of any job (the hosts configure the jobs,
`host.fabric_setup`).

The backend interface is one switch's: `send(port, frame)` by fabric host port, `run()` the
frames that leave host ports, as (fabric host port, frame), `tick()` to every switch; and
`advance()`, `run`'s for hosts in this process: a slice of the fabric's time, the RTL's
switches clocked in the background while the hosts answer (`sim.topology_time`). The
fabric's host ports are the leaves' downlinks, leaf by leaf, then the spines' management
ports (`host_port`, `locate`). `send_to` and `run_by_switch` name the switch and its own
port instead (`sim serve --topology`, one endpoint per switch). Frames between switches are
delivered inside (by `run`, round after round until none is in flight; by `advance`, at
each slice's end), each link (`Link`) able to drop, duplicate and reorder them
(`LinkFaults`), and counted per link and direction (`Link.frames`; a leaf's frames up an
uplink are its partials: the balance of the spines' load).

`tap`, when set, sees every frame that enters a link between switches, as (link, direction,
frame), before the link's faults, and loses it by returning True (the tests' probe).

`cut(spine)` fails a spine's links: every frame on them is lost from then on, and each leaf
learns of it (`Notice`): the uplink marked down (`REG_UPLINK_DOWN`), or its link reported
lost by the leaf's MAC (`set_link`), so that its slots move to the uplinks that remain; or
not at all (a spine gone silent). `restore` mends the links.

Backends: "golden" (`sim.golden_leaf.GoldenLeaf` with `uplinks=` for a leaf,
`sim.golden_spine.GoldenSpine` for a spine); "rtl" (`sim.model.make_switch`: each leaf the
gateware with `uplinks`, each spine with `spine`; their addresses written by control, so
that one Verilator build serves every switch of a role; a switch still busy runs again).
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Callable, Iterable

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.topology_time import Slices, clocked, pool

SLICE = 256         # cycles of an RTL switch per `Topology.advance`: the fabric's time step
RACK = W.Endpoint("10.250.255.254", 0xBEEF, 0x02_00_00_FA_FF_FE)    # the operator's address


class Notice(enum.Enum):
    """How the leaves learn that a spine's links were cut (`Topology.cut`)."""

    MARK = "mark"       # the fabric's manager writes the uplink's REG_UPLINK_DOWN bit
    LINK = "link"       # each leaf's MAC reports the link lost (`set_link`): the uplink is
                        # down until the link is back
    NONE = "none"       # they do not (a spine gone silent)


class Role(enum.Enum):
    LEAF = "leaf"
    SPINE = "spine"


class Direction(enum.Enum):
    """Which way a frame crosses a link: up from a leaf to a spine, or down."""

    UP = "up"
    DOWN = "down"


@dataclasses.dataclass(frozen=True)
class LinkFaults:
    """What a link does to the frames it carries, each with its probability."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0        # a frame swapped with the next on its link and direction


@dataclasses.dataclass
class Link:
    """A cable between port `a_port` of switch `a` (a leaf) and port `b_port` of switch `b`
    (a spine). `frames` counts what entered it per `Direction` (UP: a to b), `lost` what it
    dropped (faults, or cut)."""

    a: str
    a_port: int
    b: str
    b_port: int
    faults: LinkFaults = LinkFaults()
    cut: bool = False
    frames: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(Direction, 0))
    lost: int = 0

    def carry(self, frames: list[bytes], direction: Direction,
              rng: random.Random) -> list[bytes]:
        """The frames that come out of the far end, in the order they arrive."""
        self.frames[direction] += len(frames)
        if self.cut:
            self.lost += len(frames)
            return []
        f = self.faults
        out = []
        for frame in frames:
            if f.drop and rng.random() < f.drop:
                self.lost += 1
                continue
            out.append(frame)
            if f.duplicate and rng.random() < f.duplicate:
                out.append(frame)
        if f.reorder:
            for i in range(len(out) - 1):
                if rng.random() < f.reorder:
                    out[i], out[i + 1] = out[i + 1], out[i]
        return out


@dataclasses.dataclass
class Node:
    """One switch of the fabric: its name, role, index, addresses, the backend, and the ports
    that face hosts (a leaf's downlinks, a spine's management port)."""

    name: str
    role: Role
    index: int
    mac: int
    ip: str
    switch: object
    host_ports: list[int]
    udp_sport: int = R.UDP_SPORT_RESET


def default_ip(role: Role, index: int) -> str:
    return f"10.250.{1 if role is Role.LEAF else 2}.{index + 1}"


def default_mac(role: Role, index: int) -> int:
    return 0x02_4E_41_00_00_00 | (1 if role is Role.LEAF else 2) << 8 | index


def make_switch(backend: str, uplinks: int = 0, **params):
    """A switch of the fabric by backend name: a leaf with `uplinks`, else a spine."""
    if backend == "golden":
        from netagg.sim.golden_leaf import GoldenLeaf
        from netagg.sim.golden_spine import GoldenSpine
        return GoldenLeaf(uplinks=uplinks, **params) if uplinks else GoldenSpine(**params)
    if backend == "rtl":
        from netagg.sim.model import make_switch as rtl_switch
        params.pop("mac", None)         # (written by control: one build per role)
        params.pop("ip", None)
        return rtl_switch(spine=not uplinks, uplinks=uplinks, **params)
    raise ValueError(f"unknown fabric backend {backend!r}: golden or rtl")


class Topology:
    """Leaves and spines cabled as a rack (see the module's docstring). `downlinks`: host
    ports per leaf; `jobs`, `max_workers`, `slots`: every switch's; `faults`: every link's
    (`set_faults` per link); `addresses`: {switch name: IPv4 address} (default 10.250.x.y);
    `make(uplinks=, **params)`: the switches (default: the backend's, `make_switch`)."""

    def __init__(self, leaves: int = 2, spines: int = 2, backend: str = "golden", *,
                 downlinks: int = 4, jobs: int = 4, max_workers: int = 8, slots: int = 64,
                 faults: LinkFaults | None = None, seed: int = 0,
                 addresses: dict[str, str] | None = None, make=None,
                 slice_cycles: int = SLICE):
        if not 1 <= spines <= R.MAX_UPLINKS:
            raise ValueError(f"a leaf has 0..{R.MAX_UPLINKS} uplinks: spines must be "
                             f"1..{R.MAX_UPLINKS}, not {spines}")
        if not 1 <= leaves <= 15 or not 1 <= downlinks or downlinks + spines > 16:
            raise ValueError("leaves must be 1..15, and downlinks + spines at most 16 ports")
        self.leaves, self.spines, self.downlinks = leaves, spines, downlinks
        self.backend = backend
        self.rng = random.Random(seed)
        addresses = addresses or {}
        make = make or (lambda **params: make_switch(backend, **params))
        self.nodes: dict[str, Node] = {}
        common = {"jobs": jobs, "max_workers": max(max_workers, leaves), "slots": slots}
        for role, count in ((Role.LEAF, leaves), (Role.SPINE, spines)):
            for i in range(count):
                name = f"{role.value}{i}"
                mac, ip = default_mac(role, i), addresses.get(name, default_ip(role, i))
                if role is Role.LEAF:
                    ports, host_ports, uplinks = downlinks + spines, list(range(downlinks)), \
                        spines
                else:
                    ports, host_ports, uplinks = leaves + 1, [leaves], 0
                switch = make(ports=max(ports, 2), uplinks=uplinks, mac=mac,
                              ip=W.ip_to_int(ip), **common)
                self.nodes[name] = Node(name, role, i, mac, ip, switch, host_ports)
        self.links: dict[tuple[str, int], tuple[Link, Direction]] = {}   # (switch, port)
        self.link_list: list[Link] = []
        for leaf in range(leaves):
            for spine in range(spines):
                link = Link(f"leaf{leaf}", downlinks + spine, f"spine{spine}", leaf,
                            faults or LinkFaults())
                self.link_list.append(link)
                self.links[link.a, link.a_port] = (link, Direction.UP)
                self.links[link.b, link.b_port] = (link, Direction.DOWN)
        self._ports = [(n.name, p) for n in self.nodes.values() for p in n.host_ports]
        self._port_index = {key: i for i, key in enumerate(self._ports)}
        self.ports = len(self._ports)
        self._out: list[tuple[str, int, bytes]] = []     # frames out of host ports
        self._psn = 0
        self.hops = 0                                     # frames delivered between switches
        self.tap: Callable[[Link, Direction, bytes], bool] | None = None
        self._time = Slices(list(self.nodes.values()), slice_cycles)     # `advance`'s
        self._ticks = 0                                   # ticks due once a slice is over
        self._cable()

    # --- the wiring -------------------------------------------------------------------------

    @property
    def leaf_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.role is Role.LEAF]

    @property
    def spine_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.role is Role.SPINE]

    def uplink_records(self, leaf: Node) -> list[tuple[int, int]]:
        """The uplink table of a leaf as control records: uplink i to spine i."""
        return [record for i, spine in enumerate(self.spine_nodes)
                for record in W.uplink_records(i, self.downlinks + i,
                                               W.Endpoint(spine.ip, W.ROCEV2_PORT, spine.mac))]

    def _cable(self):
        """Every switch's addresses and every leaf's uplink table, written by control."""
        for node in self.nodes.values():
            records = [(R.REG_MAC_HI, node.mac >> 32), (R.REG_MAC_LO, node.mac & 0xFFFFFFFF),
                       (R.REG_IP, W.ip_to_int(node.ip)), (R.REG_UDP_SPORT, node.udp_sport)]
            if node.role is Role.LEAF:
                records += self.uplink_records(node) + [(R.REG_UPLINK_DOWN, 0)]
            self.control(node.name, [(a | R.WRITE, v) for a, v in records], check=True)
        uplinks = [self.control(n.name, [(R.REG_UPLINKS, 0)])[0][1] for n in self.leaf_nodes]
        if any(u != self.spines for u in uplinks):
            raise RuntimeError(f"the leaves report {uplinks} uplinks, not {self.spines}")

    def control(self, name: str, records, check: bool = False) -> list[tuple[int, int]]:
        """One control request from the operator (`RACK`) to switch `name`, by its first host
        port; its answer (address, value) records. `check`: a write that did not take is a
        RuntimeError."""
        node = self.nodes[name]
        self._psn = (self._psn + 1) & 0xFFFFFF
        switch_ep = W.Endpoint(node.ip, W.ROCEV2_PORT, node.mac)
        frame = W.control_request(list(records), self._psn, RACK, switch_ep).frame()
        self._send_in(name, node.host_ports[0], frame)
        answer = None
        for sw, port, out in self._run():
            if answer is None and sw == name and _to(out, RACK):
                pkt = W.parse_frame(out)
                if pkt.psn == self._psn:
                    answer = W.unpack_records(pkt.payload)
                    continue
            self._out.append((sw, port, out))
        if answer is None:
            raise RuntimeError(f"{name} did not answer the operator's control request")
        if check:
            for (a, v), (_, back) in zip(records, answer):
                if a & R.WRITE and back != v:
                    raise RuntimeError(f"{name} kept {back:#x} at register "
                                       f"{a & ~R.WRITE:#x}, not {v:#x}")
        return answer

    def set_faults(self, faults: LinkFaults, links: Iterable[Link] | None = None):
        for link in self.link_list if links is None else links:
            link.faults = faults

    def cut(self, spine: int, notice: Notice = Notice.MARK):
        """Spine `spine`'s links fail: their frames are lost, and the leaves learn of it as
        `notice` says (by default, the fabric's manager marks the uplink down)."""
        for link in self.link_list:
            if link.b == f"spine{spine}":
                link.cut = True
        if notice is Notice.MARK:
            for leaf in self.leaf_nodes:
                [(_, down)] = self.control(leaf.name, [(R.REG_UPLINK_DOWN, 0)])
                self.control(leaf.name, [(R.REG_UPLINK_DOWN | R.WRITE, down | 1 << spine)],
                             check=True)
        elif notice is Notice.LINK:
            self._links(spine, up=False)

    def restore(self, spine: int):
        """Spine `spine`'s links carry frames again, and the leaves' MACs report them up
        (what the leaves' REG_UPLINK_DOWN marks stays: the manager's to undo)."""
        for link in self.link_list:
            if link.b == f"spine{spine}":
                link.cut = False
        self._links(spine, up=True)

    def _links(self, spine: int, up: bool):
        """Every leaf's MAC on the port to spine `spine` reports its link up or lost."""
        self._join()
        for leaf in self.leaf_nodes:
            leaf.switch.set_link(self.downlinks + spine, up)

    def partials(self) -> dict[str, list[int]]:
        """Frames each leaf sent up each uplink (its partials, first sends and resends)."""
        return {leaf.name: [self.links[leaf.name, self.downlinks + i][0].frames[Direction.UP]
                            for i in range(self.spines)] for leaf in self.leaf_nodes}

    # --- the backend interface --------------------------------------------------------------

    def host_port(self, name: str, port: int) -> int:
        """The fabric host port of switch `name`'s port `port`."""
        return self._port_index[name, port]

    def locate(self, fabric_port: int) -> tuple[str, int]:
        """(switch name, its port) of a fabric host port."""
        return self._ports[fabric_port]

    def send(self, port: int, frame: bytes):
        self._send_in(*self.locate(port), frame)

    def send_to(self, name: str, port: int, frame: bytes):
        if port not in self.nodes[name].host_ports:
            raise ValueError(f"port {port} of {name} does not face hosts")
        self._send_in(name, port, frame)

    def _send_in(self, name: str, port: int, frame: bytes):
        node = self.nodes[name]
        if not self._time.hold(node, port, frame):
            node.switch.send(port, frame)

    def run(self) -> list[tuple[int, bytes]]:
        return [(self._port_index[sw, port], frame) for sw, port, frame in self.run_by_switch()]

    def run_by_switch(self) -> list[tuple[str, int, bytes]]:
        """The frames that left host ports since the last call: (switch, port, frame)."""
        run = self._run()
        out, self._out = self._out + run, []
        return out

    def tick(self):
        """A tick to every switch (once the running slice, if any, is over); what it sent goes
        on its links, or out by the next `run` or `advance`."""
        if self._time.running:
            self._ticks += 1
            return []
        ticked = [(n, n.switch.tick() or []) for n in self.nodes.values()
                  if hasattr(n.switch, "tick")]
        self._settle(self._deliver(ticked, self._out), self._out)
        return []

    def advance(self) -> list[tuple[int, bytes]]:
        """The fabric's time for hosts in this process (`sim.topology_time`): the frames that
        left host ports in the slice that ran since the last call (and since any `run`), and
        the next slice started in the background. A golden switch takes what it got at once,
        and so does a golden far end of a link; the RTL's switches take the frames of a slice's
        end (theirs, the hosts') in the next slice."""
        self._join()
        self._settle(self.nodes.values(), self._out)
        self._time.start()
        out, self._out = self._out, []
        return [(self._port_index[sw, port], frame) for sw, port, frame in out]

    def _join(self):
        """The running slice's end: its frames carried or out (`_out`), the ticks due meanwhile
        applied."""
        if self._time.running:
            self._settle(self._deliver(self._time.join(), self._out), self._out)
        ticks, self._ticks = self._ticks, 0
        for _ in range(ticks):
            self.tick()

    def _settle(self, nodes, out: list):
        """The golden switches of `nodes` run, and so do the golden ones their frames reach,
        until none of them has frames in flight (the RTL's keep theirs for a slice)."""
        golden = [n for n in nodes if not clocked(n.switch)]
        while golden:
            golden = [n for n in self._deliver([(n, n.switch.run()) for n in golden], out)
                      if not clocked(n.switch)]

    def _run(self) -> list[tuple[str, int, bytes]]:
        """Every switch runs, and the frames between switches are carried, until none is in
        flight; the frames out of host ports."""
        self._join()
        out = []
        busy = list(self.nodes.values())
        while busy:
            got = self._deliver(self._each(busy), out)
            busy = got + [n for n in self.nodes.values()     # the RTL's: a frame still inside
                          if getattr(n.switch, "busy", False) and n not in got]
        return out

    @staticmethod
    def _each(nodes: list[Node]) -> list[tuple[Node, list]]:
        """(node, its switch's `run()`) for each of `nodes`, in their order; the RTL's models
        side by side in threads (their clock runs without the GIL)."""
        models = [n for n in nodes if clocked(n.switch)]
        if len(models) < 2:
            return [(n, n.switch.run()) for n in nodes]
        done = dict(zip(map(id, models), pool().map(lambda n: n.switch.run(), models)))
        return [(n, done[id(n)] if id(n) in done else n.switch.run()) for n in nodes]

    def _deliver(self, outputs: list[tuple[Node, list]], out: list) -> list[Node]:
        """Each switch's frames out (`outputs`) into the far switch of their link (through the
        tap and the link's faults), or to `out` from a host port; the switches that got
        frames, in the order they got their first."""
        carried: dict[tuple[str, int], list[bytes]] = {}
        for node, frames in outputs:
            for port, frame in frames:
                if (node.name, port) in self.links:
                    carried.setdefault((node.name, port), []).append(frame)
                else:
                    out.append((node.name, port, frame))
        got = []
        for (name, port), frames in carried.items():
            link, direction = self.links[name, port]
            if self.tap is not None:
                frames = [f for f in frames if not self.tap(link, direction, f)]
            far, far_port = (link.b, link.b_port) if direction is Direction.UP else \
                (link.a, link.a_port)
            arrived = link.carry(frames, direction, self.rng)
            self.hops += len(arrived)
            for frame in arrived:
                self.nodes[far].switch.send(far_port, frame)
            if arrived and self.nodes[far] not in got:
                got.append(self.nodes[far])
        return got

    # --- the description ----------------------------------------------------------------

    def describe(self, urls: dict[str, str] | None = None) -> dict:
        """The fabric as the hosts need it (`host.fabric.Fabric`'s JSON): each switch's
        name, URL (`urls`, default `sim://NAME`, in process), addresses and ports, and each
        leaf's uplinks."""
        urls = urls or {}

        def switch(node: Node) -> dict:
            return {"name": node.name, "url": urls.get(node.name, f"sim://{node.name}"),
                    "ip": node.ip, "mac": f"{node.mac:012x}", "udp_port": node.udp_sport,
                    "host_ports": node.host_ports}

        return {
            "leaves": [{**switch(leaf), "uplinks": [
                {"uplink": i, "port": self.downlinks + i, "spine": spine.name,
                 "ip": spine.ip, "mac": f"{spine.mac:012x}", "udp_port": W.ROCEV2_PORT}
                for i, spine in enumerate(self.spine_nodes)]} for leaf in self.leaf_nodes],
            "spines": [{**switch(spine), "leaf_ports": list(range(self.leaves))}
                       for spine in self.spine_nodes],
        }


def _to(frame: bytes, endpoint: W.Endpoint) -> bool:
    """Whether a frame goes to `endpoint`'s IPv4 address and UDP port."""
    _, dst, _ = W.strip_frame(frame)
    return (dst.ip, dst.port) == (endpoint.ip, endpoint.port)
