"""What a simulated switch's UDP sockets need beyond the host's (`netagg.host.udp_socket`):
classic BPF socket filters (`datagrams_to`, `attach_filter`: what
the kernel queues on a socket), the packet socket that sees the datagrams to an address as
they arrive (`arrivals_socket`, `arrival`: the IPv4 packet and the segment size of a run the
sender's kernel sent in one buffer), the simulation's cabling (`switch_port_for`: the switch
port a UDP sender's frames enter), and one control request from a socket (`request_on`).
"""

from __future__ import annotations

import ctypes
import socket
import struct
import sys

from netagg.contract import headers as H
from netagg.contract import wire as W

# Classic BPF (Linux socket filters): what the kernel queues on a socket.
SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER",
                           26 if sys.platform.startswith("linux") else None)
_LD_W_ABS, _LD_H_IND, _LDX_B_MSH, _JEQ_K, _RET_K = 0x20, 0x48, 0xB1, 0x15, 0x06
NOTHING = [(_RET_K, 0, 0, 0)]

# A packet socket's view of what arrives (Linux's AF_PACKET, <linux/if_packet.h>): each
# frame after a virtio_net_hdr (<linux/virtio_net.h>) that gives a GSO buffer's segment size.
ETH_P_IP = 0x0800
SOL_PACKET = getattr(socket, "SOL_PACKET", 263)
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
VNET_HDR = struct.Struct("=BBHHHH")     # flags, gso_type, hdr_len, gso_size, csum_start, offset
VNET_GSO_NONE = 0
ARRIVAL_HEAD = VNET_HDR.size + W.ETH_LEN    # before the IPv4 header: loopback's and veth's


def datagrams_to(ip: bytes, port: int, offset: int = 0) -> list:
    """A filter that keeps UDP datagrams to (ip, port) only, for a socket whose packets have
    their IPv4 header at `offset` (0: a raw IPv4 socket; 14: Ethernet frames, AF_PACKET)."""
    return [(_LD_W_ABS, 0, 0, offset + H.IPV4.byte_offset("dst")),
            (_JEQ_K, 0, 4, int.from_bytes(ip, "big")),
            (_LDX_B_MSH, 0, 0, offset),                        # X: IPv4 header length
            (_LD_H_IND, 0, 0, offset + H.UDP.byte_offset("dst_port")),
            (_JEQ_K, 0, 1, port),
            (_RET_K, 0, 0, 0xFFFF),
            (_RET_K, 0, 0, 0)]


def attach_filter(sock: socket.socket, program: list) -> bool:
    """Attach a classic BPF program of (code, jt, jf, k) to a socket; whether it could."""
    if SO_ATTACH_FILTER is None:
        return False
    code = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *op) for op in program))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER,
                        struct.pack("HP", len(program), ctypes.addressof(code)))
    except OSError:
        return False
    return True


def arrivals_socket(ip: bytes) -> socket.socket:
    """A non-blocking packet socket (CAP_NET_RAW) that queues the UDP datagrams to (ip,
    port 4791) as they arrive on any interface of this network namespace (Ethernet framed:
    loopback, veth), incoming only, each read `arrival`'s: the IPv4 packet as received, after
    a virtio_net_hdr and the Ethernet header. The segment size of a run a sender's kernel sent
    in one buffer (UDP GSO: loopback and veth carry it whole) is the kernel's, not one the
    packet's own headers claim. PermissionError without the capability."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_IP))
    try:
        sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)   # (loopback: each packet once)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        if not attach_filter(sock, datagrams_to(ip, W.ROCEV2_PORT, W.ETH_LEN)):
            raise OSError("the packet socket takes no filter")
        sock.setblocking(False)
        while True:         # what it queued before its filter: anyone's packets
            try:
                sock.recv(65536)
            except BlockingIOError:
                break
    except BaseException:
        sock.close()
        raise
    return sock


def arrival(data: bytes) -> tuple[bytes, int]:
    """A packet socket's read (`arrivals_socket`): the IPv4 packet, and the segment size of
    the run it holds (the UDP payload bytes of each datagram but the last), 0 for one
    datagram."""
    _, gso_type, _, gso_size, _, _ = VNET_HDR.unpack_from(data)
    return data[ARRIVAL_HEAD:], 0 if gso_type == VNET_GSO_NONE else gso_size
