"""The mutations of the switch's fuzzer (`sim.fuzz`): what a good frame becomes.

`Mutator.mutate` takes a good frame (a contribution or a control request) and returns a
mutated copy, its `Kind` and a note of what changed:

- BYTES, BITS: about 2 % of the bytes replaced by random ones, or one bit flipped in each;
- FIELD: one header field set to a boundary, neighbouring, special or random value: every
  field of Ethernet, IPv4, UDP, BTH, RETH, the halves of a contribution's RETH.va (its MSN,
  set also a little ahead or far from its own, and its offset) and the contribution's
  ImmDt (job, rank, version, slot, exponent, droppable, reserved), as `hw.headers` lays them
  out, and the ICRC; RETH.rkey is also set to a job's key or tag of the epoch (`keys`);
- PAYLOAD: a contribution's payload of another length (RETH's DMA length following it or
  not) or of other contents (extremes that saturate, random lanes);
- TRUNCATE, EXTEND: the frame cut (near a header boundary, or anywhere; padded to Ethernet's
  60 bytes or not) or lengthened (a few bytes, or to around the ingress queue's capacity);
- RECORDS: a control request of 1..70 records of wild addresses (every part of the register
  map and beyond, the leaf's and spine's registers, docs/leafspine.md, included: a switch
  without uplinks reads them 0 and ignores writes to them, as the RTL does), write bits and
  values (CONFIG with `partials`, PARENT with `enable`), sometimes not whole records.

Except where the mutation is the field itself, the IPv4 checksum, the IPv4 and UDP lengths and
the ICRC are recomputed some of the time, so that a mutation reaches the checks and the
aggregator behind the first check it would fail.
"""

from __future__ import annotations

import dataclasses
import random

from netagg.contract import headers as H
from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.fuzz_traffic import Kind


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    bit: int           # from the frame's first bit, on the wire
    width: int


def _fields() -> list[Field]:
    """Every header field of a contribution, where it is on the wire."""
    headers = (("eth", H.ETHERNET, H.ETH_OFFSET), ("ip", H.IPV4, H.IPV4_OFFSET),
               ("udp", H.UDP, H.UDP_OFFSET), ("bth", H.BTH, H.BTH_OFFSET),
               ("reth", H.RETH, H.EXT_OFFSET), ("va", H.CONTRIBUTION_VA, H.EXT_OFFSET),
               ("imm", H.REQUEST_IMM, H.EXT_OFFSET + H.RETH.length))
    return [Field(f"{prefix}.{name}", 8 * offset + pos, width)
            for prefix, header, offset in headers for name, pos, width in header.field_offsets()]


FIELDS = _fields()
ICRC = "icrc"
SPECIAL = {
    "eth.ethertype": (H.ETHERTYPE_IPV4, 0x86DD, 0x8100, 0x0806),
    "ip.version": (4, 6), "ip.ihl": (4, 5, 6, 15), "ip.flags": (0, 1, 2, 4),
    "ip.fragment_offset": (0, 1, 0x1FFF), "ip.ttl": (0, 1, 64, 255),
    "ip.protocol": (H.IP_PROTO_UDP, 6, 1, 0),
    "udp.dst_port": (H.ROCEV2_PORT, H.ROCEV2_PORT + 1, 0xC000),
    "bth.opcode": (*H.OPCODE_CLASSES, 0x64, 0x12, 0x2C, 0xFF),
    "bth.dqpn": (W.CONTROL_QPN, 0, 1, 2), "bth.pkey": (0xFFFF, 0x7FFF, 0),
    "imm.slot": (0, 1, 2, 3, 4, 5, 63, 64, 0xFFF), "imm.exponent": (0x7F, 0x80, 0xFF, 0),
}
INT32 = (0, 1, -1, (1 << 31) - 1, -(1 << 31), 1 << 30, -(1 << 30))
MSN_STEPS = (1, 2, 3, 4, 8, 16, 0x8000, 0x10000, -0x10000, -1 << 31)   # from a frame's own


def get_field(data: bytes, field: Field) -> int | None:
    first, last = field.bit // 8, (field.bit + field.width + 7) // 8
    if last > len(data):
        return None
    word = int.from_bytes(data[first:last], "big")
    return (word >> (8 * (last - first) - field.bit % 8 - field.width)) & ((1 << field.width) - 1)


def set_field(buf: bytearray, field: Field, value: int):
    first, last = field.bit // 8, (field.bit + field.width + 7) // 8
    shift = 8 * (last - first) - field.bit % 8 - field.width
    mask = ((1 << field.width) - 1) << shift
    word = int.from_bytes(buf[first:last], "big") & ~mask | (value << shift) & mask
    buf[first:last] = word.to_bytes(last - first, "big")


def icrc_end(data: bytes) -> int:
    """Where a frame's ICRC ends: at its IPv4 length if that is inside the frame, else at
    the frame's end."""
    end = H.IPV4_OFFSET + int.from_bytes(data[H.IPV4_OFFSET + 2:H.IPV4_OFFSET + 4], "big")
    return end if H.BTH_OFFSET + 8 + H.ICRC_LENGTH <= end <= len(data) else len(data)


def repair_lengths(buf: bytearray):
    """The IPv4 total length and the UDP length of a frame of this size."""
    total = len(buf) - H.IPV4_OFFSET
    buf[H.IPV4_OFFSET + 2:H.IPV4_OFFSET + 4] = (total & 0xFFFF).to_bytes(2, "big")
    buf[H.UDP_OFFSET + 4:H.UDP_OFFSET + 6] = ((total - W.IP_LEN) & 0xFFFF).to_bytes(2, "big")


def repair_checksum(buf: bytearray):
    at = H.IPV4_OFFSET + 10
    buf[at:at + 2] = bytes(2)
    buf[at:at + 2] = W.ipv4_checksum(bytes(buf[H.IPV4_OFFSET:H.UDP_OFFSET])).to_bytes(2, "big")


def repair_icrc(buf: bytearray):
    end = icrc_end(buf)
    if end >= H.BTH_OFFSET + 8 + H.ICRC_LENGTH:
        crc = W.icrc(bytes(buf[H.IPV4_OFFSET:H.BTH_OFFSET]), bytes(buf[H.BTH_OFFSET:end - 4]))
        buf[end - 4:end] = crc.to_bytes(4, "little")


class Mutator:
    """Mutations of good frames, from a seeded `random.Random`."""

    WEIGHTS = {Kind.BYTES: 14, Kind.BITS: 14, Kind.FIELD: 44, Kind.PAYLOAD: 10,
               Kind.TRUNCATE: 7, Kind.EXTEND: 7, Kind.RECORDS: 4}

    def __init__(self, rng: random.Random, ports: int, jobs: int, max_workers: int,
                 host: W.Endpoint, switch: W.Endpoint,
                 keys: dict[int, tuple[int, int]] | None = None):
        self.rng, self.ports, self.jobs, self.max_workers = rng, ports, jobs, max_workers
        self.host, self.switch = host, switch
        self.keys = {} if keys is None else keys    # job -> (key, tag), as the traffic's
        self.special = SPECIAL | {"imm.job": tuple(range(jobs + 1)),
                                  "imm.rank": tuple(range(min(max_workers + 1, 32)))}

    def mutate(self, data: bytes) -> tuple[bytes, Kind, str]:
        kind = self.rng.choices(list(self.WEIGHTS), list(self.WEIGHTS.values()))[0]
        buf = bytearray(data)
        note = getattr(self, f"_{kind.value}")(buf)
        return bytes(buf), kind, note

    def _repair(self, buf: bytearray, chance: float, lengths: bool = False,
                checksum: bool = True, icrc: bool = True) -> str:
        if self.rng.random() >= chance:
            return ""
        if lengths:
            repair_lengths(buf)
        if checksum:
            repair_checksum(buf)
        if icrc:
            repair_icrc(buf)
        return " (repaired)"

    def _bytes(self, buf: bytearray) -> str:
        rng = self.rng
        places = rng.sample(range(len(buf)), 1 + rng.randrange(max(1, len(buf) // 25)))
        for i in places:
            buf[i] = rng.randrange(256)
        return f"{len(places)} bytes{self._repair(buf, 0.3)}"

    def _bits(self, buf: bytearray) -> str:
        rng = self.rng
        places = rng.sample(range(len(buf)), 1 + rng.randrange(max(1, len(buf) // 25)))
        for i in places:
            buf[i] ^= 1 << rng.randrange(8)
        return f"{len(places)} bits{self._repair(buf, 0.3)}"

    def _value(self, name: str, old: int, width: int) -> int:
        rng, top = self.rng, (1 << width) - 1
        if name == "reth.rkey" and self.keys and rng.random() < 0.5:
            return rng.choice([k for pair in self.keys.values() for k in pair])
        if name == "va.msn" and rng.random() < 0.5:
            return (old + rng.choice(MSN_STEPS)) & top
        if name in self.special and rng.random() < 0.5:
            return rng.choice(self.special[name]) & top
        return rng.choice((0, top, (old + 1) & top, (old - 1) & top, 1 << (width - 1),
                           old ^ (1 << rng.randrange(width)), rng.getrandbits(width)))

    def _field(self, buf: bytearray) -> str:
        rng = self.rng
        if rng.random() < 1 / (len(FIELDS) + 1):
            end = icrc_end(buf)
            old = int.from_bytes(buf[end - 4:end], "little")
            value = self._value(ICRC, old, 32)
            buf[end - 4:end] = value.to_bytes(4, "little")
            return f"{ICRC}={value:#x}"
        field = rng.choice(FIELDS)
        old = get_field(buf, field)
        if old is None:
            return f"{field.name} beyond the frame"
        value = self._value(field.name, old, field.width)
        set_field(buf, field, value)
        return f"{field.name}={value:#x}" + self._repair(
            buf, 0.85, checksum=field.name != "ip.checksum")

    def _payload(self, buf: bytearray) -> str:
        rng = self.rng
        if buf[H.BTH_OFFSET] != W.OP_CONTRIBUTION:
            return self._field(buf)
        packet = W.parse_frame(bytes(buf))
        length = len(packet.payload)
        if rng.random() < 0.5:
            lanes = [rng.choice(INT32) if rng.random() < 0.5 else rng.randrange(-2**31, 2**31)
                     for _ in range(length // 4)]
            packet.payload = b"".join(v.to_bytes(4, "little", signed=True) for v in lanes)
            note = "contents"
        else:
            new = rng.choice((0, 1, 2, 3, 4, length - 4, length - 1, length + 1, length + 4,
                              W.MAX_PAYLOAD, W.MAX_PAYLOAD + 4, rng.randrange(1100)))
            packet.payload = rng.randbytes(max(new, 0))
            note = f"{len(packet.payload)} bytes"
        packet.dma_length = None                  # the payload's length
        if rng.random() < 0.3:
            packet.dma_length = rng.choice((length, rng.getrandbits(32)))
            note += f", dma_length {packet.dma_length}"
        buf[:] = packet.frame()
        return note

    def _truncate(self, buf: bytearray) -> str:
        rng = self.rng
        bounds = (H.IPV4_OFFSET, H.UDP_OFFSET, H.BTH_OFFSET, H.EXT_OFFSET, H.EXT_OFFSET + 16,
                  H.EXT_OFFSET + 20, len(buf) - 4, len(buf) - 1)
        cut = rng.randrange(1, len(buf)) if rng.random() < 0.3 else \
            rng.choice(bounds) + rng.randint(-2, 2)
        del buf[max(1, min(cut, len(buf) - 1)):]
        note = f"to {len(buf)} bytes"
        if len(buf) < 60 and rng.random() < 0.3:
            buf.extend(bytes(60 - len(buf)))
            note += ", padded to 60"
        if len(buf) >= H.BTH_OFFSET + 8 + H.ICRC_LENGTH:
            note += self._repair(buf, 0.3, lengths=True)
        return note

    def _extend(self, buf: bytearray) -> str:
        rng = self.rng
        jumbo = 4096 + H.EXT_OFFSET + 24 - len(buf) + rng.choice((-4, 0, 4, 8))
        more = rng.choice((1, 2, 3, 4, 8, rng.randint(1, 64), max(jumbo, 1)))
        buf.extend(rng.randbytes(more) if rng.random() < 0.5 else bytes(more))
        return f"by {more} bytes" + self._repair(buf, 0.5, lengths=True)

    def _address(self) -> int:
        rng, jobs, workers = self.rng, self.jobs, self.max_workers
        return rng.choice((
            rng.randrange(0x20),
            R.job_reg(rng.randrange(jobs + 1), rng.randrange(R.JOB_SPRAY + 2)),
            R.uplink_reg(rng.randrange(R.MAX_UPLINKS + 1), rng.randrange(R.UPLINK_STRIDE)),
            R.worker_reg(rng.randrange(jobs + 1), rng.randrange(workers + 1), rng.randrange(8)),
            R.BEAT_BASE + R.BEAT_STRIDE * rng.randrange(jobs + 1) + rng.randrange(workers + 2),
            R.PORT_COUNTERS_BASE + R.PORT_COUNTERS_STRIDE * rng.randrange(self.ports + 1)
            + rng.randrange(0x20),
            R.JOB_COUNTERS_BASE + R.JOB_COUNTERS_STRIDE * rng.randrange(jobs + 1)
            + rng.randrange(0x20),
            rng.getrandbits(31))) | (R.WRITE if rng.random() < 0.5 else 0)

    def _records(self, buf: bytearray) -> str:
        rng = self.rng
        n = rng.choice((1, 2, 3, 8, 63, 64, 65, rng.randint(1, 70)))
        records = [(self._address(), rng.choice((
            0, 1, 0xFFFFFFFF, rng.getrandbits(32), rng.randrange(16),
            0x80000000 | rng.randrange(64), rng.randrange(0x10000),
            R.CONFIG.pack(enable=1, partials=1, workers=rng.randrange(64)),
            R.PARENT.pack(enable=1, rank=rng.randrange(32))))) for _ in range(n)]
        payload = W.pack_records(records)
        if rng.random() < 0.1:
            payload = payload[:rng.randrange(len(payload) + 1)] + rng.randbytes(rng.randrange(8))
        packet = W.Packet(W.OP_CONTROL, W.CONTROL_QPN, rng.getrandbits(24), payload,
                          src=self.host, dst=self.switch)
        buf[:] = packet.frame()
        writes = sum(a >> 31 for a, _ in records)
        return f"{n} records, {writes} writes, {len(payload)} bytes"
