"""`netagg sim serve`: a simulated switch on a UDP socket, reached exactly as a board is.

Each datagram that arrives (BTH .. ICRC) becomes an Ethernet frame (`wire.wrap_datagram`:
canonical IPv4/UDP headers, source = the sender's address, destination = the address the
datagram was sent to with UDP port 4791, whatever port the server listens on) and goes into
the backend on switch port

    switch_port_for(sender IPv4, sender UDP port, ports) = (IPv4 as an integer + UDP port) % ports

(`host.transport.switch_port_for`; a worker writes that port into its job-table entry, so
results leave the switch on the port its requests came in by). Then the backend runs, and
each frame it sends goes out as a datagram to the frame's destination IPv4 address and UDP
port. `--pcap FILE` writes every frame in and out; Wireshark dissects them as RoCEv2 (UDP port
4791; for results, sent to the worker's own UDP port, use "Decode As... RoCE").

The datagram's IPv4 TOS byte (read with `IP_RECVTOS`) gives the frame its DSCP, so a worker's
priority classes reach the switch's priority drop as over a real network.

Backends: `golden` (sim.golden.GoldenSwitch) and `rtl` (sim.model, the Verilator model, when
it exists).
"""

from __future__ import annotations

import select
import signal
import socket
import struct
import sys
import threading
import time

from host import transport as T
from host import wire as W

IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8 if sys.platform.startswith("linux") else None)
IP_RECVTOS = getattr(socket, "IP_RECVTOS", 13 if sys.platform.startswith("linux") else None)
BACKENDS = ("golden", "rtl")


def make_backend(name: str = "golden", **params):
    """A switch backend by name; `params` as GoldenSwitch's (ports, jobs, max_workers, slots)."""
    if name == "golden":
        from sim.golden import GoldenSwitch
        return GoldenSwitch(**params)
    if name == "rtl":
        try:
            from sim import model
        except ImportError as e:
            raise SystemExit("the RTL backend (sim/model.py, the Verilator model with its C++ "
                             f"cycle loop) is not available yet ({e}); use --backend golden") \
                from None
        return model.make_switch(**params)      # hook: sim.model provides make_switch
    raise ValueError(f"unknown backend {name!r}: {', '.join(BACKENDS)}")


class SimServer:
    """A backend behind a UDP socket. `serve()` runs until `stop()`; `start()` runs it in a
    thread. `address` is the (host, port) it listens on (port 0 picks a free one)."""

    def __init__(self, backend, host: str = "127.0.0.1", port: int = W.ROCEV2_PORT,
                 pcap: str | None = None, ports: int | None = None):
        self.backend = backend
        self.ports = ports or getattr(backend, "ports", 4)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)
            except OSError:
                pass
        self.sock.bind((host, port))
        self.address = self.sock.getsockname()
        self.bound_ip = self.address[0]
        self.pktinfo = False
        if IP_PKTINFO is not None and self.bound_ip == "0.0.0.0":
            try:
                self.sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
                self.pktinfo = True
            except OSError:
                pass
        self.recvtos = False
        if IP_RECVTOS is not None:
            try:
                self.sock.setsockopt(socket.IPPROTO_IP, IP_RECVTOS, 1)
                self.recvtos = True
            except OSError:
                pass
        self.sock.setblocking(False)
        self.pcap = None
        if pcap:
            from scapy.utils import PcapWriter
            self.pcap = PcapWriter(pcap, linktype=1, sync=False)
        self.stats = {"datagrams_in": 0, "datagrams_out": 0, "undeliverable": 0}
        self._stop = threading.Event()
        self._thread = None
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.address[0] == "0.0.0.0" else self.address[0]
        return f"udp://{host}:{self.address[1]}"

    def _recv(self):
        """(datagram, sender, destination IPv4, DSCP)."""
        if self.pktinfo or self.recvtos:
            data, anc, _, addr = self.sock.recvmsg(
                4096, socket.CMSG_SPACE(12) + socket.CMSG_SPACE(4))
            dst, tos = self.bound_ip, 0
            for level, kind, payload in anc:
                if level != socket.IPPROTO_IP:
                    continue
                if kind == IP_PKTINFO and len(payload) >= 12:
                    dst = socket.inet_ntoa(payload[8:12])
                elif kind == socket.IP_TOS and payload:
                    tos = payload[0]
            return data, addr, dst, tos >> 2
        data, addr = self.sock.recvfrom(4096)
        return data, addr, self.bound_ip, 0

    def poll(self, timeout: float = 0.05) -> int:
        """Take what has arrived (waiting up to `timeout` for the first datagram), run the
        backend, send what it sent. Returns the number of datagrams taken."""
        busy = getattr(self.backend, "busy", False)     # the RTL may still hold results
        r, _, _ = select.select([self.sock], [], [], 0 if busy else timeout)
        if not r:
            if busy:
                with self.lock:
                    self._deliver(self._advance())
            return 0
        taken = 0
        with self.lock:
            for _ in range(512):
                try:
                    data, (ip, port), dst_ip, dscp = self._recv()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    continue
                taken += 1
                src = W.Endpoint(ip, port, 0x020000000000 | (W.ip_to_int(ip) & 0xFFFF) << 16
                                 | port)
                dst = W.Endpoint(dst_ip, W.ROCEV2_PORT, 0)
                frame = W.wrap_datagram(src, dst, data, dscp)
                if self.pcap:
                    self.pcap.write(frame)
                self.backend.send(T.switch_port_for(ip, port, self.ports), frame)
            self.stats["datagrams_in"] += taken
            self._deliver(self._advance())
        return taken

    def _advance(self):
        """Let the switch work: the RTL a slice of time at a time (results go out while it
        works, as from a board), the golden model until it is done."""
        advance = getattr(self.backend, "advance", None)
        return advance() if advance else self.backend.run()

    def _deliver(self, frames):
        """Send each frame the switch sent as a datagram to its destination."""
        for _port, frame in frames:
            if self.pcap:
                self.pcap.write(frame)
            try:
                _, dst, datagram = W.strip_frame(frame)
                self.sock.sendto(datagram, (dst.ip, dst.port))
                self.stats["datagrams_out"] += 1
            except (OSError, struct.error):
                self.stats["undeliverable"] += 1

    def serve(self):
        while not self._stop.is_set():
            self.poll(0.05)

    def start(self) -> SimServer:
        self._thread = threading.Thread(target=self.serve, name="netagg-sim-serve", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.sock.close()
        if self.pcap:
            self.pcap.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def serve_main(backend: str = "golden", host: str = "0.0.0.0", port: int = W.ROCEV2_PORT,
               pcap: str | None = None, **params):
    from rich.console import Console
    console = Console(stderr=True)
    server = SimServer(make_backend(backend, **params), host, port, pcap)
    console.print(f"netagg sim serve: {backend} switch with {server.ports} ports on "
                  f"udp://{server.address[0]}:{server.address[1]}"
                  + (f", writing {pcap}" if pcap else ""))
    console.print("a sender (ip, udp port) enters switch port (ip as an integer + udp port) "
                  f"% {server.ports}")
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: server._stop.set())
    try:
        server.serve()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        s = server.stats
        console.print(f"{s['datagrams_in']} datagrams in, {s['datagrams_out']} out in "
                      f"{time.monotonic() - t0:.1f} s")
    return 0
