"""The emulated leaf and spine fabric: racks of hosts whose leaves reach every spine, routed
as fabrics route, and netagg's switch reached through the spines, made of the kernel's own
networking.

    host (namespace NAME-hI): eth0 10.78.L.(10+h)/24 ── host link ──┐
    leaf L (NAME-lL): bridge br0 10.78.L.1/24 ◄─────────────────────┘ (port hI)
                      uplink sS 10.79.S.(4L+1)/30 ── uplink ── spine S (NAME-sS): lL .(4L+2)
    spine S:          sw 10.79.(100+S).2/30 ── switch link ── netagg (NAME-sw): sS .1
    netagg's switch:  10.76.0.1/32 on its loopback, serving on it (`sim serve`)

Hosts sit `hosts_per_leaf` to a leaf, host I at leaf I // hosts_per_leaf. A leaf is a router:
its hosts share its bridge, and everything else leaves by an uplink, one to each spine. A
spine is a router with a link to every leaf and one to netagg's switch, whose namespace has a
link to every spine. Leaves and the switch route what goes up (or down) by ECMP, as fabrics
do: a multipath route over every spine, a flow hashed onto one of them by its 5-tuple
(`fib_multipath_hash_policy` 1), so each of a host's UDP source ports and each TCP connection
keeps one path. Spraying (`spray=True`, or `spray(on)` at any time, `sim.cluster_spray`) is
what a fabric that sprays has: netagg's contributions go up, and its results come down, by
the spine their slot picks, whatever spine the hash picked; every spine's end of a leaf's
(or the switch's) links has one MAC, so a frame redirected to another link is taken there. A
worker's consecutive packets go to consecutive slots, so they alternate over the spines.
Hosts and the switch cut their UDP GSO runs into datagrams at the NIC (`WIRE_SEGMENTS`), as
a NIC's offload does before the wire. Other traffic keeps ECMP's hash. This kernel has no
bonding, no per-packet multipath route and no random tc action; u32 and mirred it has.

Every link is two veth ends shaped at the link's rate (`sim.cluster_links.Shape`), one tbf
or (`classes`) two DSCP classes (`sim.cluster_classes`) at each end: a
host's at `rate`; an uplink at `rate` times the leaf's hosts over the spines and the
`oversubscription` (2: a leaf's uplinks carry half what its hosts can send); a spine's link
to the switch at the spine's whole share of the uplinks, so that the uplinks, not the
switch's links, are where the hosts' traffic meets. `cut_spine` takes a spine's links down
at the leaves and the switch: their routes leave it out, as a fabric's do when a spine fails,
and spraying is dealt over the spines left.

`FabricCluster` is a `sim.cluster.Cluster` (the same making, guarding, running, serving and
counting: its `rack` is the switch's namespace), with `uplinks()` (what crossed each leaf's
uplinks) beside `counters()` (each host's link).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import subprocess
import sys

from netagg.sim import cluster as C
from netagg.sim import cluster_spray, netns
from netagg.sim.cluster_classes import shape_port
from netagg.sim.cluster_links import NIC_QUEUE, Counters, Shape

SWITCH_IP = "10.76.0.1"         # netagg's switch, on its namespace's loopback
HOST_NET = "10.78.{leaf}.0/24"
FIRST_HOST = 10
# A host's (and the switch's) UDP GSO runs are cut into datagrams as they leave its NIC, as a
# NIC's segmentation offload cuts them before the wire: a veth would pass a run on whole, and
# a leaf would route (and spray) it as one packet.
WIRE_SEGMENTS = {"tx-udp-segmentation": False, "tx-gso-list": False}


def _uplink(leaf: int, spine: int) -> tuple[str, str]:
    """The leaf's and the spine's address on their link (a /30)."""
    return f"10.79.{spine}.{4 * leaf + 1}", f"10.79.{spine}.{4 * leaf + 2}"


def _switch_link(spine: int) -> tuple[str, str]:
    """The switch's and the spine's address on their link (a /30)."""
    return f"10.79.{100 + spine}.1", f"10.79.{100 + spine}.2"


@dataclasses.dataclass(frozen=True)
class Topology:
    """`leaves` x `spines`, `hosts_per_leaf` hosts on each leaf."""

    leaves: int
    spines: int
    hosts_per_leaf: int

    @classmethod
    def parse(cls, text: str, hosts_per_leaf: int) -> Topology:
        """``LxS`` (``2x2``)."""
        try:
            leaves, spines = (int(n) for n in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"a topology is LEAVESxSPINES (2x2), not {text!r}") from None
        return cls(leaves, spines, hosts_per_leaf)

    def __post_init__(self):
        if not (1 <= self.leaves <= 60 and 1 <= self.spines <= 60):
            raise ValueError(f"a fabric has 1..60 leaves and 1..60 spines, not "
                             f"{self.leaves}x{self.spines}")
        if not 1 <= self.hosts_per_leaf <= 200:
            raise ValueError(f"a leaf has 1..200 hosts, not {self.hosts_per_leaf}")


class FabricCluster(C.Cluster):
    """Hosts on a leaf and spine fabric (`topology`), host links of `rate` with `queue`
    bytes each way, uplinks oversubscribed `oversubscription` to one, named `name`; netagg's
    packets sprayed over the spines with `spray`, every port's queue split into priority
    classes by DSCP with `classes` (`sim.cluster_classes`). Made on entering, removed on
    leaving."""

    def __init__(self, topology: Topology, rate: str | int = "100mbit", queue=None,
                 name: str = "nagf", oversubscription: float = 1.0, spray: bool = False,
                 classes: bool = False):
        t = topology
        super().__init__(t.leaves * t.hosts_per_leaf, rate, queue, name)
        if oversubscription < 1:
            raise ValueError(f"oversubscription is at least 1, not {oversubscription}")
        self.topology = t
        self.spraying, self.cut, self.classes = spray, set(), classes
        self.oversubscription = oversubscription
        self.hosts = [C.Host(h.index, h.namespace, self._host_ip(h.index)) for h in self.hosts]
        self.switch_ip = SWITCH_IP
        uplink = self.shape.rate * t.hosts_per_leaf / (t.spines * oversubscription)
        self.uplink_shape = Shape.of(int(uplink), max(self.shape.queue, int(uplink) // 8 // 100))
        self.switch_shape = Shape.of(int(uplink * t.leaves))

    def leaf_of(self, host: int) -> int:
        return host // self.topology.hosts_per_leaf

    def _host_ip(self, host: int) -> str:
        net = ipaddress.IPv4Network(HOST_NET.format(leaf=self.leaf_of(host)))
        return str(net[FIRST_HOST + host % self.topology.hosts_per_leaf])

    def leaf(self, leaf: int) -> str:
        return f"{self.name}-l{leaf}"

    def spine(self, spine: int) -> str:
        return f"{self.name}-s{spine}"

    def port(self, host: C.Host) -> tuple[str, str]:
        return self.leaf(self.leaf_of(host.index)), f"h{host.index}"

    # --- making it -------------------------------------------------------------------------

    def _make(self):
        from pyroute2 import netns as pyroute_netns
        t = self.topology
        routers = [self.leaf(i) for i in range(t.leaves)] + \
            [self.spine(s) for s in range(t.spines)]
        for ns in (self.rack, *routers, *(h.namespace for h in self.hosts)):
            pyroute_netns.create(ns)
        for ns in routers:
            _sysctl(ns, {"net.ipv4.ip_forward": "1", "net.ipv4.conf.all.rp_filter": "0",
                         "net.ipv4.conf.default.rp_filter": "0",
                         "net.ipv4.fib_multipath_hash_policy": "1"})
        _sysctl(self.rack, {"net.ipv4.fib_multipath_hash_policy": "1",
                            "net.ipv4.conf.all.rp_filter": "0",
                            "net.ipv4.conf.default.rp_filter": "0"})
        for leaf in range(t.leaves):
            self._make_leaf(leaf)
        for spine in range(t.spines):
            self._make_spine(spine)
        self._make_switch()
        for namespace, device in [(h.namespace, "eth0") for h in self.hosts] + \
                [(self.rack, f"s{spine}") for spine in range(t.spines)]:
            C.set_features(namespace, device, {**C.RECEIVE_OFFLOAD, **WIRE_SEGMENTS})
        if self.spraying:
            self._steer()

    def _make_leaf(self, leaf: int):
        from pyroute2 import NetNS
        t = self.topology
        net = ipaddress.IPv4Network(HOST_NET.format(leaf=leaf))
        with NetNS(self.leaf(leaf)) as ns:
            _up(ns, "lo")
            ns.link("add", ifname="br0", kind="bridge")
            bridge = ns.link_lookup(ifname="br0")[0]
            ns.addr("add", index=bridge, address=str(net[1]), prefixlen=net.prefixlen)
            ns.link("set", index=bridge, state="up")
            for h in self.hosts[leaf * t.hosts_per_leaf:(leaf + 1) * t.hosts_per_leaf]:
                ns.link("add", ifname=f"h{h.index}", kind="veth",
                        peer={"ifname": "eth0", "net_ns_fd": h.namespace})
                port = ns.link_lookup(ifname=f"h{h.index}")[0]
                ns.link("set", index=port, master=bridge)
                self._shape(ns, port, self.shape)
                ns.link("set", index=port, state="up")
                with NetNS(h.namespace) as host:
                    _up(host, "lo")
                    nic = host.link_lookup(ifname="eth0")[0]
                    host.addr("add", index=nic, address=h.ip, prefixlen=net.prefixlen)
                    self._shape(host, nic, self.shape.with_queue(max(NIC_QUEUE,
                                                                     self.shape.queue)))
                    host.link("set", index=nic, state="up")
                    host.route("add", dst="0.0.0.0/0", gateway=str(net[1]))
            for spine in range(t.spines):
                mine, theirs = _uplink(leaf, spine)
                ns.link("add", ifname=f"s{spine}", kind="veth",
                        peer={"ifname": f"l{leaf}", "net_ns_fd": self.spine(spine)})
                up = ns.link_lookup(ifname=f"s{spine}")[0]
                ns.addr("add", index=up, address=mine, prefixlen=30)
                self._shape(ns, up, self.uplink_shape)
                ns.link("set", index=up, state="up")
            hops = [{"gateway": _uplink(leaf, s)[1], "oif": ns.link_lookup(ifname=f"s{s}")[0]}
                    for s in range(t.spines)]
            away = [HOST_NET.format(leaf=other) for other in range(t.leaves) if other != leaf]
            for dst in away + [f"{SWITCH_IP}/32"]:
                ns.route("add", dst=dst, multipath=hops)

    def _make_spine(self, spine: int):
        from pyroute2 import NetNS
        t = self.topology
        with NetNS(self.spine(spine)) as ns:
            _up(ns, "lo")
            for leaf in range(t.leaves):
                down = ns.link_lookup(ifname=f"l{leaf}")[0]
                ns.link("set", index=down, address=f"02:4e:46:{leaf:02x}:00:01")   # (`_steer`)
                ns.addr("add", index=down, address=_uplink(leaf, spine)[1], prefixlen=30)
                self._shape(ns, down, self.uplink_shape)
                ns.link("set", index=down, state="up")
                ns.route("add", dst=HOST_NET.format(leaf=leaf), gateway=_uplink(leaf, spine)[0])
            ns.link("add", ifname="sw", kind="veth",
                    peer={"ifname": f"s{spine}", "net_ns_fd": self.rack})
            link = ns.link_lookup(ifname="sw")[0]
            ns.link("set", index=link, address="02:4e:46:ff:00:01")
            ns.addr("add", index=link, address=_switch_link(spine)[1], prefixlen=30)
            self._shape(ns, link, self.switch_shape)
            ns.link("set", index=link, state="up")
            ns.route("add", dst=f"{SWITCH_IP}/32", gateway=_switch_link(spine)[0])

    def _make_switch(self):
        from pyroute2 import NetNS
        t = self.topology
        with NetNS(self.rack) as ns:
            lo = _up(ns, "lo")
            ns.addr("add", index=lo, address=SWITCH_IP, prefixlen=32)
            for spine in range(t.spines):
                link = ns.link_lookup(ifname=f"s{spine}")[0]
                ns.addr("add", index=link, address=_switch_link(spine)[0], prefixlen=30)
                self._shape(ns, link, self.switch_shape)
                ns.link("set", index=link, state="up")
            hops = [{"gateway": _switch_link(s)[1], "oif": ns.link_lookup(ifname=f"s{s}")[0]}
                    for s in range(t.spines)]
            for leaf in range(t.leaves):
                ns.route("add", dst=HOST_NET.format(leaf=leaf), multipath=hops,
                         prefsrc=SWITCH_IP)

    def _shape(self, ns, index: int, shape: Shape):
        shape_port(ns, index, shape, self.classes, trusted=SWITCH_IP)

    # --- spraying ---------------------------------------------------------------------------

    def spray(self, on: bool = True):
        """Spray netagg's packets over the live spines (or stop): a contribution goes up,
        and a result down, by the spine its slot picks (`sim.cluster_spray`), whichever the
        route's hash picked; other traffic keeps ECMP's hash."""
        self.spraying = on
        self._steer()

    def _steer(self):
        """(Re)write the spraying filters for the spines that are up now."""
        t = self.topology
        live = [s for s in range(t.spines) if s not in self.cut] if self.spraying else []
        for leaf in range(t.leaves):
            cluster_spray.steer(self.leaf(leaf), live, t.spines, cluster_spray.CONTRIBUTIONS)
        cluster_spray.steer(self.rack, live, t.spines, cluster_spray.RESULTS)

    # --- using it -------------------------------------------------------------------------

    def uplinks(self) -> list[list[Counters]]:
        """What crossed each leaf's uplink to each spine so far (`[leaf][spine]`): sent is
        up, received is down."""
        t = self.topology
        return [[C.link_counters((self.leaf(leaf), f"s{spine}"), (self.spine(spine), f"l{leaf}"))
                 for spine in range(t.spines)] for leaf in range(t.leaves)]

    def cut_spine(self, spine: int, up: bool = False):
        """Take spine `spine`'s links down at every leaf and at the switch (or bring them up):
        the leaves' and the switch's routes then leave it out."""
        ends = [(self.leaf(leaf), f"s{spine}") for leaf in range(self.topology.leaves)]
        C.set_links(ends + [(self.rack, f"s{spine}")], up)
        (self.cut.discard if up else self.cut.add)(spine)
        if self.spraying:
            self._steer()


def _up(ns, device: str) -> int:
    index = ns.link_lookup(ifname=device)[0]
    ns.link("set", index=index, state="up")
    return index


def _sysctl(namespace: str, values: dict[str, str]):
    """Set the network sysctls `values` (``net.ipv4.ip_forward``: ``1``) of `namespace`: a
    process in it writes them under /proc/sys/net, which is its namespace's."""
    code = ("import sys\nfor kv in sys.argv[1:]:\n    k, v = kv.split('=')\n"
            "    open('/proc/sys/' + k.replace('.', '/'), 'w').write(v)")
    subprocess.run(netns.command(namespace, [sys.executable, "-c", code,
                                             *(f"{k}={v}" for k, v in values.items())]),
                   check=True)
