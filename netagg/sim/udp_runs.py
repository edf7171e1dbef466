"""What the UDP socket of a simulated switch (`sim.serve`) received, as runs of frames.

`RunReader.runs` takes what waits, from the server's packet socket (`udp.arrivals_socket`:
the IPv4 headers as received, with CAP_NET_RAW) or from its UDP socket (the canonical
headers, the DSCP read with `IP_RECVTOS`), and gives it as runs: the frames of what one
sender sent one after the other in datagrams of one length, each frame its Ethernet, IPv4
and UDP headers (`W.BTH_OFFSET` bytes, the sender's MAC standing for it) and its datagram,
the run's datagrams one after the other in one buffer. A GSO run is cut where the sender's
kernel cut it (the segment size the kernel reports: the packet socket's virtio_net_hdr, the
UDP socket's UDP_GRO), each segment with the headers the kernel gives it, never where the
packet's own headers claim; a datagram is one frame whatever its RETH says (a DMA length
that disagrees is the switch's `drop_bad_payload`). A worker's window of 64 contributions
of 1,060 bytes
comes as a GSO run of 61 and one of 3 and is one run here. After a run as long as one can
be, the reader waits up to `linger` seconds for the rest of the window (the echo switch
answers a window at once), and, when such a wait saw nothing come, takes the next
`LINGER_OFF` full runs without one (a window whose rest comes with its next step), until
traffic pauses for `IDLE` seconds (a worker's next allreduce). Where a
packet enters the switch (`entry`) is cached by its sender's address and port.
"""

from __future__ import annotations

import functools
import select
import socket
import struct
import time

from netagg.contract import headers as H
from netagg.contract import wire as W
from netagg.host import udp_offload
from netagg.host.udp_socket import switch_port_for
from netagg.sim import udp

_SRC, _DST = H.IPV4.byte_offset("src"), H.IPV4.byte_offset("dst")   # in an IPv4 header
_PORTS_END = W.IP_LEN + 4       # the UDP ports' end, in a packet without IPv4 options

LINGER = 0.0002     # s a backend that takes runs waits for the rest of a window after a full run
LINGER_OFF = 32     # full runs taken without waiting after a wait nothing ended
IDLE = 0.002        # s without traffic after which the reader waits again
_ANCILLARY = udp_offload.gro_ancillary(socket.CMSG_SPACE(4))     # segment size and TOS
_IP_UDP = W.IP_LEN + W.UDP_LEN


def _sender_mac(ip: str, port: int) -> int:
    """A locally administered MAC standing for a UDP sender in the frames the backend sees."""
    return 0x020000000000 | (W.ip_to_int(ip) & 0xFFFF) << 16 | port


@functools.lru_cache(maxsize=4096)
def entry(ip: bytes, port: int, ports: int) -> tuple[bytes, int]:
    """The Ethernet header of frames from a UDP sender (IPv4 address bytes, port), and the
    switch port they enter."""
    text = W.ip_text(ip)
    eth = bytes(6) + _sender_mac(text, port).to_bytes(6, "big") + b"\x08\x00"
    return eth, switch_port_for(text, port, ports)


@functools.lru_cache(maxsize=256)
def _run_heads(eth: bytes, ip_udp: bytes, size: int, body: int) -> tuple[bytes, ...]:
    """The Ethernet, IPv4 and UDP headers of each frame of a run as received (IPv4 and UDP
    headers `ip_udp`, `body` bytes of datagrams of `size`) that enters with Ethernet header
    `eth`: those the kernel gives each segment (`udp_offload.segment_headers`)."""
    return tuple(eth + h for h in udp_offload.segment_headers(ip_udp, size, body))


@functools.lru_cache(maxsize=4096)
def _canonical_headers(ip: str, port: int, bound_ip: str, length: int, dscp: int) -> bytes:
    """The Ethernet, IPv4 and UDP headers of a frame for a datagram of `length` bytes from
    (ip, port) to the server, with the canonical IPv4 header (`wire.wrap_datagram`); those of
    datagram i of a run (GSO) are the kernel's for its segment i (`_run_heads`)."""
    src = W.Endpoint(ip, port, _sender_mac(ip, port))
    dst = W.Endpoint(bound_ip, W.ROCEV2_PORT, 0)
    return W.wrap_datagram(src, dst, bytes(length), dscp)[:W.BTH_OFFSET]


def _joined(bodies: list):
    return bodies[0] if len(bodies) == 1 else b"".join(bodies)


def _cut_run(port: int, heads: tuple, body: memoryview, size: int):
    """A run's datagrams of `size` bytes, and its shorter last one alone."""
    full = len(body) // size
    yield port, heads[:full], body[:full * size], size
    if len(body) > full * size:
        yield port, heads[full:], body[full * size:], len(body) - full * size


class RunReader:
    """Runs of frames from `sock` (the server's UDP socket on `bound_ip`, port 4791) or, when
    it is not None, `raw` (a packet socket that sees the datagrams to it,
    `udp.arrivals_socket`; `udp_copies`: the UDP socket queues them too, and its copies are
    dropped), each entering one of `ports` switch ports; `linger` seconds' wait after a full
    run (0: none)."""

    def __init__(self, sock, raw, bound_ip: str, ports: int, linger: float = 0.0,
                 udp_copies: bool = False):
        self.sock, self.raw, self.bound_ip, self.ports = sock, raw, bound_ip, ports
        self.linger, self.udp_copies = linger, udp_copies
        self._lingers_off, self._last = 0, 0.0
        self._senders_in: dict[bytes, tuple] = {}   # addresses and ports -> `_ingress_of`

    def runs(self):
        """(switch port, heads, datagrams, length) of each run of frames waiting, in order:
        frame i of a run is `heads[i]` (its Ethernet, IPv4 and UDP headers) and the `i`-th
        `length` bytes of `datagrams` (see the module)."""
        key, heads, bodies, full, waited = None, [], [], False, False
        watch = self.raw if self.raw is not None else self.sock
        now = time.monotonic()
        if now - self._last > IDLE:         # traffic again after a pause: wait again
            self._lingers_off = 0
        while True:
            for port, more, body, size in self._pieces():
                sender = (port, more[0][W.IP_OFFSET + 12:W.UDP_OFFSET + 2], size)
                if sender != key and heads:
                    yield key[0], tuple(heads), _joined(bodies), key[2]
                    heads, bodies = [], []
                key, full = sender, len(more) >= udp_offload.most_rows(size or 1)
                heads += more
                bodies.append(body)
            if not full or waited or not self.linger:
                break
            if self._lingers_off:
                self._lingers_off -= 1
                break
            waited = True               # once a poll
            if not select.select([watch], [], [], self.linger)[0]:
                self._lingers_off = LINGER_OFF
                break
        if heads:
            yield key[0], tuple(heads), _joined(bodies), key[2]
        self._last = time.monotonic()

    def _pieces(self):
        """(switch port, heads, datagrams, length) of each datagram or GSO run (of equal
        lengths) waiting, as `runs`."""
        if self.raw is not None:
            self.drop_udp_copies()
            for _ in range(512):
                try:
                    data = self.raw.recv(65536 + udp.ARRIVAL_HEAD)
                except (BlockingIOError, InterruptedError):
                    return
                yield from self.packet_pieces(*udp.arrival(data))
            return
        for _ in range(512):
            try:
                data, anc, _, (ip, sport) = self.sock.recvmsg(65536, _ANCILLARY)
            except (BlockingIOError, InterruptedError):
                return
            tos = next((p[0] for level, kind, p in anc
                        if level == socket.IPPROTO_IP and kind == socket.IP_TOS and p), 0)
            port = entry(W.ip_packed(ip), sport, self.ports)[1]
            size = udp_offload.segment_size(anc)
            if not size or len(data) <= size:
                size = len(data)
            head = _canonical_headers(ip, sport, self.bound_ip, size, tos >> 2)
            if not data:
                yield port, (head,), memoryview(data), 0
                continue
            heads = _run_heads(head[:W.IP_OFFSET], head[W.IP_OFFSET:], size, len(data))
            yield from _cut_run(port, heads, memoryview(data), size)

    def drop_udp_copies(self):
        """The UDP socket's copies of what the packet socket has (`udp_copies`), dropped."""
        while self.udp_copies:
            try:
                self.sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                break

    def ingress(self, packet: bytes) -> tuple[bytes, int] | tuple[()]:
        """The Ethernet header of the frames of an IPv4 packet as received and the switch
        port they enter, or () for a packet that is not a UDP datagram to this address and
        port 4791."""
        ingress = self._senders_in.get(packet[_SRC:_PORTS_END]) \
            if packet[0] == W.IPV4_FIRST_BYTE else None
        return self._ingress_of(packet) if ingress is None else ingress

    def packet_pieces(self, packet, segment: int,
                      ingress: tuple[bytes, int] | tuple[()] | None = None):
        """`_pieces` of one IPv4 packet as received (the packet socket's), holding a run cut
        every `segment` bytes (0: one datagram); `ingress` its `ingress`, where the caller
        has it."""
        ingress = self.ingress(packet) if ingress is None else ingress
        if not ingress:
            return
        eth, port = ingress
        body = memoryview(packet)[_IP_UDP:]
        if not segment or len(body) <= segment or packet[0] != W.IPV4_FIRST_BYTE:
            yield port, (eth + bytes(packet[:_IP_UDP]),), body, len(body)
            return
        heads = _run_heads(eth, bytes(packet[:_IP_UDP]), segment, len(body))
        yield from _cut_run(port, heads, body, segment)

    def _ingress_of(self, packet: bytes) -> tuple[bytes, int] | tuple[()]:
        """The Ethernet header of a frame for an IPv4 packet as received and the switch port
        it enters, or () for a packet that is not a UDP datagram to this address and port
        4791; cached by its addresses and ports (a packet without IPv4 options)."""
        ihl = (packet[0] & 0x0F) * 4
        if len(packet) < ihl + W.UDP_LEN or packet[_DST:_DST + 4] != W.ip_packed(self.bound_ip):
            return ()
        sport, dport = struct.unpack_from("!HH", packet, ihl)
        ingress = entry(packet[_SRC:_SRC + 4], sport, self.ports) \
            if dport == W.ROCEV2_PORT else ()
        if ihl == W.IP_LEN:
            if len(self._senders_in) >= 4096:
                self._senders_in.clear()
            self._senders_in[packet[_SRC:_PORTS_END]] = ingress
        return ingress
