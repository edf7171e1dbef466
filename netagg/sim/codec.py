"""The golden model's frame codec: the parser's checks on a frame in one pass over its headers,
and result frames written from per-destination header templates.

Frames are those `netagg.contract.wire` reads and writes, bit for bit (tests/test_codec.py compares
them); this module only does it in few Python operations per frame:

- `decode` applies the parser's checks (`hw.parser`) in the parser's order, with its
  verdicts: those on the headers (one `struct` call reads them) are cached per headers and
  frame length, which every frame of a sender repeats, so a frame costs a cache look-up;
- the ICRC is one CRC-32 run: its lead and the masked headers from the IPv4 header to the
  BTH's PSN (RoCEv2's masks: DSCP/ECN, TTL, the IPv4 and UDP checksums, BTH byte 4 set to
  ones), whose CRC state is cached (a sender's packets share them), then the rest of the
  packet;
- `ResultTemplate` holds what every result to one worker shares (the headers up to the BTH's
  PSN for one payload length, and the ICRC's state after them), so that a result is its
  PSN, RETH and ImmDt, the payload and the ICRC.
"""

from __future__ import annotations

import collections
import functools
import struct
from typing import NamedTuple

from netagg.contract import headers as H
from netagg.contract import wire as W
from netagg.contract.headers import Verdict
from netagg.hw.parser import MIN_ETHERNET_FRAME

OK = Verdict.OK         # the verdict every frame is compared with, bound once

# Extension header length after the BTH, by supported opcode, and opcodes that carry no
# payload, by the opcode classes of `hw.headers`.
EXT_LENGTH = {op: H.EXT_LENGTH[cls] for op, cls in H.OPCODE_CLASSES.items()}
NO_PAYLOAD = {op for op, cls in H.OPCODE_CLASSES.items() if cls in H.NO_PAYLOAD}

# The headers the parser's checks read: from the EtherType to the BTH's destination QP
# (IPv4 as ten 16-bit words). The checks read these and the frame's length, nothing else (the
# ICRC aside): their outcome is cached per (headers, length), which a sender's frames share.
HEADERS = struct.Struct(f"!H {W.IP_LEN // 2}H" + H.struct_codes(H.UDP) + H.struct_codes(H.BTH)[:-1])
CHECKED = slice(W.IP_OFFSET - 2, W.BTH_OFFSET + 8)
RETH_IMM = struct.Struct("!" + H.struct_codes(H.RETH, H.IMMDT))   # RETH (va, rkey, length), ImmDt
ICRC_WORD = W.ICRC_STRUCT


class Header(NamedTuple):
    """What the switch reads from a frame its parser takes."""

    opcode: int
    dqpn: int
    start: int          # offset of the payload in the frame
    length: int         # payload bytes (pad excluded)
    src_ip: int


class Extension(NamedTuple):
    """RETH and ImmDt of a WRITE with Immediate (a contribution)."""

    va: int
    rkey: int
    dma_length: int
    imm: int


def decode(frame: bytes) -> tuple[int, Header | None]:
    """The parser's verdict on a frame, and its `Header` when the verdict is OK."""
    verdict, header, body_end, state = checks(bytes(frame[CHECKED]), len(frame))
    if verdict == OK and not icrc_matches(frame, body_end, state):
        return Verdict.BAD_ICRC, None
    return verdict, header


def icrc_matches(frame: bytes, body_end: int, state: int) -> bool:
    """Whether the ICRC at `body_end` is the frame's, with `state` the ICRC's state after its
    headers (`checks`)."""
    return ICRC_WORD.unpack_from(frame, body_end)[0] == W.crc32(
        frame[W.IP_OFFSET + W.ICRC_HEADERS:body_end], state)


@functools.lru_cache(maxsize=4096)
def checks(headers: bytes, n: int) -> tuple[int, Header | None, int, int]:
    """The parser's checks but the ICRC, in its order, on a frame of `n` bytes whose bytes
    from its EtherType to its BTH's destination QP are `headers`: the verdict, and when it is
    OK, the frame's `Header`, where its ICRC is, and the ICRC's state after the headers."""
    if n < W.IP_OFFSET:
        return Verdict.TRUNCATED, None, 0, 0
    # zeros beyond the frame are only read after a length check has failed
    (ethertype, *ip, _sport, dport, udp_length, _udp_checksum, opcode, flags, _pkey,
     dqpn) = HEADERS.unpack(headers + bytes(HEADERS.size - len(headers)))
    if ethertype != H.ETHERTYPE_IPV4:
        return Verdict.NOT_ROCE, None, 0, 0
    if n < W.UDP_OFFSET:
        return Verdict.TRUNCATED, None, 0, 0
    if ip[0] >> 8 != W.IPV4_FIRST_BYTE or ip[3] & 0x3FFF or ip[4] & 0xFF != H.IP_PROTO_UDP:
        return Verdict.NOT_ROCE, None, 0, 0
    if W.ipv4_checksum(headers[2:2 + W.IP_LEN]):
        return Verdict.BAD_IP_CHECKSUM, None, 0, 0
    if n < W.BTH_OFFSET:
        return Verdict.TRUNCATED, None, 0, 0
    if dport != W.ROCEV2_PORT:
        return Verdict.NOT_ROCE, None, 0, 0
    if n < W.BTH_OFFSET + W.BTH_LEN:
        return Verdict.TRUNCATED, None, 0, 0
    if flags & 0x0F:
        return Verdict.NOT_ROCE, None, 0, 0
    ext = EXT_LENGTH.get(opcode)
    if ext is None:
        return Verdict.BAD_OPCODE, None, 0, 0
    total = ip[1]
    ip_end = W.IP_OFFSET + total
    if n < ip_end:
        return Verdict.TRUNCATED, None, 0, 0
    padded = udp_length - (W.UDP_LEN + W.BTH_LEN + W.ICRC_LEN) - ext
    padcnt = (flags >> 4) & 3
    length_ok = n == ip_end or (n == MIN_ETHERNET_FRAME and ip_end < MIN_ETHERNET_FRAME)
    if (not length_ok or udp_length != total - W.IP_LEN or padded < 0 or padded % 4
            or padded < padcnt or (opcode in NO_PAYLOAD and padded)):
        return Verdict.BAD_LENGTH, None, 0, 0
    header = Header(opcode, dqpn & 0xFFFFFF, W.BTH_OFFSET + W.BTH_LEN + ext, padded - padcnt,
                    (ip[6] << 16) | ip[7])
    return OK, header, ip_end - W.ICRC_LEN, W.icrc_state(headers[2:])


Request = collections.namedtuple("Request", [name for name, _, _ in W.REQUEST_IMM])


def contribution(frame: bytes, header: Header | None) -> tuple[Extension, Request] | None:
    """The RETH and ImmDt of a contribution `decode` took, and its ImmDt's REQUEST_IMM
    fields; None for any other frame."""
    if header is None or header.opcode != W.OP_CONTRIBUTION:
        return None
    reth = Extension._make(RETH_IMM.unpack_from(frame, W.BTH_OFFSET + W.BTH_LEN))
    return reth, request(reth.imm)


@functools.lru_cache(maxsize=1 << 14)
def request(imm: int) -> Request:
    """The REQUEST_IMM fields of an ImmDt (cached: a worker's contributions repeat them)."""
    return Request(**W.unpack_imm(W.REQUEST_IMM, imm))


@functools.lru_cache(maxsize=1 << 14)
def result_imm(job: int, count: int, version: int, slot: int, exponent: int,
               overflow: int) -> int:
    """A result's ImmDt (RESULT_IMM; cached: a slot's results repeat it)."""
    return W.pack_imm(W.RESULT_IMM, job=job, count=count, version=version, slot=slot,
                      exponent=exponent, overflow=overflow)


# What follows the first 8 bytes of a result's BTH: its PSN, the RETH and the ImmDt.
_RESULT_TAIL = struct.Struct("!" + H.struct_codes(H.BTH)[-1] + H.struct_codes(H.RETH, H.IMMDT))


class ResultTemplate:
    """Every result to one destination with one payload length: from the switch's (mac, ip,
    udp port) to the worker's (mac, ip, udp port, qpn, rkey). The headers up to the BTH's
    PSN are the same in every such result, and so is the ICRC's state after them (BTH byte 4
    masked); `frame` writes the rest."""

    def __init__(self, src: tuple[int, int, int], dst: tuple[int, int, int], qpn: int,
                 rkey: int, length: int):
        (src_mac, src_ip, sport), (dst_mac, dst_ip, dport) = src, dst
        ip_udp = W.ip_udp_header(W.ip_text(src_ip.to_bytes(4, "big")),
                                 W.ip_text(dst_ip.to_bytes(4, "big")), sport, dport,
                                 W.BTH_LEN + W.RETH_LEN + W.IMM_LEN + length + W.ICRC_LEN)
        headers = ip_udp + W.bth(W.OP_RESULT, qpn, 0)[:8]
        self.head = dst_mac.to_bytes(6, "big") + src_mac.to_bytes(6, "big") + b"\x08\x00" \
            + headers
        self.state = W.icrc_state(headers)
        self.rkey, self.length = rkey & 0xFFFFFFFF, length

    def frame(self, psn: int, va: int, imm: int, payload: bytes) -> bytes:
        """A result: BTH.psn `psn`, RETH.va `va`, ImmDt `imm`, `payload` (the sums)."""
        tail = _RESULT_TAIL.pack(psn & 0xFFFFFF, va & 0xFFFFFFFFFFFFFFFF, self.rkey,
                                 self.length, imm)
        crc = W.crc32(payload, W.crc32(tail, self.state))
        return b"".join((self.head, tail, payload, ICRC_WORD.pack(crc)))
