"""Transports: how a worker's packets reach the switch and come back.

A transport moves datagrams: the UDP payload of a RoCEv2 packet, BTH .. ICRC, the ICRC
computed over the IPv4 and UDP headers the datagram travels with (`wire`'s canonical headers
from the path's source address to the switch's). It knows the worker's own address (`local`,
what the job table's per-worker entry must hold), the switch port its frames enter
(`switch_port`, which the switch itself tells: REG_PORT, read by a control request), and
returns only datagrams whose ICRC checked out (the others are counted in `bad`).

- `InProcessTransport`: a backend object (`send(port, frame)` / `run()`) shared by the workers
  of one process through an `InProcessHub`, which runs the backend and hands each output frame
  to the worker it is addressed to. The frame carries the packet's DSCP. Its frames enter
  switch port `switch_port_for(ip, udp_port, ports)`, the cabling of the simulation.
- `UdpTransport` (`udp://host:port`): UDP sockets to a board, `netagg sim board` or
  `netagg sim serve`, sent from one local address and never connected (see the class). The
  datagram is the BTH .. ICRC; the ICRC covers the IPv4/UDP headers Linux sends
  (`netagg.contract.wire`'s canonical headers: identification 0, DF) with the socket's address as
  source and the switch's as destination. The packet's DSCP (its priority class) goes into the IPv4
  TOS byte of the datagram (`IP_TOS`, set on the socket when it changes; the ICRC masks it).
- `host.lossy.LossyTransport`: wraps another with loss, duplication and reordering.

A send the OS refuses because the way to the switch is gone (no route, the link or the
address down: `UNREACHABLE`) is a `NetaggUnreachable` naming the switch and the OS's reason,
at once (the engine and the worker add which rank of which job); one it refuses for a
moment (a full buffer: `PASSING`) is a lost packet, which retransmission recovers.

Batches: `send_batch` sends a step's contributions together. Over UDP, datagrams of one
length, path and DSCP leave as runs through the kernel's segmentation offload (`GSO`, in
`netagg.host.udp_offload`: each segment's ICRC rewritten for the IPv4 identification the kernel
gives it, its index in the run), and results come back as runs where the kernel merges
them (`UDP_GRO`).

Spraying: a transport has `paths` source addresses (path 0 is `local`, where results and
control answers come back; path i > 0 is another UDP source port of the same IPv4 address:
another socket over UDP, `local.port + i` in process). `send(pkt, path)` sends a packet from
path `path`'s address (the packet's ICRC is computed for it), so in `netagg sim serve` it
may enter another switch port, and in a real network it hashes onto another ECMP path. The
engine picks the path per packet (`Sprayer`). Control requests always leave by path 0: the
switch answers the address a request came from.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
import urllib.parse
import weakref

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.contract.wire import CONTROL_FIRST_BYTE
from netagg.contract.wire_icrc import IcrcCheck
from netagg.host import netif, udp_offload
from netagg.host.errors import NetaggError, NetaggUnreachable
from netagg.host.ticks import WallClock
from netagg.host.udp_socket import IP_MTU_DISCOVER, IP_PMTUDISC_DO, request_on, switch_port_for

SWITCH_IP = "10.0.0.1"          # the switch's address for in-process workers


SPRAY_POLICIES = ("round_robin", "least_loaded")

# A send's errno that says the way to the switch is gone, and what it suggests.
LINK_DOWN = "is this host's link down?"
UNREACHABLE = {
    errno.ENETUNREACH: LINK_DOWN,
    errno.ENETDOWN: LINK_DOWN,
    errno.EHOSTUNREACH: "is the switch's host down, or its address wrong?",
    errno.EHOSTDOWN: "is the switch's host down?",
    errno.EADDRNOTAVAIL: "is {local} an address of this host?",
    errno.EPERM: "does a firewall on this host refuse it?",
}
# A send's errno that passes: the packet is lost, as on a congested link.
PASSING = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.EINTR})


def unreachable(e: OSError, switch: str, local: str) -> NetaggUnreachable | None:
    """The `NetaggUnreachable` an OS error of a send (or of the route or bind before it)
    from `local` to `switch` ("ip:port") stands for; None if it says nothing of the way."""
    hint = UNREACHABLE.get(e.errno)
    if hint is None:
        return None
    reason = e.strerror or os.strerror(e.errno)
    return NetaggUnreachable(switch, f"{reason} ({hint.format(local=local)})", e.errno)


class Sprayer:
    """Picks the path of each packet: `round_robin`, or `least_loaded` (the path with the
    fewest packets outstanding, i.e. sent and not yet answered by a result; ties go round
    robin). The caller reports `sent(path)` and `answered(path)`."""

    def __init__(self, paths: int = 1, policy: str = "round_robin"):
        if paths < 1:
            raise ValueError(f"paths must be at least 1, not {paths}")
        if policy not in SPRAY_POLICIES:
            raise ValueError(f"spray must be one of {', '.join(SPRAY_POLICIES)}, not {policy!r}")
        self.paths, self.policy = paths, policy
        self.outstanding = [0] * paths
        self.next = 0

    def pick(self) -> int:
        n = self.paths
        if n == 1:
            return 0
        start = self.next
        if self.policy == "least_loaded":
            path = min(range(start, start + n), key=lambda i: self.outstanding[i % n]) % n
        else:
            path = start
        self.next = (path + 1) % n
        return path

    def sent(self, path: int):
        self.outstanding[path] += 1

    def answered(self, path: int):
        if self.outstanding[path] > 0:
            self.outstanding[path] -= 1


class Transport:
    local: W.Endpoint          # the worker's address as the switch sees it
    switch: W.Endpoint         # where contributions and control requests go
    switch_port: int | None    # the switch port the worker's frames enter (None: not known)
    driver = None              # an InProcessHub drives all its workers from one thread
    paths = 1                  # source addresses packets may be sprayed over
    duplicates = False         # whether a packet may arrive twice (control.CONTROL_LIFETIME)

    def __init__(self):
        self.bad = 0               # packets dropped here: bad ICRC, malformed
        self.result_source = W.Endpoint("0.0.0.0", R.UDP_SPORT_RESET)

    def send(self, datagram: bytes, path: int = 0, dscp: int = 0):
        """Send a datagram (BTH .. ICRC, its ICRC for path `path`'s source address) from path
        `path` with DSCP `dscp` (its priority class; the ICRC masks it)."""
        raise NotImplementedError

    def send_batch(self, datagrams: list, paths: list[int], dscps: list[int]):
        """Send datagrams as `send` does, each from its path with its DSCP (a step's
        contributions: the transport may send runs of them in one go)."""
        for datagram, path, dscp in zip(datagrams, paths, dscps):
            self.send(datagram, path, dscp)

    def path_endpoints(self) -> list[W.Endpoint]:
        """The source address of each path (path 0 is `local`)."""
        return [self.local]

    def attach_switch(self, ports: int, port: int):
        """The switch, of `ports` ports, says that path 0's requests enter its port `port`
        (REG_PORT): note it (the worker's job-table entry names it), and where the transport
        can, spread the other paths over other ports."""
        self.switch_port = port

    def recv(self, timeout: float) -> list[bytes]:
        """Datagrams that arrived, their ICRC checked; waits up to `timeout` seconds for the
        first one."""
        raise NotImplementedError

    def close(self):
        pass


class InProcessHub:
    """The workers of one process around one backend. Every call holds one lock, so workers
    may run in threads or be driven cooperatively from one thread (`drive`)."""

    def __init__(self, backend):
        self.backend = backend
        self.lock = threading.RLock()
        self.endpoints: dict[tuple[str, int], InProcessTransport] = {}
        self.engines = []          # progress functions of the attached workers
        self.misrouted = 0
        self.clock = WallClock(backend)     # the deadlines' ticks
        self.driving = False       # in `drive`: receives that do not wait leave it the run

    def attach(self, transport):
        with self.lock:
            key = (transport.local.ip, transport.local.port)
            if key in self.endpoints:
                raise ValueError(f"two in-process workers at {key}")
            self.endpoints[key] = transport

    def detach(self, transport):
        with self.lock:
            self.endpoints.pop((transport.local.ip, transport.local.port), None)
            self.engines = [e for e in self.engines if getattr(e, "transport", None)
                            is not transport]

    def pump(self):
        with self.lock:
            for port, frame in self.run_backend() + self.clock.catch_up():
                try:
                    _, dst, _ = W.strip_frame(frame)
                except Exception:
                    self.misrouted += 1
                    continue
                t = self.endpoints.get((dst.ip, dst.port))
                if t is None or not self.reaches(t, port):
                    self.misrouted += 1
                    continue
                t.inbox.append(frame)

    def run_backend(self) -> list[tuple[int, bytes]]:
        """The backend's frames out (and its work on what it was sent)."""
        return self.backend.run()

    @staticmethod
    def reaches(transport, port: int) -> bool:
        """Whether a frame out of backend port `port` reaches `transport` (its own port's)."""
        return transport.switch_port is None or transport.switch_port == port

    def drive(self):
        """One step of every attached worker's engine (cooperative progress), then one run of
        the backend with what they all sent (their receives take what the last run left). An
        engine's failure is its own (`Engine.failed`, which its worker's waits raise); a
        failed engine only keeps its heartbeat."""
        with self.lock:
            outer, self.driving = self.driving, True
            try:
                self._step_engines()
            finally:
                self.driving = outer
            self.pump()

    def _step_engines(self):
        for engine in list(self.engines):
            if engine.failed:
                engine.liveness.keep_beating()
                continue
            try:
                engine.step(0.0)
            except NetaggError:
                pass                    # kept in engine.failed
            except Exception as e:      # the engine's own fault: its worker's waits raise
                engine.failed = engine.failed or e


_HUBS: weakref.WeakValueDictionary[int, InProcessHub] = weakref.WeakValueDictionary()


def hub_for(backend, kind: type[InProcessHub] = InProcessHub) -> InProcessHub:
    """The one hub (of `kind`) of a backend object, while its transports hold it: the last
    one gone, the hub and the backend it holds may go too."""
    if isinstance(backend, InProcessHub):
        return backend
    hub = _HUBS.get(id(backend))
    if hub is None or hub.backend is not backend or type(hub) is not kind:
        hub = _HUBS[id(backend)] = kind(backend)
    return hub


def worker_ip(job: int, rank: int) -> str:
    """The IPv4 address rank `rank` of switch job `job` sends from in process (a UDP
    worker's is its socket's): 10.(1 + job).(rank // 250).(rank % 250 + 1)."""
    return f"10.{1 + job}.{rank // 250}.{rank % 250 + 1}"


class InProcessTransport(Transport):
    """Frames from (ip, udp_port) enter switch port `switch_port_for(ip, udp_port, ports)`,
    unless `switch_port` says otherwise; path i > 0 sends from UDP port `udp_port + i` of the
    same address and enters `switch_port_for(ip, udp_port + i, ports)`."""

    def __init__(self, backend, ip: str, udp_port: int = W.ROCEV2_PORT, mac: int = 0,
                 switch_port: int | None = None, switch_ip: str = SWITCH_IP, paths: int = 1):
        super().__init__()
        if paths < 1:
            raise ValueError(f"paths must be at least 1, not {paths}")
        self.hub = hub_for(backend)
        self.driver = self.hub
        self.local = W.Endpoint(ip, udp_port, mac)
        self.switch = W.Endpoint(switch_ip, W.ROCEV2_PORT, 0)
        self.paths = paths
        self._sources = [W.Endpoint(ip, (udp_port + i) & 0xFFFF, mac) for i in range(paths)]
        ports = getattr(self.hub.backend, "ports", 1)
        self._ports = [switch_port_for(e.ip, e.port, ports) for e in self._sources]
        if switch_port is not None:
            self._ports[0] = switch_port
        self.switch_port = self._ports[0]
        self.inbox: list[bytes] = []
        self.hub.attach(self)

    def path_endpoints(self) -> list[W.Endpoint]:
        return list(self._sources)

    def send(self, datagram: bytes, path: int = 0, dscp: int = 0):
        port = self._ports[path] if path else self.switch_port
        frame = W.wrap_datagram(self._sources[path], self.switch, datagram, dscp)
        with self.hub.lock:
            self.hub.backend.send(port, frame)

    def recv(self, timeout: float) -> list[bytes]:
        with self.hub.lock:
            if timeout > 0 or not self.hub.driving:     # (a wait runs it, even in a drive)
                self.hub.pump()
            frames, self.inbox = self.inbox, []
        out = []
        for frame in frames:
            try:
                body, ip_udp = W.frame_datagram(frame)
            except W.WireError:
                self.bad += 1
                continue
            if W.icrc_holds(body, ip_udp):
                out.append(body)
            else:
                self.bad += 1
        if not out and timeout > 0:
            time.sleep(min(timeout, 0.0005))
        return out

    def close(self):
        self.hub.detach(self)


def parse_udp_url(url: str) -> tuple[str, int]:
    u = urllib.parse.urlparse(url)
    if u.scheme != "udp" or not u.hostname:
        raise ValueError(f"a switch address is udp://host:port, not {url!r}")
    return u.hostname, u.port or W.ROCEV2_PORT


class UdpTransport(Transport):
    """UDP sockets that reach the switch (a board, `netagg sim board` or `netagg sim serve`)
    from one local IPv4 address, `bind_ip` or the one the kernel routes the switch by.

    The sockets are not connected: a board sends results from its own UDP source port
    (REG_UDP_SPORT), which a connected socket would refuse, and Linux fills the IPv4
    identification of an unconnected socket's datagrams with 0 when Don't Fragment is set
    (IP_PMTUDISC_DO): the canonical header the ICRC is computed over. Datagrams are taken only
    from the switch: control answers from its address and port, results from `result_source`
    (the switch's REG_IP and REG_UDP_SPORT, set by the worker once it has read them); anything
    else is counted in `stray`, and a bad ICRC in `bad`. `local.mac` is the MAC of the
    interface that holds the address (0 on loopback).

    With `paths` > 1, `paths - 1` more sockets of the same address send only (other source
    ports: other ECMP paths in a network, other switch ports in `netagg sim serve`).

    `gso` (the default, unless the environment sets NETAGG_GSO=0): `send_batch` sends runs
    through the kernel's segmentation offload, and the receiving socket takes runs the
    kernel merged (`netagg.host.udp_offload`); False sends and receives one datagram a call (for a
    NIC whose segmentation offload numbers the IPv4 identification otherwise)."""

    def __init__(self, url: str, bind_ip: str | None = None, bind_port: int = 0,
                 paths: int = 1, gso: bool | None = None):
        super().__init__()
        if paths < 1:
            raise ValueError(f"paths must be at least 1, not {paths}")
        host, port = parse_udp_url(url)
        addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        self._addr = addr
        self._bind_ip = bind_ip
        try:
            self._bind_ip = bind_ip or route_source(addr)
            self.sock = self._open(bind_port, rcvbuf=True)
        except OSError as e:
            self._refused(e, passing=False)
        ip, lport = self.sock.getsockname()
        itf = netif.interface_of(ip)
        self.local = W.Endpoint(ip, lport, itf.mac if itf else 0)
        self.switch = W.Endpoint(addr[0], addr[1], 0)
        self.switch_port = None
        self.icrc = IcrcCheck(self.local)     # the ICRC check of what it receives
        self.url = url
        self.paths = paths
        self.stray = 0
        self.socks = [self.sock] + [self._open(0) for _ in range(paths - 1)]
        self._sources = [self.local] + [self._source(s) for s in self.socks[1:]]
        self._tos = [0] * paths     # the TOS byte each path's socket sends with
        if gso is None:
            gso = os.environ.get("NETAGG_GSO", "1") != "0"
        self.runs = udp_offload.GsoSender(addr, gso)
        self._gro = gso and udp_offload.enable_gro(self.sock)

    def _refused(self, e: OSError, passing: bool = True):
        """A send (or the route or bind before it) the OS refused with `e`: a lost packet
        if the error passes (with `passing`), `NetaggUnreachable` if it says the way to the
        switch is gone, else `e` itself."""
        if passing and e.errno in PASSING:
            return
        gone = unreachable(e, f"{self._addr[0]}:{self._addr[1]}", self._bind_ip or "?")
        if gone is None:
            raise e
        raise gone from e

    def _open(self, bind_port: int, rcvbuf: bool = False) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        sock.bind((self._bind_ip, bind_port))
        sock.setblocking(False)
        return sock

    def _source(self, sock) -> W.Endpoint:
        ip, port = sock.getsockname()
        return W.Endpoint(ip, port, self.local.mac)

    def path_endpoints(self) -> list[W.Endpoint]:
        return list(self._sources)

    def attach_switch(self, ports: int, port: int):
        """Also ask, for each path socket, the switch port its requests enter (REG_PORT), and
        re-open a path socket (a few times) while it enters a port another path uses, as far
        as there are ports: in `netagg sim serve` source ports map to switch ports; on a
        board cabled to one port every path enters that one."""
        self.switch_port = port
        used = {port}
        for i in range(1, self.paths):
            for attempt in range(8):
                try:
                    entered = self.ingress_port(self.socks[i], self._sources[i])
                except OSError as e:
                    self._refused(e, passing=False)
                if entered not in used or len(used) >= ports or attempt == 7:
                    used.add(entered)
                    break
                self.socks[i].close()
                self.socks[i] = self._open(0)
                self._tos[i] = 0
                self._sources[i] = self._source(self.socks[i])

    def ingress_port(self, sock, source: W.Endpoint, tries: int = 5) -> int:
        """REG_PORT as read by a control request from `sock` (its answer comes back there)."""
        [(_, port)] = request_on(sock, self._addr, source, self.switch, [(R.REG_PORT, 0)],
                                 tries=tries)
        return port

    def send(self, datagram: bytes, path: int = 0, dscp: int = 0):
        self.set_dscp(path, dscp)
        try:
            self.socks[path].sendto(datagram, self._addr)
        except OSError as e:
            self._refused(e)

    def send_batch(self, datagrams: list, paths: list[int], dscps: list[int]):
        size = len(datagrams[0])
        if paths.count(paths[0]) == len(paths) and dscps.count(dscps[0]) == len(dscps) \
                and all(len(d) == size for d in datagrams):
            self.set_dscp(paths[0], dscps[0])       # (a step's usual batch: one run)
            try:
                self.runs.send(self.socks[paths[0]], datagrams)
            except OSError as e:
                self._refused(e)
            return
        runs: dict[tuple[int, int, int], list] = {}
        for datagram, path, dscp in zip(datagrams, paths, dscps):
            runs.setdefault((path, dscp, len(datagram)), []).append(datagram)
        for (path, dscp, _), run in runs.items():
            self.set_dscp(path, dscp)
            try:
                self.runs.send(self.socks[path], run)
            except OSError as e:
                self._refused(e)

    def set_dscp(self, path: int, dscp: int):
        """Path `path`'s socket sends with DSCP `dscp` from now on (set only if it
        changes)."""
        tos = (dscp & 0x3F) << 2
        if self._tos[path] != tos:
            self.socks[path].setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
            self._tos[path] = tos

    def recv(self, timeout: float) -> list[bytes]:
        out = []
        if timeout > 0:
            select.select([self.sock], [], [], timeout)
        accept, gro = self.accept, self._gro
        recvmsg, ancillary = self.sock.recvmsg, udp_offload.gro_ancillary()
        for _ in range(256):
            try:
                data, anc, _, sender = recvmsg(65536 if gro else 2048, ancillary)
            except (BlockingIOError, InterruptedError):
                break
            out += accept(data, anc and udp_offload.segment_size(anc), sender)
        return out

    def accept(self, data: bytes, size: int | None, sender: tuple[str, int]) -> list:
        """The datagrams of one buffer the socket received from `sender` (a run of
        `size`-byte datagrams, or one datagram) that are the switch's and whose ICRC holds;
        the others counted as stray or bad."""
        if size and len(data) > size:
            if sender != (self.result_source.ip, self.result_source.port):
                self.stray += -(-len(data) // size)
                return []
            good, bad = self.icrc.run(data, size, sender)
            self.bad += bad
            return good
        switch = (self.switch.ip, self.switch.port)
        if sender != (switch if data[:1] == CONTROL_FIRST_BYTE else
                      (self.result_source.ip, self.result_source.port)):
            self.stray += 1
        elif self.icrc.holds(data, sender):
            return [data]
        else:
            self.bad += 1
        return []

    def close(self):
        for sock in self.socks:
            sock.close()


def route_source(addr) -> str:
    """The local IPv4 address the kernel sends from to `addr` ((host, port))."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(addr)
        return probe.getsockname()[0]
    finally:
        probe.close()
