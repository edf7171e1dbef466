"""Transports: how a worker's packets reach the switch and come back.

A transport moves `wire.Packet`s. It knows the worker's own address (`local`, what the job
table's per-worker entry must hold), the switch port its frames enter (`switch_port`), and
returns only packets whose ICRC checked out (the others are counted in `bad`).

- `InProcessTransport`: a backend object (`send(port, frame)` / `run()`) shared by the workers
  of one process through an `InProcessHub`, which runs the backend and hands each output frame
  to the worker it is addressed to. The frame carries the packet's DSCP.
- `UdpTransport` (`udp://host:port`): a UDP socket to a board or to `netagg sim serve`. The
  datagram is the BTH .. ICRC; the ICRC covers the canonical IPv4/UDP headers of `host.wire`
  with the worker's address as source and (server address, 4791) as destination, whatever UDP
  port the server listens on. The packet's DSCP (its priority class) goes into the IPv4 TOS
  byte of the datagram (`IP_TOS`, set on the socket when it changes; the ICRC masks it).
- `LossyTransport`: wraps another and drops, duplicates and delays (reorders) packets in each
  direction, for tests.

Spraying: a transport has `paths` source addresses (path 0 is `local`, where results and
control answers come back; path i > 0 is another UDP source port of the same IPv4 address:
another socket over UDP, `local.port + i` in process). `send(pkt, path)` sends a packet from
path `path`'s address (the packet's ICRC is computed for it), so in `netagg sim serve` it
enters switch port `switch_port_for(ip, path's UDP port, ports)`, and in a real network it
hashes onto another ECMP path. The engine picks the path per packet (`Sprayer`). Control
requests always leave by path 0: the switch answers the address a request came from.

The switch port of a sender, used by `netagg sim serve` and by a worker filling its job-table
entry: `switch_port_for(ip, udp_port, ports) = (IPv4 address as an integer + UDP port) % ports`.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
import select
import socket
import threading
import time
import urllib.parse

from host import wire as W

SWITCH_IP = "10.0.0.1"          # the switch's address for in-process workers


def switch_port_for(ip: str, udp_port: int, ports: int) -> int:
    """The switch port that frames from (ip, udp_port) enter, in `netagg sim serve`."""
    return (W.ip_to_int(ip) + udp_port) % ports


SPRAY_POLICIES = ("round_robin", "least_loaded")


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
    switch_port: int | None    # the switch port the worker's frames enter (None: ask)
    driver = None              # an InProcessHub drives all its workers from one thread
    paths = 1                  # source addresses packets may be sprayed over

    def __init__(self):
        self.bad = 0               # packets dropped here: bad ICRC, malformed
        self.result_source = W.Endpoint("0.0.0.0", 0xC000)

    def send(self, pkt: W.Packet, path: int = 0):
        raise NotImplementedError

    def path_endpoints(self) -> list[W.Endpoint]:
        """The source address of each path (path 0 is `local`)."""
        return [self.local]

    def attach_switch(self, ports: int) -> int:
        """The switch has `ports` ports: note the switch port of the worker's frames (the one
        its job-table entry names) and spread the paths over switch ports. Returns it."""
        self.switch_port = switch_port_for(self.local.ip, self.local.port, ports)
        return self.switch_port

    def recv(self, timeout: float) -> list[W.Packet]:
        """Packets that arrived; waits up to `timeout` seconds for the first one."""
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
            for port, frame in self.backend.run():
                try:
                    _, dst, _ = W.strip_frame(frame)
                except Exception:
                    self.misrouted += 1
                    continue
                t = self.endpoints.get((dst.ip, dst.port))
                if t is None or (t.switch_port is not None and t.switch_port != port):
                    self.misrouted += 1
                    continue
                t.inbox.append(frame)

    def drive(self):
        """One step of every attached worker's engine (cooperative progress)."""
        with self.lock:
            for engine in list(self.engines):
                engine.step(0.0)


_HUBS: dict[int, InProcessHub] = {}


def hub_for(backend) -> InProcessHub:
    """The one hub of a backend object."""
    if isinstance(backend, InProcessHub):
        return backend
    hub = _HUBS.get(id(backend))
    if hub is None or hub.backend is not backend:
        hub = _HUBS[id(backend)] = InProcessHub(backend)
    return hub


class InProcessTransport(Transport):
    """Path i > 0 sends from UDP port `udp_port + i` of the same address and enters switch
    port `switch_port_for(ip, udp_port + i, ports)` (as `netagg sim serve` would map it)."""

    def __init__(self, backend, ip: str, udp_port: int = W.ROCEV2_PORT, mac: int = 0,
                 switch_port: int = 0, switch_ip: str = SWITCH_IP, paths: int = 1):
        super().__init__()
        if paths < 1:
            raise ValueError(f"paths must be at least 1, not {paths}")
        self.hub = hub_for(backend)
        self.driver = self.hub
        self.local = W.Endpoint(ip, udp_port, mac)
        self.switch = W.Endpoint(switch_ip, W.ROCEV2_PORT, 0)
        self.switch_port = switch_port
        self.paths = paths
        self._sources = [W.Endpoint(ip, (udp_port + i) & 0xFFFF, mac) for i in range(paths)]
        self._ports = [switch_port] * paths
        self.inbox: list[bytes] = []
        self.hub.attach(self)

    def path_endpoints(self) -> list[W.Endpoint]:
        return list(self._sources)

    def attach_switch(self, ports: int) -> int:
        super().attach_switch(ports)
        self._ports = [switch_port_for(e.ip, e.port, ports) for e in self._sources]
        return self.switch_port

    def send(self, pkt: W.Packet, path: int = 0):
        if path:
            pkt = dataclasses.replace(pkt, src=self._sources[path])
            port = self._ports[path]
        else:
            port = self.switch_port
        frame = pkt.frame()
        with self.hub.lock:
            self.hub.backend.send(port, frame)

    def recv(self, timeout: float) -> list[W.Packet]:
        with self.hub.lock:
            self.hub.pump()
            frames, self.inbox = self.inbox, []
        out = []
        for frame in frames:
            try:
                out.append(W.parse_frame(frame))
            except W.WireError:
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
    """A UDP socket connected to the switch (a board or `netagg sim serve`), and with
    `paths` > 1, `paths - 1` more sockets of the same address that only send (other source
    ports: other switch ports in `netagg sim serve`, other ECMP paths in a network). Results
    and control answers come back to the first socket."""

    def __init__(self, url: str, bind_ip: str = "", bind_port: int = 0, paths: int = 1):
        super().__init__()
        if paths < 1:
            raise ValueError(f"paths must be at least 1, not {paths}")
        host, port = parse_udp_url(url)
        addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        self._addr, self._bind_ip = addr, bind_ip
        self.sock = self._open(bind_port, rcvbuf=True)
        ip, lport = self.sock.getsockname()
        self.local = W.Endpoint(ip, lport, 0)
        self.switch = W.Endpoint(addr[0], W.ROCEV2_PORT, 0)
        self.switch_port = None
        self.url = url
        self.paths = paths
        self.socks = [self.sock] + [self._open(0) for _ in range(paths - 1)]
        self._sources = [self.local] + [self._source(s) for s in self.socks[1:]]
        self._tos = {}              # socket -> the TOS byte it sends with

    def _open(self, bind_port: int, rcvbuf: bool = False) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        sock.bind((self._bind_ip, bind_port))
        sock.connect(self._addr)
        sock.setblocking(False)
        return sock

    def _source(self, sock) -> W.Endpoint:
        ip, port = sock.getsockname()
        if ip != self.local.ip:      # the switch checks a rank's source address
            raise OSError(f"a path socket got source address {ip}, not {self.local.ip}")
        return W.Endpoint(ip, port, 0)

    def path_endpoints(self) -> list[W.Endpoint]:
        return list(self._sources)

    def attach_switch(self, ports: int) -> int:
        """Also re-open path sockets until the paths enter different switch ports of
        `netagg sim serve` (as far as there are ports; the kernel picks the source ports)."""
        super().attach_switch(ports)
        used = {self.switch_port}
        spare = []
        for i in range(1, self.paths):
            if len(used) >= ports:
                break
            for _ in range(64):
                sp = switch_port_for(self._sources[i].ip, self._sources[i].port, ports)
                if sp not in used:
                    used.add(sp)
                    break
                spare.append(self.socks[i])
                self.socks[i] = self._open(0)
                self._sources[i] = self._source(self.socks[i])
        for sock in spare:
            sock.close()
        return self.switch_port

    def send(self, pkt: W.Packet, path: int = 0):
        if path:
            pkt = dataclasses.replace(pkt, src=self._sources[path])
        sock = self.socks[path]
        tos = (pkt.dscp & 0x3F) << 2
        if self._tos.get(sock, 0) != tos:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
            self._tos[sock] = tos
        try:
            sock.send(pkt.datagram())
        except (BlockingIOError, ConnectionRefusedError):
            pass        # a full buffer or nobody listening yet: as a lost packet

    def recv(self, timeout: float) -> list[W.Packet]:
        out = []
        if timeout > 0:
            select.select([self.sock], [], [], timeout)
        for _ in range(256):
            try:
                data = self.sock.recv(2048)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionRefusedError:      # ICMP from an earlier send: nobody there
                continue
            src = self.switch if data[:1] == bytes([W.OP_CONTROL]) else self.result_source
            try:
                out.append(W.parse_transport(data, src, self.local))
            except W.WireError:
                self.bad += 1
        return out

    def close(self):
        for sock in self.socks:
            sock.close()


class LossyTransport(Transport):
    """Another transport with loss: each packet, in each direction, is dropped with `drop`,
    sent twice with `duplicate`, and held back by a random delay up to `max_delay` seconds
    with `reorder` (so packets behind it overtake it). Seeded: the same seed, the same faults.
    `path_delay`: packets sprayed over path i are held back `i * path_delay` seconds more
    (paths of different lengths, so that a message's packets arrive out of order)."""

    def __init__(self, inner: Transport, drop: float = 0.0, duplicate: float = 0.0,
                 reorder: float = 0.0, max_delay: float = 0.005, seed: int = 0,
                 path_delay: float = 0.0):
        super().__init__()
        self.inner = inner
        self.local, self.switch, self.switch_port = inner.local, inner.switch, inner.switch_port
        self.driver = inner.driver
        self.paths = inner.paths
        self.drop, self.duplicate, self.reorder, self.max_delay = drop, duplicate, reorder, \
            max_delay
        self.path_delay = path_delay
        self.rng = random.Random(seed)
        self._out, self._in = [], []           # heaps of (due, n, packet)
        self._n = 0
        self.faults = {"dropped": 0, "duplicated": 0, "delayed": 0}

    @property
    def result_source(self):
        return self.inner.result_source

    @result_source.setter
    def result_source(self, value):
        if hasattr(self, "inner"):
            self.inner.result_source = value

    def path_endpoints(self) -> list[W.Endpoint]:
        return self.inner.path_endpoints()

    def attach_switch(self, ports: int) -> int:
        self.switch_port = self.inner.attach_switch(ports)
        return self.switch_port

    def _fault(self, heap, pkt, now, extra: float = 0.0):
        if self.rng.random() < self.drop:
            self.faults["dropped"] += 1
            return
        copies = 1
        if self.rng.random() < self.duplicate:
            self.faults["duplicated"] += 1
            copies = 2
        for _ in range(copies):
            due = now + extra
            if self.rng.random() < self.reorder:
                self.faults["delayed"] += 1
                due += self.rng.uniform(0, self.max_delay)
            self._n += 1
            heapq.heappush(heap, (due, self._n, pkt))

    def _flush(self, now):
        while self._out and self._out[0][0] <= now:
            self.inner.send(*heapq.heappop(self._out)[2])

    def send(self, pkt: W.Packet, path: int = 0):
        now = time.monotonic()
        self._fault(self._out, (pkt, path), now, path * self.path_delay)
        self._flush(now)

    def recv(self, timeout: float) -> list[W.Packet]:
        now = time.monotonic()
        self._flush(now)
        if self._in or self._out:
            nxt = min(h[0][0] for h in (self._in, self._out) if h)
            timeout = max(0.0, min(timeout, nxt - now))
        for pkt in self.inner.recv(timeout):
            self._fault(self._in, pkt, time.monotonic())
        now = time.monotonic()
        self._flush(now)
        out = []
        while self._in and self._in[0][0] <= now:
            out.append(heapq.heappop(self._in)[2])
        return out

    @property
    def bad(self):
        return getattr(self, "inner", None) and self.inner.bad or 0

    @bad.setter
    def bad(self, value):
        pass

    def close(self):
        self.inner.close()
