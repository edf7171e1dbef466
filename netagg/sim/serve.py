"""`netagg sim serve`: a simulated switch on a UDP socket, as strict on the wire as a board.

The server listens on UDP port 4791 of one IPv4 address (`--host`; a free 127.x.y.z when
none is given, so that several servers can run on one machine), as a board does. Each
datagram that arrives becomes an Ethernet frame for the backend:

- with CAP_NET_RAW (root), from the IPv4 and UDP headers exactly as received (a packet
  socket sees them, `udp.arrivals_socket`): the switch checks the ICRC over the
  identification, flags and addresses the sender's kernel really sent, as a board does;
- without it, from the canonical headers (`wire.wrap_datagram`: identification 0, DF) with
  the sender's and the server's addresses, and the DSCP read with `IP_RECVTOS`.

The frame enters switch port `switch_port_for(sender IPv4, sender UDP port, ports)`
(`sim.udp_socket.switch_port_for`: the cabling of the simulation; the switch reports it to
the sender as REG_PORT). Then the backend runs, and each frame it sends leaves as a datagram
from the address and UDP port the frame names as its source (control answers from the
server's port 4791, results from the switch's REG_IP and REG_UDP_SPORT) to the address and
port it names as destination, as from a board; a frame whose source this machine cannot
send from is counted as undeliverable. `--pcap FILE` writes every frame in and out;
Wireshark dissects them as RoCEv2 (results, which go from UDP port 49152 to the worker's own
port, with Decode As: `-d udp.port==49152,infiniband` for tshark).

What waits is read as runs of frames (`sim.udp_runs`): what one sender sent one after the
other in datagrams of one length, a run of datagrams a sender's kernel sent in one buffer
(UDP segmentation offload, `netagg.host.udp_offload`) cut where that kernel cut it, by the segment
size it reports, never by what the packet's own headers claim: a datagram is one frame, as
on a board's wire, and one whose RETH DMA length disagrees with its payload is dropped and
counted as `drop_bad_payload`. A backend that takes runs (`send_run`: the echo and fast
switches) is given each run whole and answers it at once, its results going out before the
next run is taken (and the reader waits up to `udp_runs.LINGER` for the rest of a window
after a run as long as one can be); the others are given the run's frames one at a time.

What the backend sends leaves as runs too: the datagrams of one source, destination and
length (a backend's `FrameRun`, or frames gathered from one call) in one call each
(`udp_offload.GsoSender`), to any address. Their ICRCs stay as the switch made them, for the
canonical IPv4 header (identification 0, as a board sends every frame): the receivers of
what a switch sends, a worker's transport and a control client, read UDP sockets, which
never see the identification, and check every datagram's ICRC over that header, so ICRCs
rewritten for the identifications the kernel gives a run's segments would fail their check
(all segments but the first). On loopback a run arrives whole; over a wire the kernel may
cut it, each segment with identification 0, 1, ...: a capture there shows the ICRC of
identification 0 on each.

A frame the backend raises on (a bug a hostile frame finds) is logged (logger
`netagg.sim.serve`) and counted (`stats["backend_errors"]`, in the closing line), the frames
of that call lost; the server goes on (`Serving`, the loop it shares with
`sim.topology_serve`).

`netagg sim serve --topology LxS` serves a leaf and spine fabric instead, one server of this
kind per switch (`sim.topology_serve`).

Backends: `golden` (sim.golden.GoldenSwitch), `rtl` (sim.model, the Verilator model),
`echo` (sim.echo.EchoSwitch: each contribution answered at once to its sender, for
measurements) and `fast` (sim.fast.FastSwitch: the golden model with its common
contribution compiled, the switch that keeps up with an emulated wire). The golden model,
the fast switch and the RTL tick their deadlines' clock by the wall clock (`netagg.host.ticks`),
between the frames they take.
"""

from __future__ import annotations

import errno
import logging
import random
import select
import signal
import socket
import struct
import sys
import threading
import time

from netagg.contract import wire as W
from netagg.host import udp_offload, udp_socket
from netagg.host.ticks import WallClock
from netagg.host.udp_offload import FrameRun
from netagg.sim import udp
from netagg.sim.fast import FastSwitch
from netagg.sim.fast_build import Served
from netagg.sim.fast_io import FastIo
from netagg.sim.udp_runs import LINGER, RunReader

IP_RECVTOS = getattr(socket, "IP_RECVTOS", 13 if sys.platform.startswith("linux") else None)
BACKENDS = ("golden", "rtl", "echo", "fast")
BURST = 32          # frames the golden model (no time of its own, no runs) takes between sends


def make_backend(name: str = "golden", **params):
    """A switch backend by name; `params` as GoldenSwitch's (ports, jobs, max_workers, slots)."""
    if name == "golden":
        from netagg.sim.golden import GoldenSwitch
        return GoldenSwitch(**params)
    if name == "echo":
        from netagg.sim.echo import EchoSwitch
        return EchoSwitch(**params)
    if name == "fast":
        from netagg.sim.fast import FastSwitch
        return FastSwitch(**params)
    if name == "rtl":
        from netagg.sim import model
        return model.make_switch(**params)
    raise ValueError(f"unknown backend {name!r}: {', '.join(BACKENDS)}")


def _bind_loopback(host: str | None) -> socket.socket:
    """A UDP socket on port 4791 of `host`, or of a free 127.x.y.z when `host` is None."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if host is not None:
        sock.bind((host, W.ROCEV2_PORT))
        return sock
    rng = random.Random()
    for _ in range(64):
        ip = f"127.{rng.randrange(1, 255)}.{rng.randrange(0, 256)}.{rng.randrange(1, 255)}"
        try:
            sock.bind((ip, W.ROCEV2_PORT))
            return sock
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
    raise OSError("no free loopback address with UDP port 4791 after 64 tries")


log = logging.getLogger("netagg.sim.serve")


class Serving:
    """A serving loop: `serve()` polls until `stop()`, `start()` serves in a thread, and a
    frame on which the backend raises is logged and counted (`stats["backend_errors"]`),
    its exception kept from stopping the loop (`guarded`): a hostile frame must not stop
    the simulated switch."""

    thread_name = "netagg-sim-serve"

    def __init__(self):
        self.stats = {"datagrams_in": 0, "datagrams_out": 0, "undeliverable": 0,
                      "backend_errors": 0}
        self._stop = threading.Event()
        self._thread = None

    def poll(self, timeout: float = 0.05):
        raise NotImplementedError

    def close(self):
        """Free what the server holds (after its loop stopped)."""

    def guarded(self, call, *args):
        """`call(*args)`'s frames, or none when the backend raises (logged and counted; the
        frames it had made in that call are lost, as on a lossy link)."""
        try:
            return call(*args)
        except Exception as e:
            self.stats["backend_errors"] += 1
            log.warning("%s: the backend raised %s: %s (frames of this call dropped; %d so "
                        "far)", self.thread_name, type(e).__name__, e,
                        self.stats["backend_errors"])
            return []

    def serve(self):
        while not self._stop.is_set():
            self.poll(0.05)

    def start(self):
        self._thread = threading.Thread(target=self.serve, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class SimServer(Serving):
    """A backend behind UDP port 4791 of `host`. `serve()` runs until `stop()`; `start()`
    runs it in a thread. `address` is the (ip, 4791) it listens on. `as_received`: build
    frames from the IPv4 headers as received where a packet socket can be opened (else, and
    with False, from the canonical ones)."""

    def __init__(self, backend, host: str | None = None, pcap: str | None = None,
                 ports: int | None = None, as_received: bool = True):
        super().__init__()
        self.backend = backend
        self.ports = ports or getattr(backend, "ports", 4)
        self.sock = _bind_loopback(host)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)
        self.address = self.sock.getsockname()
        self.bound_ip = self.address[0]
        if IP_RECVTOS is not None:
            self.sock.setsockopt(socket.IPPROTO_IP, IP_RECVTOS, 1)
        udp_offload.enable_gro(self.sock)
        self._runs = udp_offload.GsoSender(renumber=False)
        self.sock.setblocking(False)
        # sees the datagrams as they arrive, their IPv4 headers as received and a run's
        # segment size as the sender's kernel cut it (CAP_NET_RAW: `udp.arrivals_socket`)
        self.raw = None
        self._udp_copies = False    # the UDP socket queues the datagrams the packet socket has
        if as_received:
            try:
                self.raw = udp.arrivals_socket(W.ip_packed(self.bound_ip))
            except PermissionError:
                pass
        if self.raw is not None:    # the UDP socket's copies: not kept at all
            self._udp_copies = not udp.attach_filter(self.sock, udp.NOTHING)
        self.senders: dict[tuple[str, int], socket.socket | None] = {
            tuple(self.address): self.sock}
        self._routes: dict[bytes, tuple] = {}   # addresses and ports of a frame -> its route
        self.reader = RunReader(self.sock, self.raw, self.bound_ip, self.ports,
                                LINGER if hasattr(backend, "send_run") else 0.0,
                                self._udp_copies)
        self.pcap = None
        if pcap:
            from scapy.utils import PcapWriter
            self.pcap = PcapWriter(pcap, linktype=1, sync=False)
        self.unsendable: set[tuple[str, int]] = set()
        self.clock = WallClock(backend)         # the deadlines' ticks
        self.lock = threading.Lock()
        # the fast switch's socket loop compiled, for the frames as received (not captured)
        self.fast_io = FastIo(backend, self.raw, self._route, self.unsendable) \
            if isinstance(backend, FastSwitch) and self.raw is not None and not pcap else None

    @property
    def url(self) -> str:
        return f"udp://{self.bound_ip}:{self.address[1]}"

    @property
    def headers_as_received(self) -> bool:
        """Whether frames carry the IPv4 headers as received (else the canonical ones)."""
        return self.raw is not None

    def poll(self, timeout: float = 0.05) -> int:
        """Take what has arrived (waiting up to `timeout` for the first datagram), run the
        backend, send what it sent. Returns the number of datagrams taken."""
        busy = getattr(self.backend, "busy", False)     # the RTL may still hold results
        watch = [self.raw if self.raw is not None else self.sock]
        r, _, _ = select.select(watch, [], [], 0 if busy else timeout)
        guarded = self.guarded
        if self.fast_io is not None:
            with self.lock:
                self.deliver(guarded(self.clock.catch_up))
                return self._serve_compiled() if r else 0
        if not r:
            with self.lock:
                self.deliver(guarded(self.clock.catch_up))
                if busy:
                    self.deliver(guarded(self._advance))
            return 0
        taken = 0
        with self.lock:
            self.deliver(guarded(self.clock.catch_up))
            send, pcap = self.backend.send, self.pcap
            send_run = getattr(self.backend, "send_run", None)
            burst = BURST if not hasattr(self.backend, "advance") else 0
            for port, heads, body, size in self.reader.runs():
                if pcap:
                    for i, head in enumerate(heads):
                        pcap.write(head + body[i * size:(i + 1) * size])
                if send_run is not None:        # the run at once, its results out at once
                    guarded(send_run, port, heads, body, size)
                    taken += len(heads)
                    self.deliver(guarded(self._advance))
                    continue
                for i, head in enumerate(heads):
                    taken += 1
                    guarded(send, port, head + body[i * size:(i + 1) * size])
                    if taken == burst:      # the first results go out while the rest wait
                        self.deliver(guarded(self._advance))
                        burst += BURST
            self.stats["datagrams_in"] += taken
            self.deliver(guarded(self._advance))
        return taken

    def _serve_compiled(self) -> int:
        """What waits through the fast switch's compiled loop, the packets it hands back
        the Python way (`_take_handed`); the datagrams taken."""
        io, counts = self.fast_io, self.fast_io.counts()
        if self._udp_copies:
            self.reader.drop_udp_copies()
        taken = 0
        while True:
            why = io.serve()
            if why == Served.HANDBACK:
                taken += self._take_handed(*io.handed())
            elif why == Served.BUDGET:
                self.deliver(self.guarded(self.clock.catch_up))
            else:
                break
        after = io.counts()
        for name in ("datagrams_out", "undeliverable"):
            self.stats[name] += after[name] - counts[name]
        self.stats["send_buffer_full"] = after["dropped"]
        taken += after["datagrams_in"] - counts["datagrams_in"]
        self.stats["datagrams_in"] += taken
        return taken

    def _take_handed(self, packet, segment: int, row: int) -> int:
        """A packet the compiled loop handed back (a run of `segment`-byte datagrams, 0: one
        datagram), from row `row` of its frames (-1: all of it, its sender learnt), the
        Python way: that row through the golden model, the rest as a run. The datagrams the
        loop did not count (all of a packet it did not cut)."""
        ingress = self.reader.ingress(packet)
        if row < 0 and ingress:
            self.fast_io.learn(packet, *ingress)
        skip, golden, guarded = max(row, 0), row >= 0, self.guarded
        uncounted = 0
        for port, heads, body, size in self.reader.packet_pieces(packet, segment, ingress):
            uncounted += len(heads) if row < 0 else 0
            if skip >= len(heads):
                skip -= len(heads)
                continue
            if golden:
                frame = heads[skip] + bytes(body[skip * size:(skip + 1) * size])
                guarded(self.backend.golden, port, frame)
                skip, golden = skip + 1, False
            if skip < len(heads):
                guarded(self.backend.send_run, port, heads[skip:], body[skip * size:], size)
            skip = 0
        self.deliver(guarded(self._advance))
        return uncounted

    def _advance(self):
        """Let the switch work: the RTL a slice of time at a time (results go out while it
        works, as from a board), the golden model until it is done."""
        advance = getattr(self.backend, "advance", None)
        if advance is not None:
            return advance()
        sent_runs = getattr(self.backend, "sent_runs", None)
        return sent_runs() if sent_runs is not None else self.backend.run()

    def _sender(self, source: tuple[str, int]) -> socket.socket | None:
        """A socket that sends from `source`, or None where this machine cannot."""
        if source not in self.senders:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.IPPROTO_IP, udp_socket.IP_MTU_DISCOVER,
                            udp_socket.IP_PMTUDISC_DO)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            try:
                sock.bind(source)
            except OSError:
                sock.close()
                sock = None
            self.senders[source] = sock
        return self.senders[source]

    def _route(self, addresses: bytes):
        """((source IPv4, UDP port), socket that sends from it or None, destination) of a
        frame by its `addresses`: IPv4 source and destination, UDP source and destination
        port, as in the frame."""
        route = self._routes.get(addresses)
        if route is None:
            if len(self._routes) >= 4096:
                self._routes.clear()
            src, dst, sport, dport = struct.unpack("!4s4sHH", addresses)
            source = (W.ip_text(src), sport)
            route = self._routes[addresses] = (source, self._sender(source),
                                               (W.ip_text(dst), dport))
        return route

    def deliver(self, frames):
        """Send each frame the switch sent as a datagram from its source to its destination,
        the datagrams of one source, destination and length as runs (GSO, each datagram's
        ICRC as made: see the module). A `FrameRun` leaves as one run (after the frames
        before it)."""
        stats, pcap, route = self.stats, self.pcap, self._route
        runs: dict[tuple, list] = {}
        for item in frames:
            if isinstance(item, FrameRun):
                self._send_runs(runs)
                runs = {}
                self._deliver_run(item)
                continue
            _port, frame = item
            if pcap:
                pcap.write(frame)
            if len(frame) < W.UDP_OFFSET + 4:
                stats["undeliverable"] += 1
                continue
            source, sock, dst = route(frame[W.IP_OFFSET + 12:W.UDP_OFFSET + 4])
            if sock is None:
                stats["undeliverable"] += 1
                self.unsendable.add(source)
                continue
            end = W.ETH_LEN + (frame[W.IP_OFFSET + 2] << 8 | frame[W.IP_OFFSET + 3])
            datagram = memoryview(frame)[W.BTH_OFFSET:end]
            runs.setdefault((sock, dst, len(datagram)), []).append(datagram)
        self._send_runs(runs)

    def _send_runs(self, runs: dict):
        """The runs `deliver` gathered, by (socket, destination, length)."""
        stats = self.stats
        for (sock, dst, _), run in runs.items():
            try:
                self._runs.send(sock, run, dst)
                stats["datagrams_out"] += len(run)
            except OSError:
                stats["undeliverable"] += len(run)

    def _deliver_run(self, run: FrameRun):
        """A run of frames to one destination, as one GSO run."""
        stats, count = self.stats, len(run)
        if self.pcap:
            for _, frame in run.frames():
                self.pcap.write(frame)
        source, sock, dst = self._route(run.head[W.IP_OFFSET + 12:W.UDP_OFFSET + 4])
        if sock is None:
            stats["undeliverable"] += count
            self.unsendable.add(source)
            return
        try:
            self._runs.send_joined(sock, run.body, run.size, dst)
            stats["datagrams_out"] += count
        except OSError:
            stats["undeliverable"] += count

    def close(self):
        for sock in {*self.senders.values(), self.sock, self.raw} - {None}:
            sock.close()
        if self.pcap:
            self.pcap.close()


def serve_main(backend: str = "golden", host: str | None = None, pcap: str | None = None,
               **params):
    from rich.console import Console
    console = Console(stderr=True)
    if host == "0.0.0.0":
        console.print("netagg sim serve: give the one address the switch has (--host "
                      "127.0.0.1, say), as a board has one, not 0.0.0.0")
        return 2
    server = SimServer(make_backend(backend, **params), host, pcap)
    print(server.url, flush=True)
    console.print(f"netagg sim serve: {backend} switch with {server.ports} ports on "
                  f"{server.url}" + (f", writing {pcap}" if pcap else ""))
    console.print("a sender (ip, udp port) enters switch port (ip as an integer + udp port) "
                  f"% {server.ports}; IPv4 headers "
                  + ("as received (packet socket)" if server.headers_as_received else
                     "canonical (identification 0, DF): CAP_NET_RAW checks them as received"))
    t0 = time.monotonic()
    # SIGTERM stops it as Ctrl-C does: an exception in the serving loop (a handler that set
    # the stop Event could deadlock on the Event's own lock, taken when the signal came)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.serve()
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):     # stopping is not interrupted again
            signal.signal(sig, signal.SIG_IGN)
        server.stop()
        s = server.stats
        console.print(f"{s['datagrams_in']} datagrams in, {s['datagrams_out']} out, "
                      f"{s['undeliverable']} undeliverable, {s['backend_errors']} frames the "
                      f"backend raised on in {time.monotonic() - t0:.1f} s")
        for ip, port in sorted(server.unsendable):
            console.print(f"frames from {ip}:{port} (the switch's REG_IP, REG_UDP_SPORT) could "
                          "not be sent: not an address of this machine")
    return 0
