"""The wire, declared once: the RoCEv2 headers netagg reads and writes, its opcodes, its
ImmDt layouts, the parser's verdicts and the format's limits. Plain Python, no Amaranth: the
gateware builds its layouts from these (`netagg.hw.headers`), and every software codec
derives its struct formats, numpy dtypes and C++ constants from them (`netagg.contract.wire`,
`netagg.host.wire_arrays`, `netagg.sim.codec`); the register map is `netagg.contract.regmap`.

A header's fields are listed in wire order, most significant bit first, as in the
specifications: read as one big-endian number, its first field is its top bits.

Offsets are those of a RoCEv2 frame over IPv4 without options::

    Ethernet 0..13 | IPv4 14..33 | UDP 34..41 | BTH 42..53 | extension headers | payload
    | pad 0-3 | ICRC (4 bytes, least significant byte first)
"""

from __future__ import annotations

import enum


class Header:
    """A header declared in wire order: its fields' names and widths in bits, the first
    field the most significant bits."""

    def __init__(self, name: str, fields: dict[str, int]):
        self.name = name
        self.wire_fields = dict(fields)
        self.size = sum(fields.values())
        if self.size % 8:
            raise ValueError(f"header {name} is {self.size} bits, not whole bytes")
        self.length = self.size // 8

    def __repr__(self):
        return f"Header({self.name!r})"

    def field_offsets(self):
        """(name, bit offset from the first wire bit, width) in wire order."""
        pos = 0
        for name, width in self.wire_fields.items():
            yield name, pos, width
            pos += width

    def byte_offset(self, name: str) -> int:
        """The byte offset of field `name` from the header's first byte (a field that starts
        on a byte)."""
        bit = next(pos for field, pos, _ in self.field_offsets() if field == name)
        if bit % 8:
            raise ValueError(f"{self.name}.{name} does not start on a byte")
        return bit // 8

    def shifts(self) -> list[tuple[str, int, int]]:
        """(name, shift, width) of each field, most significant first: where it sits in the
        header read as one big-endian number."""
        return [(name, self.size - offset - width, width)
                for name, offset, width in self.field_offsets()]


_WORD_CODES = {8: "B", 16: "H", 32: "I", 64: "Q"}      # struct's unsigned codes by width


def words(*headers: Header) -> list[tuple[str, int]]:
    """The headers' fields (in wire order) grouped into the fewest leading words of 8, 16, 32
    or 64 bits, as software reads them: (name, width) each, named by its field, or by the
    field that fills most of it (three quarters or more, as BTH's dqpn), else by its fields'
    names joined with "_"."""
    fields = [item for h in headers for item in h.wire_fields.items()]

    def split(i: int) -> list[list[tuple[str, int]]] | None:
        if i == len(fields):
            return []
        total = 0
        for j in range(i, len(fields)):
            total += fields[j][1]
            if total > 64:
                return None
            if total in _WORD_CODES and (rest := split(j + 1)) is not None:
                return [fields[i:j + 1], *rest]
        return None

    grouped = split(0)
    if grouped is None:
        raise ValueError(f"{[h.name for h in headers]} do not fall into whole words")
    out = []
    for group in grouped:
        width = sum(w for _, w in group)
        main = [n for n, w in group if 4 * w >= 3 * width]
        out.append((main[0] if main else "_".join(n for n, _ in group), width))
    return out


def struct_codes(*headers: Header) -> str:
    """The `struct` codes of `words(*headers)`, without a byte order ("BBHII" for BTH)."""
    return "".join(_WORD_CODES[width] for _, width in words(*headers))


def numpy_fields(*headers: Header) -> list[tuple[str, str]]:
    """`words(*headers)` as big-endian numpy fields, (name, ">u4") each."""
    return [(name, f">u{width // 8}" if width > 8 else "u1") for name, width in words(*headers)]


ETHERNET = Header("Ethernet", {"dst": 48, "src": 48, "ethertype": 16})
IPV4 = Header(
    "IPv4",
    {
        "version": 4, "ihl": 4, "dscp": 6, "ecn": 2, "total_length": 16,
        "identification": 16, "flags": 3, "fragment_offset": 13,
        "ttl": 8, "protocol": 8, "checksum": 16, "src": 32, "dst": 32,
    },
)
UDP = Header("UDP", {"src_port": 16, "dst_port": 16, "length": 16, "checksum": 16})
BTH = Header(
    "BTH",
    {
        "opcode": 8, "se": 1, "migreq": 1, "padcnt": 2, "tver": 4, "pkey": 16,
        "fecn": 1, "becn": 1, "resv6": 6, "dqpn": 24,
        "ackreq": 1, "resv7": 7, "psn": 24,
    },
)
RETH = Header("RETH", {"va": 64, "rkey": 32, "dma_length": 32})
IMMDT = Header("ImmDt", {"data": 32})
AETH = Header("AETH", {"syndrome": 8, "msn": 24})

ETHERTYPE_IPV4 = 0x0800
IP_PROTO_UDP = 17
IPV4_VERSION, IPV4_IHL = 4, 5       # IPv4 without options: its first byte 0x45
ROCEV2_PORT = 4791

ETH_OFFSET = 0
IPV4_OFFSET = ETHERNET.length                    # 14
UDP_OFFSET = IPV4_OFFSET + IPV4.length            # 34
BTH_OFFSET = UDP_OFFSET + UDP.length              # 42
EXT_OFFSET = BTH_OFFSET + BTH.length              # 54
ICRC_LENGTH = 4
# Bytes of the ICRC's coverage that are replaced by 0xFF before computing it (RoCEv2, IBTA
# Annex A17, "ICRC"; docs/switch.md):
# IPv4 TOS, TTL and header checksum, UDP checksum, BTH byte 4 (FECN, BECN, reserved).
ICRC_MASKED_BYTES = (
    IPV4_OFFSET + 1, IPV4_OFFSET + 8, IPV4_OFFSET + 10, IPV4_OFFSET + 11,
    UDP_OFFSET + 6, UDP_OFFSET + 7, BTH_OFFSET + 4,
)
# The ICRC covers the frame from the IPv4 header on, after 8 bytes of 0xFF.
ICRC_START = IPV4_OFFSET


class OpClass(enum.IntEnum):
    """Which extension headers follow the BTH, and whether a payload may follow them."""

    NONE = 0        # SEND First/Middle/Last/Only, WRITE Middle/Last, READ Response Middle, CNP
    IMM = 1         # SEND Last/Only with Immediate, WRITE Last with Immediate
    RETH = 2        # WRITE First/Only
    RETH_IMM = 3    # WRITE Only with Immediate
    AETH = 4        # READ Response First/Last/Only
    READ_REQ = 5    # READ Request: RETH, no payload
    ACK = 6         # Acknowledge: AETH, no payload


EXT_LENGTH = {
    OpClass.NONE: 0, OpClass.IMM: IMMDT.length, OpClass.RETH: RETH.length,
    OpClass.RETH_IMM: RETH.length + IMMDT.length, OpClass.AETH: AETH.length,
    OpClass.READ_REQ: RETH.length, OpClass.ACK: AETH.length,
}
NO_PAYLOAD = (OpClass.READ_REQ, OpClass.ACK)
MAX_EXT_LENGTH = max(EXT_LENGTH.values())
MAX_HEADER_LENGTH = EXT_OFFSET + MAX_EXT_LENGTH    # 74


_RC_CLASSES = {
    0x00: OpClass.NONE, 0x01: OpClass.NONE, 0x02: OpClass.NONE, 0x03: OpClass.IMM,
    0x04: OpClass.NONE, 0x05: OpClass.IMM, 0x06: OpClass.RETH, 0x07: OpClass.NONE,
    0x08: OpClass.NONE, 0x09: OpClass.IMM, 0x0A: OpClass.RETH, 0x0B: OpClass.RETH_IMM,
    0x0C: OpClass.READ_REQ, 0x0D: OpClass.AETH, 0x0E: OpClass.NONE, 0x0F: OpClass.AETH,
    0x10: OpClass.AETH, 0x11: OpClass.ACK,
}
# Supported opcodes: RC (0x00-0x11), UC SEND and WRITE (0x20-0x2B), and the RoCEv2 CNP.
OPCODE_CLASSES = {
    **_RC_CLASSES,
    **{0x20 + op: cls for op, cls in _RC_CLASSES.items() if op <= 0x0B},
    0x81: OpClass.NONE,
}


class Verdict(enum.IntEnum):
    """What the parser concluded about a frame; anything but OK means it is dropped."""

    OK = 0
    NOT_ROCE = 1          # not Ethernet/IPv4 (no options, unfragmented)/UDP 4791/BTH TVer 0
    TRUNCATED = 2         # the frame ends before its headers or before its IPv4 length says
    BAD_LENGTH = 3        # IPv4/UDP lengths disagree with each other or with the frame, bad PadCnt
    BAD_IP_CHECKSUM = 4
    BAD_OPCODE = 5        # an opcode the switch does not support
    BAD_ICRC = 6
    OVERSIZE = 7          # longer than the packet queue can hold


# --- netagg's packets (`netagg.contract.wire` reads and writes them) ----------------------

OP_SEND_ONLY_UC = 0x24
OP_WRITE_ONLY_IMM_UC = 0x2B
OP_CONTRIBUTION = OP_WRITE_ONLY_IMM_UC      # worker -> switch
OP_RESULT = OP_WRITE_ONLY_IMM_UC            # the same opcode: switch -> worker
OP_CONTROL = OP_SEND_ONLY_UC                # to CONTROL_QPN: control request and reply
CONTROL_QPN = 0x000003         # the switch's control QP: QP 0 and 1 are the SMI's and GSI's
# The QP of a spine's frames to a leaf (its results and pulls, docs/leafspine.md): a spine's
# job table entry of a leaf holds it, and a leaf takes an opcode 0x2B frame at it from an
# uplink's spine as its parent's. No host QP uses it.
UPLINK_QPN = 0x000004
PKEY_DEFAULT = 0xFFFF          # the BTH's partition key in every packet


RESULT_TTL = 64
IP_FLAGS_DF = 0b010

# The immediate data of a contribution and of a result (the ImmDt's 32 bits, first field most
# significant), read from `PACKET_HEADER.immdt.data`.
REQUEST_IMM = Header("RequestImm", {
    "job": 4, "rank": 5, "version": 1, "slot": 12, "exponent": 8, "droppable": 1, "reserved": 1,
})
RESULT_IMM = Header("ResultImm", {
    "job": 4, "count": 6, "version": 1, "slot": 12, "exponent": 8, "overflow": 1,
})
# A contribution's RETH virtual address (64 bits, first field most significant): the message
# sequence number (MSN) of its use, and the byte offset of its chunk in the result buffer.
# Its RETH R_Key is the job's KEY (`netagg.contract.regmap.JOB_KEY`).
CONTRIBUTION_VA = Header("ContributionVa", {"msn": 32, "offset": 32})

# Leaf and spine (docs/leafspine.md). A partial, leaf -> spine, is a contribution (its
# REQUEST_IMM rank the leaf's rank in the spine's job, droppable 0) whose BTH.psn is PARTIAL:
# `count` the contributions with data in its sums, `overflow` whether a lane saturated at the
# leaf, `resent` a leaf's re-send (driven by a local worker's retransmission: a spine whose
# use is not complete then pulls the leaves missing from it), `final` a leaf's answer to a
# pull with the use's final (the spine completes the use with it as it is). A spine's frames
# to a leaf go to UPLINK_QPN with RETH.va CONTRIBUTION_VA (the use's msn and offset): a result
# (RESULT_IMM, the sums), or a pull (no payload: the leaf answers with its partial or final).
PARTIAL = Header("Partial", {"reserved": 15, "final": 1, "resent": 1, "overflow": 1,
                             "count": 6})
# A partial's IPv4 DSCP: the highest priority class (7), as every worker of the job waits on it.
PARTIAL_DSCP = 7 << 3

# A block's exponent proposal that says the block holds NaN or an infinity: the largest value
# of the signed exponent field, so the switch's maximum carries it to every worker (finite
# proposals stop one below it). The workers then send the block's kinds in lanes of
# NONFINITE_LANE, one bit per kind each (first field most significant), so that the switch's
# sum counts, per element, the workers that hold each kind (up to MAX_WORKERS in 8 bits).
EXP_NONFINITE = (1 << (RESULT_IMM.wire_fields["exponent"] - 1)) - 1      # 127
NONFINITE_LANE = Header("NonfiniteLane", {"reserved": 8, "nan": 8, "neg_inf": 8, "pos_inf": 8})

# What a contribution's ImmDt can name: jobs (4 bits), ranks (5 bits) and slots per version
# (12 bits; a slot has two copies, version 0 and 1).
MAX_JOBS = 1 << REQUEST_IMM.wire_fields["job"]              # 16
MAX_WORKERS = 1 << REQUEST_IMM.wire_fields["rank"]          # 32
MAX_SLOTS = 1 << REQUEST_IMM.wire_fields["slot"]            # 4096
# The largest payload (bytes of int32 lanes) of a contribution or a result; a switch may take
# less (REG_MAX_PAYLOAD).
MAX_PAYLOAD = 1024

# A control request's payload: 1..MAX_CONTROL_RECORDS records of (address, value).
CONTROL_RECORD = Header("ControlRecord", {"address": 32, "value": 32})
MAX_CONTROL_RECORDS = 64
