"""netagg's wire format, software side: the one place the host and the golden model build and
read packets. The format is declared once, for the gateware and for this module: its opcodes,
control QP, header lengths, limits and ImmDt layouts in `netagg.contract.headers`, the register
map in `netagg.contract.regmap`; tests check both sides against scapy's RoCEv2.

Every packet is a RoCEv2 frame (Ethernet, IPv4 without options, UDP to 4791, BTH, ...).

Contribution, worker -> switch: UC RDMA WRITE Only with Immediate (opcode 0x2B).
    RETH.va          CONTRIBUTION_VA: msn 32 | offset 32 (most significant first).
                     msn: the message sequence number (MSN), the job's running number of
                     this slot use, the same on every worker (the host uses use * slot_count
                     + slot); the switch keeps the low 16 bits per slot copy and checks it
                     against the job's credit limit. offset: the byte offset of this chunk in
                     the result buffer (the switch adds the worker's base address from the
                     job table)
    RETH.rkey        the job's KEY (register JOB_KEY, write only): as an RDMA R_Key guards a
                     memory region, it guards the switch's slots of the job. A contribution
                     with another is dropped (`drop_bad_key`) before it touches a slot or
                     the credit check. The host derives it from the session's secret and
                     the job's EPOCH (`host.session`)
    RETH.dma_length  payload length
    ImmDt            REQUEST_IMM: job 4 | rank 5 | version 1 | slot 12 | exponent 8 (signed)
                     | droppable 1 | reserved 1   (most significant first)
    payload          int32 lanes, little-endian, 4..MAX_PAYLOAD bytes
    IPv4 DSCP        priority: class = DSCP >> 3 (0 lowest). A droppable contribution may be
                     dropped by priority at ingress: its payload is discarded and it counts
                     as a null contribution (zeros), so its use still completes.

Result, switch -> each contributor: UC RDMA WRITE Only with Immediate (0x2B) addressed from the
job table: worker MAC/IP/UDP port/QPN/R_Key, RETH.va = base + offset, RETH.dma_length =
payload length.
    BTH.psn          the job's credit limit, a running total (24 bits): COMPLETED + CREDITS
                     when the result was made. A worker may send messages below it.
    ImmDt            RESULT_IMM: job 4 | count 6 | version 1 | slot 12 | exponent 8 (max over
                     contributions) | overflow 1; count is the number of contributions whose
                     data the sums hold (null contributions excluded)
    payload          the saturated int32 sums, little-endian

Leaf and spine (docs/leafspine.md): a leaf's partial, leaf -> spine, is a contribution whose
BTH.psn is PARTIAL (count 6 | overflow 1 | resent 1 | final 1, least significant first) and
whose IPv4 DSCP is PARTIAL_DSCP; a spine's frames to a leaf go to UPLINK_QPN with RETH.va
CONTRIBUTION_VA: a result (RESULT_IMM and the sums) or a pull (RESULT_IMM, no payload).

Control, host -> switch: UC SEND Only (0x24) to QPN CONTROL_QPN; payload: records of 8 bytes,
(address u32 big-endian, bit 31 = write; value u32 big-endian), 1..MAX_CONTROL_RECORDS. The
switch answers to the sender with a SEND Only to CONTROL_QPN, the request's PSN, the addresses
and source/destination swapped, and each record's value replaced by the register's value after
the record was applied.

Frames that the switch builds use a canonical IPv4 header (identification 0, DF, TTL 64),
and so does a host that sends over a UDP socket and computes its ICRC for that header.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import struct

from zlib_ng.zlib_ng import crc32  # zlib's CRC-32, the ICRC's, with carry-less multiply

from netagg.contract import headers as H
from netagg.contract import regmap as R
from netagg.contract.headers import (  # noqa: F401  (the format's constants, for the codec's users)
    CONTROL_QPN,
    EXP_NONFINITE,
    MAX_CONTROL_RECORDS,
    MAX_JOBS,
    MAX_PAYLOAD,
    MAX_SLOTS,
    MAX_WORKERS,
    OP_CONTRIBUTION,
    OP_CONTROL,
    OP_RESULT,
    OP_WRITE_ONLY_IMM_UC,
    PARTIAL_DSCP,
    PKEY_DEFAULT,
    ROCEV2_PORT,
    UPLINK_QPN,
)

TTL = H.RESULT_TTL                # the canonical IPv4 header's, as the switch writes it
IPV4_FIRST_BYTE = H.IPV4_VERSION << 4 | H.IPV4_IHL     # version and IHL, no options
_DONT_FRAGMENT = H.IP_FLAGS_DF << H.IPV4.wire_fields["fragment_offset"]  # flags, fragment offset
CONTROL_FIRST_BYTE = bytes([OP_CONTROL])    # how a control packet's datagram begins

ETH_LEN, IP_LEN, UDP_LEN, BTH_LEN = H.ETHERNET.length, H.IPV4.length, H.UDP.length, H.BTH.length
RETH_LEN, IMM_LEN, ICRC_LEN = H.RETH.length, H.IMMDT.length, H.ICRC_LENGTH
IP_OFFSET, UDP_OFFSET, BTH_OFFSET = H.IPV4_OFFSET, H.UDP_OFFSET, H.BTH_OFFSET

# The headers' struct formats, from the contract's fields (`headers.struct_codes`).
IPV4_STRUCT = struct.Struct("!" + H.struct_codes(H.IPV4))
UDP_STRUCT = struct.Struct("!" + H.struct_codes(H.UDP))
BTH_STRUCT = struct.Struct("!" + H.struct_codes(H.BTH))
RETH_STRUCT = struct.Struct("!" + H.struct_codes(H.RETH))
IMM_STRUCT = struct.Struct("!" + H.struct_codes(H.IMMDT))
RECORD_STRUCT = struct.Struct("!" + H.struct_codes(H.CONTROL_RECORD))
ICRC_STRUCT = struct.Struct("<I")       # the ICRC: least significant byte first
_CHECKSUM = H.IPV4.byte_offset("checksum")


REQUEST_IMM = H.REQUEST_IMM.shifts()
RESULT_IMM = H.RESULT_IMM.shifts()
NONFINITE_LANE = H.NONFINITE_LANE.shifts()
CONTRIBUTION_VA = H.CONTRIBUTION_VA.shifts()
PARTIAL = H.PARTIAL.shifts()          # a partial's BTH.psn (docs/leafspine.md)
assert [name for name, _, _ in CONTRIBUTION_VA] == ["msn", "offset"]
MAX_DATA_COUNT = (1 << H.RESULT_IMM.wire_fields["count"]) - 1  # a result's count: 63 (6 bits)
VA_MSN_SHIFT = CONTRIBUTION_VA[0][1]                         # 32
VA_OFFSET_MASK = (1 << CONTRIBUTION_VA[1][2]) - 1            # the offset's 32 bits
SIGNED_FIELDS = {"exponent"}


def pack_imm(layout, **values) -> int:
    word = 0
    for name, shift, width in layout:
        v = values.get(name, 0)
        signed = name in SIGNED_FIELDS
        lo, hi = (-(1 << (width - 1)), 1 << (width - 1)) if signed else (0, 1 << width)
        if not lo <= v < hi:
            raise ValueError(f"{name}={v} does not fit in {width} bits")
        word |= (v & ((1 << width) - 1)) << shift
    return word


def contribution_va(msn: int, offset: int) -> int:
    """A contribution's RETH.va: its MSN and its chunk's offset (each modulo 2**32)."""
    return (msn & 0xFFFFFFFF) << VA_MSN_SHIFT | (offset & VA_OFFSET_MASK)


def split_va(va: int) -> tuple[int, int]:
    """(msn, offset) of a contribution's RETH.va."""
    return va >> VA_MSN_SHIFT & 0xFFFFFFFF, va & VA_OFFSET_MASK


def unpack_imm(layout, word: int) -> dict:
    out = {}
    for name, shift, width in layout:
        v = (word >> shift) & ((1 << width) - 1)
        if name in SIGNED_FIELDS and v >> (width - 1):
            v -= 1 << width
        out[name] = v
    return out




def pack_records(records) -> bytes:
    """Control payload from (address, value) pairs; an address with WRITE set writes."""
    return b"".join(RECORD_STRUCT.pack(a, v & 0xFFFFFFFF) for a, v in records)


def unpack_records(payload: bytes):
    size = RECORD_STRUCT.size
    if len(payload) % size:
        raise ValueError(f"control payload of {len(payload)} bytes is not whole records")
    return [RECORD_STRUCT.unpack_from(payload, i) for i in range(0, len(payload), size)]


# --- frames ------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def ip_packed(ip) -> bytes:
    """The 4 bytes of an IPv4 address (cached: addresses repeat on every packet)."""
    return ipaddress.IPv4Address(ip).packed


@functools.lru_cache(maxsize=4096)
def ip_text(packed: bytes) -> str:
    """The dotted text of 4 address bytes (cached)."""
    return str(ipaddress.IPv4Address(packed))


def ip_to_int(ip) -> int:
    return int.from_bytes(ip_packed(ip), "big")


def mac_to_int(mac) -> int:
    return mac if isinstance(mac, int) else int(mac.replace(":", ""), 16)


def ipv4_checksum(header: bytes) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


# What `icrc_state` covers: the IPv4 and UDP headers and the BTH up to its PSN, and the bits
# of them the ICRC masks to ones: IPv4 DSCP/ECN, TTL and header checksum, the UDP checksum,
# BTH byte 4 (FECN, BECN, reserved).
ICRC_HEADERS = IP_LEN + UDP_LEN + 8
_ICRC_MASK = int.from_bytes(bytes(0xFF if IP_OFFSET + i in H.ICRC_MASKED_BYTES else 0
                                  for i in range(ICRC_HEADERS)), "big")


@functools.lru_cache(maxsize=4096)
def icrc_state(headers: bytes) -> int:
    """The ICRC's CRC-32 state after its lead (8 bytes of ones, the LRH's place) and a
    packet's first ICRC_HEADERS bytes from its IPv4 header, masked; the ICRC is
    `crc32(rest, state)` over the rest of the packet (the ICRC excluded). Cached: an
    endpoint's packets to one destination share them."""
    masked = (int.from_bytes(headers, "big") | _ICRC_MASK).to_bytes(ICRC_HEADERS, "big")
    return crc32(b"\xff" * 8 + masked)


def icrc(ip_udp: bytes, transport: bytes) -> int:
    """The ICRC of a packet: `ip_udp` its IPv4 and UDP headers (28 bytes), `transport` the BTH
    onwards (payload and pad included, ICRC excluded)."""
    return crc32(transport[8:], icrc_state(bytes(ip_udp[:IP_LEN + UDP_LEN])
                                                + bytes(transport[:8])))


@functools.lru_cache(maxsize=4096)
def ip_udp_header(src, dst, sport: int, dport: int, udp_payload_len: int, dscp: int = 0) -> bytes:
    """The canonical IPv4 (identification 0, DF, TTL 64, checksum computed) and UDP
    (checksum 0) headers for a datagram of `udp_payload_len` bytes (cached: a worker's
    repeat)."""
    total = IP_LEN + UDP_LEN + udp_payload_len
    ip = IPV4_STRUCT.pack(IPV4_FIRST_BYTE, dscp << 2, total, 0, _DONT_FRAGMENT, TTL,
                          H.IP_PROTO_UDP, 0, ip_to_int(src), ip_to_int(dst))
    ip = ip[:_CHECKSUM] + ipv4_checksum(ip).to_bytes(2, "big") + ip[_CHECKSUM + 2:]
    return ip + UDP_STRUCT.pack(sport, dport, UDP_LEN + udp_payload_len, 0)


def bth(opcode: int, dqpn: int, psn: int, padcnt: int = 0, pkey: int = PKEY_DEFAULT) -> bytes:
    return BTH_STRUCT.pack(opcode, padcnt << 4, pkey, dqpn & 0xFFFFFF, psn & 0xFFFFFF)


def reth(va: int, rkey: int, length: int) -> bytes:
    return RETH_STRUCT.pack(va & (2**64 - 1), rkey & 0xFFFFFFFF, length)


@dataclasses.dataclass
class Endpoint:
    """Where a packet comes from or goes to."""

    ip: str
    port: int = ROCEV2_PORT
    mac: int = 0


@dataclasses.dataclass
class Packet:
    """A netagg packet as software sees it: the fields that matter, read from or for a frame."""

    opcode: int
    dqpn: int
    psn: int
    payload: bytes = b""
    va: int | None = None           # RETH, for WRITE packets
    rkey: int = 0
    dma_length: int | None = None
    imm: int | None = None
    src: Endpoint | None = None
    dst: Endpoint | None = None
    dscp: int = 0

    def transport(self) -> bytes:
        """BTH onwards, without the ICRC."""
        pad = -len(self.payload) % 4
        out = bth(self.opcode, self.dqpn, self.psn, pad)
        if self.va is not None:
            length = len(self.payload) if self.dma_length is None else self.dma_length
            out += reth(self.va, self.rkey, length)
        if self.imm is not None:
            out += IMM_STRUCT.pack(self.imm)
        return out + self.payload + bytes(pad)

    def datagram(self) -> bytes:
        """The UDP payload (BTH .. ICRC) for a sender whose kernel builds the canonical IPv4
        and UDP headers (see `ip_udp_header`)."""
        body = self.transport()
        hdr = ip_udp_header(self.src.ip, self.dst.ip, self.src.port, self.dst.port,
                            len(body) + ICRC_LEN, self.dscp)
        return body + ICRC_STRUCT.pack(icrc(hdr, body))

    def frame(self) -> bytes:
        """The whole Ethernet frame (no FCS)."""
        return wrap_datagram(self.src, self.dst, self.datagram(), self.dscp)


class WireError(ValueError):
    """A frame or datagram that is not a well-formed netagg packet."""


# The opcodes whose RETH and whose ImmDt `parse_transport` reads (by `hw.headers`' classes).
_HAS_RETH = {op for op, cls in H.OPCODE_CLASSES.items()
             if cls in (H.OpClass.RETH, H.OpClass.RETH_IMM)}
_HAS_IMM = {op for op, cls in H.OPCODE_CLASSES.items()
            if cls in (H.OpClass.IMM, H.OpClass.RETH_IMM)}


def parse_transport(body: bytes, src: Endpoint | None = None, dst: Endpoint | None = None,
                    ip_udp: bytes | None = None, dscp: int = 0,
                    icrc_checked: bool = False) -> Packet:
    """Read BTH .. ICRC. When `ip_udp` (the packet's IPv4 and UDP headers) is given, the
    ICRC is checked against it; else against the canonical headers for `src` and `dst`;
    not at all with `icrc_checked` (a transport checked it)."""
    if len(body) < BTH_LEN + ICRC_LEN:
        raise WireError(f"{len(body)} bytes is too short for a BTH and an ICRC")
    opcode, flags, _pkey, dqpn, psn = BTH_STRUCT.unpack_from(body)
    if flags & 0x0F:
        raise WireError("BTH transport version is not 0")
    padcnt = (flags >> 4) & 3
    pos = BTH_LEN
    pkt = Packet(opcode=opcode, dqpn=dqpn & 0xFFFFFF, psn=psn & 0xFFFFFF, src=src, dst=dst,
                 dscp=dscp)
    if opcode in _HAS_RETH:
        if len(body) < pos + RETH_LEN + ICRC_LEN:
            raise WireError("truncated RETH")
        pkt.va, pkt.rkey, pkt.dma_length = RETH_STRUCT.unpack_from(body, pos)
        pos += RETH_LEN
    if opcode in _HAS_IMM:
        if len(body) < pos + IMM_LEN + ICRC_LEN:
            raise WireError("truncated ImmDt")
        (pkt.imm,) = IMM_STRUCT.unpack_from(body, pos)
        pos += IMM_LEN
    end = len(body) - ICRC_LEN
    if end - pos < padcnt:
        raise WireError("PadCnt larger than the payload")
    pkt.payload = body[pos:end - padcnt]
    if icrc_checked:
        return pkt
    if ip_udp is None:
        if src is None or dst is None:
            raise WireError("the ICRC needs the packet's addresses")
        ip_udp = ip_udp_header(src.ip, dst.ip, src.port, dst.port, len(body), dscp)
    if not icrc_holds(body, ip_udp):
        raise WireError("bad ICRC")
    return pkt


def parse_frame(frame: bytes) -> Packet:
    """Read a whole Ethernet frame (no FCS) of RoCEv2 over IPv4, checking lengths and ICRC."""
    body, ip_udp = frame_datagram(frame)
    src, dst, _ = strip_frame(frame)
    return parse_transport(body, src, dst, ip_udp=ip_udp, dscp=frame[IP_OFFSET + 1] >> 2)


def strip_frame(frame: bytes):
    """(source, destination, UDP payload) of a frame, for a bridge that carries datagrams."""
    total = struct.unpack_from("!H", frame, IP_OFFSET + 2)[0]
    sport, dport = struct.unpack_from("!HH", frame, UDP_OFFSET)
    src = Endpoint(ip_text(frame[IP_OFFSET + 12:IP_OFFSET + 16]), sport,
                   int.from_bytes(frame[6:12], "big"))
    dst = Endpoint(ip_text(frame[IP_OFFSET + 16:IP_OFFSET + 20]), dport,
                   int.from_bytes(frame[0:6], "big"))
    return src, dst, frame[BTH_OFFSET:ETH_LEN + total]


def wrap_datagram(src: Endpoint, dst: Endpoint, datagram: bytes, dscp: int = 0) -> bytes:
    """The Ethernet frame a bridge injects for a UDP datagram, with the canonical headers."""
    hdr = ip_udp_header(src.ip, dst.ip, src.port, dst.port, len(datagram), dscp)
    eth = mac_to_int(dst.mac).to_bytes(6, "big") + mac_to_int(src.mac).to_bytes(6, "big")
    return eth + b"\x08\x00" + hdr + datagram


def contribution(*, job: int, rank: int, slot: int, version: int, offset: int,
                 lanes: bytes, psn: int, src: Endpoint, dst: Endpoint, key: int,
                 exponent: int = 0, msn: int = 0, droppable: bool = False, dscp: int = 0,
                 dqpn: int = 2) -> Packet:
    """A contribution packet: `lanes` are the little-endian int32 values, `key` the job's
    KEY (RETH.rkey), `msn` and `offset` RETH.va's halves."""
    if not 4 <= len(lanes) <= MAX_PAYLOAD or len(lanes) % 4:
        raise ValueError(f"a contribution carries 4..{MAX_PAYLOAD} bytes of int32 lanes")
    imm = pack_imm(REQUEST_IMM, job=job, rank=rank, version=version, slot=slot,
                   exponent=exponent, droppable=int(droppable))
    return Packet(OP_CONTRIBUTION, dqpn, psn, lanes, va=contribution_va(msn, offset),
                  rkey=key & 0xFFFFFFFF, imm=imm, src=src, dst=dst, dscp=dscp)


WRITE_IMM_HEAD = struct.Struct("!" + H.struct_codes(H.BTH, H.RETH, H.IMMDT))   # a WRITE with Imm
WRITE_IMM_HEAD_LEN = BTH_LEN + RETH_LEN + IMM_LEN
_RESULT_SHIFTS = tuple(shift for _, shift, _ in RESULT_IMM)
_RESULT_MASKS = tuple((1 << width) - 1 for _, _, width in RESULT_IMM)
assert [name for name, _, _ in RESULT_IMM] == ["job", "count", "version", "slot", "exponent",
                                               "overflow"]


def unpack_result_imm(imm: int) -> tuple[int, int, int, int, int, int]:
    """A result ImmDt's (job, count, version, slot, exponent, overflow): `unpack_imm`'s
    values as a tuple, for the per-packet path."""
    (sj, sc, sv, ss, se, so), (mj, mc, mv, ms, me, mo) = _RESULT_SHIFTS, _RESULT_MASKS
    e = imm >> se & me
    return (imm >> sj & mj, imm >> sc & mc, imm >> sv & mv, imm >> ss & ms,
            e - 256 if e & 0x80 else e, imm >> so & mo)


def icrc_holds(body: bytes, ip_udp: bytes) -> bool:
    """Whether a datagram (BTH .. ICRC) carries the ICRC of its IPv4 and UDP headers
    `ip_udp`."""
    end = len(body) - ICRC_LEN
    if end < 8:
        return False
    return icrc(ip_udp, memoryview(body)[:end]) == ICRC_STRUCT.unpack_from(body, end)[0]


def read_write_imm(body: bytes) -> tuple[int, int, int, int, bytes]:
    """(dqpn, psn, rkey, imm, payload) of an RDMA WRITE Only with Immediate without padding,
    the form of every result (its ICRC already checked); `WireError` for anything else. The
    fast reading of results; `parse_transport` reads any packet."""
    end = len(body) - ICRC_LEN
    if end < WRITE_IMM_HEAD_LEN:
        raise WireError(f"{len(body)} bytes is too short for a WRITE with Immediate")
    opcode, flags, _pkey, dqpn, psn, _va, rkey, _length, imm = \
        WRITE_IMM_HEAD.unpack_from(body)
    if opcode != OP_WRITE_ONLY_IMM_UC or flags & 0x3F:
        raise WireError(f"opcode {opcode:#x} with flags {flags:#x} is not an unpadded "
                        f"WRITE Only with Immediate")
    return dqpn & 0xFFFFFF, psn & 0xFFFFFF, rkey, imm, body[WRITE_IMM_HEAD_LEN:end]


def frame_datagram(frame: bytes) -> tuple[bytes, bytes]:
    """(UDP payload, IPv4 and UDP headers) of a whole Ethernet frame of RoCEv2 over IPv4,
    its lengths checked (`WireError` if they do not hold); the ICRC is the reader's."""
    if len(frame) < BTH_OFFSET + BTH_LEN + ICRC_LEN:
        raise WireError(f"frame of {len(frame)} bytes is too short for RoCEv2")
    if (int.from_bytes(frame[ETH_LEN - 2:ETH_LEN], "big") != H.ETHERTYPE_IPV4
            or frame[IP_OFFSET] != IPV4_FIRST_BYTE):
        raise WireError("not IPv4 without options")
    total = struct.unpack_from("!H", frame, IP_OFFSET + 2)[0]
    if frame[IP_OFFSET + 9] != H.IP_PROTO_UDP or total > len(frame) - ETH_LEN:
        raise WireError("not UDP, or IPv4 length beyond the frame")
    if struct.unpack_from("!H", frame, UDP_OFFSET + 4)[0] + IP_LEN != total:
        raise WireError("UDP length disagrees with the IPv4 length")
    return frame[BTH_OFFSET:ETH_LEN + total], frame[IP_OFFSET:BTH_OFFSET]


def priority_dscp(priority_class: int) -> int:
    """The DSCP that carries a priority class (0..7): the class selector codepoint."""
    if not 0 <= priority_class < R.PRIORITY_CLASSES:
        raise ValueError(f"priority class must be 0..7, not {priority_class}")
    return priority_class << 3


def unwrap(value: int, near: int, bits: int = 24) -> int:
    """The running total whose low `bits` are `value`, closest to `near` (as InfiniBand
    credit limits are read)."""
    span = 1 << bits
    delta = (value - near) % span
    if delta >= span // 2:
        delta -= span
    return near + delta


def control_request(records, psn: int, src: Endpoint, dst: Endpoint) -> Packet:
    if not 1 <= len(records) <= MAX_CONTROL_RECORDS:
        raise ValueError(f"a control request carries 1..{MAX_CONTROL_RECORDS} records")
    return Packet(OP_CONTROL, CONTROL_QPN, psn, pack_records(records), src=src, dst=dst)


def entry_records(job: int, rank: int, switch_port: int, address: Endpoint, qpn: int, *,
                  va: int = 0, rkey: int | None = None) -> list[tuple[int, int]]:
    """A job-table entry's records, (register, value) without the WRITE bit: rank `rank` of
    `job` reached by switch port `switch_port` at `address` (IPv4, UDP port, MAC), queue
    pair `qpn`, base address `va`, and its R_Key when given (rank 0 of a run writes every
    rank's: `host.job_setup`)."""
    endpoint = R.WORKER_ENDPOINT.pack(switch_port=switch_port, udp_port=address.port)
    fields = [(R.WORKER_PORT, endpoint),
              (R.WORKER_MAC_HI, address.mac >> 32), (R.WORKER_MAC_LO, address.mac & 0xFFFFFFFF),
              (R.WORKER_IP, ip_to_int(address.ip)), (R.WORKER_QPN, qpn)]
    if rkey is not None:
        fields.append((R.WORKER_RKEY, rkey))
    fields += [(R.WORKER_VA_HI, va >> 32), (R.WORKER_VA_LO, va & 0xFFFFFFFF)]
    return [(R.worker_reg(job, rank, off), value) for off, value in fields]


def uplink_records(uplink: int, port: int, spine: Endpoint) -> list[tuple[int, int]]:
    """A leaf's uplink table entry's records, (register, value) without the WRITE bit:
    uplink `uplink` leaves by switch port `port` to `spine` (its MAC, IPv4 address and UDP
    port)."""
    return [(R.uplink_reg(uplink, R.UPLINK_PORT), port),
            (R.uplink_reg(uplink, R.UPLINK_MAC_HI), spine.mac >> 32),
            (R.uplink_reg(uplink, R.UPLINK_MAC_LO), spine.mac & 0xFFFFFFFF),
            (R.uplink_reg(uplink, R.UPLINK_IP), ip_to_int(spine.ip)),
            (R.uplink_reg(uplink, R.UPLINK_UDP_PORT), spine.port)]
