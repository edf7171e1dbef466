"""The emulated rack: hosts as network namespaces on shaped links, a top-of-rack bridge, and
netagg's switch on a port of its own, made of the kernel's own networking.

    host i (namespace NAME-hI): eth0 10.77.0.(10+i)/24 ─── shaped link ───┐
                                                                           │ port hI
    rack (namespace NAME-sw):   bridge br0 10.77.0.1/24 ◄──────────────────┘
                                └─ the bridge's own port: netagg's switch (`sim serve`)

Each host has one NIC, one end of a veth pair whose other end is a port of the rack's Linux
bridge; both ends' egress is shaped to the link's rate with a queue of its own (the port's
`queue` bytes, the NIC's 1000 frames: `sim.cluster_links`), so each direction of each host's
link is a wire of that rate.
The bridge forwards ordinary traffic between the hosts (gloo's TCP, torchrun's rendezvous) as
a top-of-rack switch does; netagg's switch serves on the bridge's own address, the port the
bridge hands to its own stack, which is not shaped: the switch's port carries every host's
traffic, as a switch's own fabric does. Every host's traffic to the switch and back crosses
the host's link once each way, and so does every byte of a ring.

`Cluster` is a context manager: entering makes the namespaces, links, queues and addresses
and starts a guard process; leaving ends every process in them and removes them all. The
guard (`python -m netagg.sim.cluster_guard`) removes them too when the process that made them
dies without leaving (SIGKILL, a crash): it waits on a pipe the maker holds. Everything it
makes is named NAME-...: it refuses to start where any such namespace exists, saying how to
remove them (`netagg cluster down --name NAME`, `remove`). It needs root (CAP_SYS_ADMIN and
CAP_NET_ADMIN); without it `Cluster` raises `NeedsRoot` with one line that says so.

`run` starts a program in a host's namespace (or the rack's), `serve` starts the switch there
at a higher priority than the hosts' processes (`SWITCH_NICE`): it stands for a switch of its
own, as the bridge does, whose forwarding runs in the kernel ahead of every process,
`counters` reads what crossed each host's NIC, `set_link` takes a host's link down or up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import os
import re
import select
import subprocess
import sys
import time

from netagg.sim import netns
from netagg.sim.cluster_links import NIC_QUEUE, Counters, Shape

SUBNET = ipaddress.IPv4Network("10.77.0.0/24")
RACK_IP = SUBNET[1]             # the bridge's address: netagg's switch serves on it
FIRST_HOST = 10                 # host i is SUBNET[FIRST_HOST + i]
MAX_HOSTS = 64
NAME_PATTERN = re.compile(r"[a-z][a-z0-9]{0,11}")
# The switch's slots per version: each of its 4 jobs' 64 slots keep a worker's window of 64
# uses (70 KB of frames) in flight, 5.6 ms of a 100 Mb/s link: more than a round trip through
# the hosts' and the switch's scheduling, and within a port's queue (10 ms), so that the
# results of a window completing at once never overflow it.
SWITCH_SLOTS = 256
# A dilated cluster's hosts' scheduling is D times shorter against its links, and its switch
# (the RTL) no faster than them: a window D times smaller covers the round trip, and a larger
# one only queues at the switch, past the retransmission timers (which are not dilated).
MIN_SLOTS = 64
# The switch's process's nice value: on a machine whose cores the hosts share, a switch
# process waiting behind them for its turn holds every host's window at once.
SWITCH_NICE = -10


class NeedsRoot(PermissionError):
    """The cluster needs root: namespaces, veths, bridges and queues."""


class ClusterError(RuntimeError):
    """The cluster cannot be made or used as asked (a name taken, a switch that did not
    start); the message says what and what to do."""


LOCK = "/run/netagg-cluster.lock"


@contextlib.contextmanager
def _netlink_lock():
    """Clusters are made and removed one at a time on a machine (a file lock): namespaces,
    veths and their peers made by two processes at once raced."""
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def namespaces(name: str) -> list[str]:
    """The namespaces of cluster `name` that exist now."""
    pattern = re.compile(rf"{re.escape(name)}-(sw|h\d+|l\d+|s\d+)")  # (l, s: a fabric's)
    try:
        return sorted(p.name for p in netns.RUN_DIR.iterdir() if pattern.fullmatch(p.name))
    except FileNotFoundError:
        return []


def remove(name: str) -> list[str]:
    """End every process in cluster `name`'s namespaces and remove them (their links,
    queues and addresses go with them); the namespaces removed."""
    from pyroute2 import netns as pyroute_netns
    found = namespaces(name)
    netns.kill_all(found)
    with _netlink_lock():
        for ns in found:
            try:
                pyroute_netns.remove(ns)
            except OSError:
                pass
    return found


def set_features(namespace: str, device: str, features: dict[str, bool]):
    """Turn `device`'s offload features (ethtool's names: ``rx-gro``) on or off in
    `namespace`."""
    from pyroute2 import netns as pyroute_netns
    from pyroute2.ethtool import Ethtool
    pyroute_netns.pushns(namespace)
    try:
        ethtool = Ethtool()
        found = ethtool.get_features(device)
        for name, on in features.items():
            found.features[name].enable = on
        ethtool.set_features(device, found)
        ethtool.close()
    finally:
        pyroute_netns.popns()


# GRO on a NIC, as a NIC has it: a veth then coalesces the datagrams of a flow that arrive
# together, and a socket with UDP_GRO takes them as one run (without it, each of a host's
# 11,000 datagrams a second at 100 Mb/s is a system call of the switch's).
RECEIVE_OFFLOAD = {"rx-gro": True}


@dataclasses.dataclass(frozen=True)
class Host:
    """Host `index` of the cluster: its namespace and address."""

    index: int
    namespace: str
    ip: str


class Cluster:
    """`hosts` hosts on links of `rate` (``100mbit``) with `queue` bytes of queue each way
    (`Shape.of`), named `name`. Made on entering, removed on leaving.

    `dilation` D > 1 slows time D-fold for a switch slower than the wire (the RTL in
    Verilator): the links run at `rate` / D with the queue in bytes of the link at `rate`, so
    everything takes D times as long as at `rate` and every ratio of times stays as it is."""

    def __init__(self, hosts: int = 4, rate: str | int = "100mbit", queue=None,
                 name: str = "nagg", dilation: float = 1.0):
        if not 2 <= hosts <= MAX_HOSTS:
            raise ValueError(f"a cluster has 2..{MAX_HOSTS} hosts, not {hosts}")
        if not NAME_PATTERN.fullmatch(name):
            raise ValueError(f"a cluster's name is 1..12 lower-case letters and digits, "
                             f"beginning with a letter, not {name!r}")
        if dilation < 1:
            raise ValueError(f"dilation slows time (D >= 1), not {dilation}")
        undilated = Shape.of(rate, queue)
        self.name, self.dilation = name, dilation
        self.shape = Shape.of(int(undilated.rate / dilation), undilated.queue)
        self.rack = f"{name}-sw"
        self.hosts = [Host(i, f"{name}-h{i}", str(SUBNET[FIRST_HOST + i]))
                      for i in range(hosts)]
        self.switch_ip = str(RACK_IP)
        self.processes: list[subprocess.Popen] = []
        self.switch: subprocess.Popen | None = None     # netagg's switch, once `serve` starts it
        self._guard = None

    # --- up and down --------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(self, *exc):
        self.down()

    def up(self):
        if os.geteuid() != 0:
            raise NeedsRoot("netagg cluster needs root: it makes network namespaces, links "
                            "and queues")
        taken = namespaces(self.name)
        if taken:
            raise ClusterError(f"cluster {self.name!r} is already up or was left behind "
                               f"({', '.join(taken)}): `netagg cluster down --name "
                               f"{self.name}` removes it")
        self._guard = subprocess.Popen(
            [sys.executable, "-m", "netagg.sim.cluster_guard", self.name],
            stdin=subprocess.PIPE, start_new_session=True)
        try:
            with _netlink_lock():
                self._make()
        except BaseException:
            self.down()
            raise

    def down(self):
        """End every process in the cluster and remove everything it made."""
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        remove(self.name)
        for proc in self.processes:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.processes.clear()
        if self._guard is not None:
            self._guard.stdin.close()       # nothing left for it: it exits
            try:
                self._guard.wait(10)
            except subprocess.TimeoutExpired:
                self._guard.kill()
                self._guard.wait()
            self._guard = None

    def _make(self):
        from pyroute2 import NetNS
        from pyroute2 import netns as pyroute_netns
        for ns in (self.rack, *(h.namespace for h in self.hosts)):
            pyroute_netns.create(ns)
        with NetNS(self.rack) as rack:
            rack.link("set", index=rack.link_lookup(ifname="lo")[0], state="up")
            rack.link("add", ifname="br0", kind="bridge")
            bridge = rack.link_lookup(ifname="br0")[0]
            rack.addr("add", index=bridge, address=self.switch_ip, prefixlen=SUBNET.prefixlen)
            rack.link("set", index=bridge, state="up")
            for h in self.hosts:
                port_name = f"h{h.index}"
                rack.link("add", ifname=port_name, kind="veth",
                          peer={"ifname": "eth0", "net_ns_fd": h.namespace})
                port = rack.link_lookup(ifname=port_name)[0]
                rack.link("set", index=port, master=bridge)
                rack.tc("add", "tbf", index=port, handle="1:", **self.shape.tc())
                rack.link("set", index=port, state="up")
                with NetNS(h.namespace) as host:
                    host.link("set", index=host.link_lookup(ifname="lo")[0], state="up")
                    nic = host.link_lookup(ifname="eth0")[0]
                    host.addr("add", index=nic, address=h.ip, prefixlen=SUBNET.prefixlen)
                    host.tc("add", "tbf", index=nic, handle="1:",
                            **self.shape.with_queue(max(NIC_QUEUE, self.shape.queue)).tc())
                    host.link("set", index=nic, state="up")
        for namespace, device in [(self.rack, f"h{h.index}") for h in self.hosts] + \
                [(h.namespace, "eth0") for h in self.hosts]:
            set_features(namespace, device, RECEIVE_OFFLOAD)

    # --- using it ------------------------------------------------------------------------

    def run(self, where: int | str, argv: list[str], **popen) -> subprocess.Popen:
        """Start `argv` in host `where`'s namespace (an index), or the rack's ("rack"); it is
        ended when the cluster goes down."""
        namespace = self.rack if where == "rack" else self.hosts[where].namespace
        proc = subprocess.Popen(netns.command(namespace, argv), **popen)
        self.processes.append(proc)
        return proc

    def serve(self, backend: str = "fast", timeout: float = 120.0, **params) -> str:
        """Start netagg's switch (`netagg sim serve --backend ...`) on the rack's own port,
        with a job table for every host (`params`: its other options, as ``max_workers=8``);
        its udp:// URL once it listens."""
        params.setdefault("max_workers", max(8, len(self.hosts)))
        params.setdefault("slots", max(MIN_SLOTS, int(SWITCH_SLOTS / self.dilation)))
        argv = [sys.executable, "-m", "netagg.apps.cli", "sim", "serve", "--backend", backend,
                "--host", self.switch_ip]
        for key, value in params.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        proc = self.run("rack", argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                        text=True)
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline().strip() if ready else ""
        if not line.startswith("udp://"):
            raise ClusterError(f"the {backend} switch did not start in {self.rack} "
                               f"(exit status {proc.poll()}, said {line!r})")
        self.switch = proc
        os.setpriority(os.PRIO_PROCESS, proc.pid, SWITCH_NICE)
        return line

    @property
    def switch_pid(self) -> int | None:
        return self.switch.pid if self.switch else None

    def port(self, host: Host) -> tuple[str, str]:
        """The namespace and device of the far end of host `host`'s link: the rack's port."""
        return self.rack, f"h{host.index}"

    def counters(self) -> list[Counters]:
        """What crossed each host's NIC so far, and what its link dropped: both ends' queues,
        and both veths (a peer whose receive ring was full, under load)."""
        return [link_counters((h.namespace, "eth0"), self.port(h)) for h in self.hosts]

    def set_link(self, host: int, up: bool):
        """Take host `host`'s link down (its NIC and the rack's port) or bring it up."""
        h = self.hosts[host]
        set_links([(h.namespace, "eth0"), self.port(h)], up)


def link_counters(near: tuple[str, str], far: tuple[str, str]) -> Counters:
    """What left and entered the device `near` (namespace, device) of a link whose other end
    is `far`, and what the link dropped: both ends' queues, and both veths (a peer whose
    receive ring was full, under load)."""
    from pyroute2 import NetNS
    stats, drops = [], 0
    for namespace, device in (near, far):
        with NetNS(namespace) as ns:
            index = ns.link_lookup(ifname=device)[0]
            stats.append(ns.link("get", index=index)[0].get("IFLA_STATS64"))
            queues = [q.get("TCA_STATS2") for q in ns.get_qdiscs(index=index)
                      if q.get("TCA_KIND") in ("tbf", "htb")]
            queue = queues[0].get("TCA_STATS_QUEUE") if queues and queues[0] else None
            drops += queue["drops"] if queue else 0
    own = stats[0]
    dropped = sum(s[k] for s in stats for k in ("rx_dropped", "tx_dropped"))
    return Counters(own["tx_bytes"], own["rx_bytes"], own["tx_packets"], own["rx_packets"],
                    drops + dropped)


def set_links(ends: list[tuple[str, str]], up: bool):
    """Take the devices `ends` (namespace, device) down or bring them up."""
    from pyroute2 import NetNS
    for namespace, device in ends:
        with NetNS(namespace) as ns:
            ns.link("set", index=ns.link_lookup(ifname=device)[0],
                    state="up" if up else "down")
    if up:
        time.sleep(0.05)        # the addresses' routes come back with the link
