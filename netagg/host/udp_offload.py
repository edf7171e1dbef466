"""Batched UDP: a run of datagrams in one system call each way, through Linux's UDP
segmentation offload (`UDP_SEGMENT`, GSO) and receive offload (`UDP_GRO`).

- **Sending** (`GsoSender`). k datagrams of one length to one destination leave as one
  buffer with the segment size in a control message; the kernel (or a NIC) cuts it into k
  datagrams with the same IPv4 and UDP headers but for lengths, checksums and the IPv4
  identification, which is the buffer's plus 0, 1, ..., k-1. The buffer's is 0 for a socket
  that is not connected and sets Don't Fragment (the canonical header, `netagg.contract.wire`), so
  segment i leaves with identification i. The ICRC covers the identification, so each
  segment's ICRC is rewritten for its own: CRC-32 is affine, and two packets that differ in
  the identification alone have ICRCs that differ by a constant of the length and the two
  identifications (`ident_deltas`), so ICRC(i) = ICRC(0) xor delta(length, i), one array
  operation a run. The datagrams given keep their ICRC for identification 0 (a datagram sent
  alone). A run holds at most `MAX_SEGMENTS` datagrams and 65,507 bytes. Where the kernel
  refuses GSO (before Linux 4.18, or a route that cannot take it) the sender sends one
  datagram a call from then on.
- **Receiving** (`enable_gro`, `segments`). With `UDP_GRO` set, the kernel may hand a run
  of datagrams of one sender as one buffer, with the segment size in a control message;
  `segments` cuts it again. A run that arrived over a wire was cut and numbered by the
  sender's kernel and may be merged again by the receiver's; on loopback it is never cut,
  and the receiver sees the sender's buffer whole.

A switch's run of frames to one destination (`FrameRun`: one head, Ethernet to UDP, and
the datagrams after it) leaves as one buffer (`GsoSender.send_joined`), without a join.

Cost: per run one join of the datagrams, one array operation and one system call; per
received buffer one system call and a slice per datagram.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import socket
import struct

import numpy as np

from netagg.contract import wire as W

UDP_SEGMENT = 103               # linux/udp.h
UDP_GRO = 104
MAX_SEGMENTS = 64               # UDP_MAX_SEGMENTS of the kernels that have GSO
MAX_RUN_BYTES = 65507           # the largest UDP payload of one IPv4 datagram
_IDENT_AT = 8 + 4               # the identification in the ICRC's input (after its lead)
_GRO_CMSG = socket.CMSG_SPACE(4)
NO_GSO = {errno.EINVAL, errno.EIO, errno.ENOPROTOOPT, errno.EOPNOTSUPP}   # a kernel without it


@functools.lru_cache(maxsize=64)
def ident_deltas(length: int) -> np.ndarray:
    """Per identification i < MAX_SEGMENTS, ICRC(identification i) xor ICRC(identification 0)
    of a datagram (BTH .. ICRC) of `length` bytes, as the ICRC field's little-endian word."""
    covered = 8 + W.IP_LEN + W.UDP_LEN + length - W.ICRC_LEN
    zero = bytearray(covered)
    base = W.crc32(zero)
    deltas = np.zeros(MAX_SEGMENTS, np.uint32)
    for i in range(1, MAX_SEGMENTS):
        zero[_IDENT_AT:_IDENT_AT + 2] = i.to_bytes(2, "big")
        deltas[i] = W.crc32(zero) ^ base
    return deltas


class GsoSender:
    """Sends runs of datagrams from UDP sockets (not connected, Don't Fragment set), each run
    in one call where the kernel takes it; `gso` False: one datagram a call. `renumber`
    False keeps every ICRC as given (identification 0), for a sender whose runs the kernel
    never cuts: to a loopback address, where the receiver sees them whole (GRO) or cut by its
    own kernel, and never sees the identification. `runs` counts the runs sent whole."""

    def __init__(self, addr=None, gso: bool = True, renumber: bool = True):
        self.addr = addr
        self.gso = gso and hasattr(socket.socket, "sendmsg")
        self.renumber = renumber
        self.runs = 0

    def send(self, sock: socket.socket, datagrams: list, addr=None) -> None:
        """Send `datagrams` (each BTH .. ICRC, its ICRC for identification 0), all of one
        length, from `sock` to `addr` (or the sender's). A full socket buffer drops what did
        not fit, as a lost packet."""
        size = len(datagrams[0])
        if not self.gso or len(datagrams) == 1 or size % 4:
            self._singly(sock, datagrams, addr or self.addr)
            return
        self.send_joined(sock, b"".join(datagrams), size, addr)

    def send_joined(self, sock: socket.socket, buf, size: int, addr=None) -> None:
        """`send` for datagrams of `size` bytes given joined, one after the other in `buf`
        (a bytes-like object; not written to)."""
        addr, view = addr or self.addr, memoryview(buf).cast("B")
        count = len(view) // size
        if not self.gso or count == 1 or size % 4:
            self._singly(sock, [view[at:at + size] for at in range(0, count * size, size)],
                         addr)
            return
        per_run = most_rows(size)
        for first in range(0, count, per_run):
            rows = min(per_run, count - first)
            given = run = view[first * size:(first + rows) * size]
            if rows == 1:
                self._singly(sock, [run], addr)
                continue
            if self.renumber:
                run = bytearray(run)
                words = np.frombuffer(run, "<u4").reshape(rows, size // 4)
                words[:, -1] ^= ident_deltas(size)[:rows]
            try:
                sock.sendmsg([run], [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("=H", size))],
                              0, addr)
                self.runs += 1
            except BlockingIOError:
                pass
            except OSError as e:        # no GSO here (EINVAL, EIO, ENOPROTOOPT): one by one
                if e.errno not in NO_GSO:
                    raise               # (another error: unreachable, say)
                self.gso = False        # each datagram alone, with its ICRC as given
                self._singly(sock, [given[at:at + size] for at in range(0, rows * size, size)],
                             addr)

    @staticmethod
    def _singly(sock: socket.socket, datagrams: list, addr):
        for datagram in datagrams:
            try:
                sock.sendto(datagram, addr)
            except BlockingIOError:
                pass


def most_rows(size: int) -> int:
    """The most datagrams of `size` bytes one run holds."""
    return min(MAX_SEGMENTS, MAX_RUN_BYTES // size)


def enable_gro(sock: socket.socket) -> bool:
    """Let the kernel hand runs of datagrams to `sock` as one buffer; whether it can."""
    try:
        sock.setsockopt(socket.SOL_UDP, UDP_GRO, 1)
    except OSError:
        return False
    return True


def gro_ancillary(extra: int = 0) -> int:
    """The ancillary buffer size `recvmsg` needs for the segment size (and `extra`)."""
    return _GRO_CMSG + extra


def segment_size(ancillary) -> int | None:
    """The segment size a GRO run carries in `recvmsg`'s ancillary data, or None."""
    for level, kind, data in ancillary:
        if level == socket.SOL_UDP and kind == UDP_GRO and len(data) >= 4:
            return struct.unpack_from("=i", data)[0]
    return None


def segments(data, size: int | None) -> list:
    """The datagrams of a buffer `recvmsg` returned: itself, or the run of `size`-byte
    datagrams (the last may be shorter) GRO merged."""
    if not size or len(data) <= size:
        return [data]
    view = memoryview(data)
    return [view[at:at + size] for at in range(0, len(data), size)]


def renumbered(ip_udp: bytes, ident: int, length: int) -> bytes:
    """IPv4 and UDP headers (28 bytes) as the kernel writes them on segment `ident` of a run
    (counted from the run's identification) of `length`-byte datagrams: lengths, the
    identification plus `ident`, the IPv4 checksum; the UDP checksum 0 (none)."""
    ip = bytearray(ip_udp[:W.IP_LEN + W.UDP_LEN])
    ip[2:4] = (W.IP_LEN + W.UDP_LEN + length).to_bytes(2, "big")
    ip[4:6] = ((int.from_bytes(ip[4:6], "big") + ident) & 0xFFFF).to_bytes(2, "big")
    ip[10:12] = bytes(2)
    ip[10:12] = W.ipv4_checksum(bytes(ip[:W.IP_LEN])).to_bytes(2, "big")
    ip[W.IP_LEN + 4:W.IP_LEN + 8] = (W.UDP_LEN + length).to_bytes(2, "big") + bytes(2)
    return bytes(ip)


@functools.lru_cache(maxsize=256)
def segment_headers(ip_udp: bytes, size: int, body: int) -> tuple[bytes, ...]:
    """`renumbered` for each segment of a run of `body` bytes cut every `size` bytes."""
    return tuple(renumbered(ip_udp, i, min(size, body - at))
                 for i, at in enumerate(range(0, body, size)))


@dataclasses.dataclass(slots=True)
class FrameRun:
    """Frames that leave by one switch `port` with the same headers up to the BTH (`head`:
    Ethernet, IPv4, UDP; one destination, one length), each followed by its datagram's BTH
    .. ICRC: the `size`-byte rows of `body` (bytes-like), as a switch sends a run of
    results."""

    port: int
    head: bytes
    body: memoryview
    size: int

    def __len__(self) -> int:
        return len(self.body) // self.size

    def datagrams(self) -> list:
        return [self.body[at:at + self.size] for at in range(0, len(self) * self.size,
                                                              self.size)]

    def frames(self) -> list[tuple[int, bytes]]:
        """(port, frame) of each frame."""
        return [(self.port, self.head + bytes(d)) for d in self.datagrams()]
