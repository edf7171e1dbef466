"""cocotb testbench of one port's datapath (parser, packet queue, deparser): sim.tops.DatapathTop.

Frames come from scapy (tests/frames.py); the width comes from NETAGG_WIDTH. The line-rate
testcase is the benchmark's (netagg/sim/bench_datapath.py).
"""

import os
import random
import struct

import cocotb
from cocotb.triggers import ClockCycles
from cocotbext.axi import AxiStreamFrame
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from netagg.contract import headers as H
from netagg.sim.bench_datapath import drive_back_to_back
from netagg.sim.scapy_frames import roce_frame
from tests import frames as F
from tests.tb import WIDTH, DatapathTB, pack_header, unpack_header

SIZES = [*range(128), 512, 1024, 4096]
MODES = {"idle": (0.3, 0.0), "backpressure": (0.0, 0.3), "both": (0.2, 0.2), "none": (0.0, 0.0)}
V = H.Verdict


def _mode():
    return MODES[os.environ.get("NETAGG_MODE", "both")]


@cocotb.test()
async def roundtrip(dut):
    """Parse, queue and deparse give back scapy's bytes exactly, ICRC included."""
    idle, bp = _mode()
    tb = DatapathTB(dut, loopback=True, idle=idle, backpressure=bp, seed=11)
    await tb.reset()
    frames = F.sweep(random.Random(WIDTH), SIZES)
    for frame in frames:
        await tb.send(frame)
    got = await tb.recv_frames(tb.sink, len(frames), tb.cycles_for(frames))
    for n, (want, have) in enumerate(zip(frames, got)):
        assert have == want, f"frame {n} ({len(want)} bytes) changed:\n{want.hex()}\n{have.hex()}"
    counters = tb.counters()
    assert counters["passed"] == len(frames)
    assert all(v == 0 for k, v in counters.items() if k != "passed"), counters


@cocotb.test()
async def parser_output(dut):
    """Header entries carry scapy's field values; the payload stream carries the payload."""
    idle, bp = _mode()
    tb = DatapathTB(dut, loopback=False, idle=idle, backpressure=bp, seed=12)
    await tb.reset()
    frames = F.sweep(random.Random(WIDTH + 1), SIZES)
    for frame in frames:
        await tb.send(frame)
    payloads = [F.payload_of(f) for f in frames]
    nonempty = [p for p in payloads if p]
    got = await tb.recv_frames(tb.pl_sink, len(nonempty), tb.cycles_for(frames))
    for _ in range(100):
        if len(tb.hdr_sink.entries) == len(frames):
            break
        await ClockCycles(dut.clk, 10)
    assert len(tb.hdr_sink.entries) == len(frames)
    for n, (frame, bits) in enumerate(zip(frames, tb.hdr_sink.entries)):
        assert unpack_header(bits) == F.header_fields(frame), f"header of frame {n}"
    assert got == nonempty


@cocotb.test()
async def deparser_output(dut):
    """Header entries and payloads from scapy's fields make scapy's frames, ICRC included."""
    idle, bp = _mode()
    tb = DatapathTB(dut, loopback=False, idle=idle, backpressure=bp, seed=13)
    await tb.reset()
    frames = F.sweep(random.Random(WIDTH + 2), SIZES)
    for frame in frames:
        fields = F.header_fields(frame)
        # The deparser computes these itself: give it wrong values to prove it.
        fields["ip"]["checksum"] ^= 0x5A5A
        fields["ip"]["total_length"] = 1
        fields["udp"]["length"] = 2
        fields["bth"]["padcnt"] = (fields["bth"]["padcnt"] + 1) % 4
        fields["verdict"] = int(V.BAD_ICRC)
        tb.hdr_source.send(pack_header(fields))
        payload = F.payload_of(frame)
        if payload:
            await tb.pl_source.send(AxiStreamFrame(payload))
    got = await tb.recv_frames(tb.sink, len(frames), tb.cycles_for(frames))
    for n, (want, have) in enumerate(zip(frames, got)):
        assert have == want, f"frame {n}:\n{want.hex()}\n{have.hex()}"


def _fix_ip_checksum(frame: bytearray) -> bytearray:
    frame[24:26] = b"\0\0"
    words = struct.unpack("!10H", bytes(frame[14:34]))
    total = sum(words)
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    frame[24:26] = struct.pack("!H", ~total & 0xFFFF)
    return frame


def _edit(frame: bytes, offset: int, fmt: str, fn, fix_checksum=True) -> bytes:
    out = bytearray(frame)
    size = struct.calcsize(fmt)
    (value,) = struct.unpack(fmt, out[offset : offset + size])
    out[offset : offset + size] = struct.pack(fmt, fn(value) & ((1 << 8 * size) - 1))
    return bytes(_fix_ip_checksum(out) if fix_checksum else out)


def corruptions(rng: random.Random):
    """(name, bad frame, expected verdict) for each header field and random bit flips."""
    base = bytes(roce_frame(0x0A, bytes(rng.randrange(256) for _ in range(64)), rng=rng))
    ack = bytes(roce_frame(0x11, b"", rng=rng))
    cases = [
        ("ethertype IPv6", _edit(base, 12, "!H", lambda v: 0x86DD, False), V.NOT_ROCE),
        ("ARP frame", bytes(Ether(type=0x0806) / (b"\0" * 46)), V.NOT_ROCE),
        ("IP version 6", _edit(base, 14, "!B", lambda v: 0x65), V.NOT_ROCE),
        ("IP options", bytes(Ether() / IP(options=b"\x01\x01\x01\x00") / UDP(dport=4791)
                             / BTH(opcode=0x04) / (b"\0" * 40)), V.NOT_ROCE),
        ("TCP", _edit(base, 23, "!B", lambda v: 6), V.NOT_ROCE),
        ("fragment", _edit(base, 20, "!H", lambda v: 0x2000), V.NOT_ROCE),
        ("UDP port", _edit(base, 36, "!H", lambda v: 4792), V.NOT_ROCE),
        ("BTH TVer", _edit(base, 43, "!B", lambda v: v | 1), V.NOT_ROCE),
        ("IP checksum", _edit(base, 24, "!H", lambda v: v ^ 0x0100, False), V.BAD_IP_CHECKSUM),
        ("IP total length long", _edit(base, 16, "!H", lambda v: v + 4), V.TRUNCATED),
        ("IP total length short", _edit(base, 16, "!H", lambda v: v - 4), V.BAD_LENGTH),
        ("UDP length long", _edit(base, 38, "!H", lambda v: v + 4), V.BAD_LENGTH),
        ("UDP length short", _edit(base, 38, "!H", lambda v: v - 4), V.BAD_LENGTH),
        ("UDP length tiny", _edit(base, 38, "!H", lambda v: 12), V.BAD_LENGTH),
        ("PadCnt", _edit(ack, 43, "!B", lambda v: v | 0x30), V.BAD_LENGTH),
        ("ACK with payload", _reicrc(_edit(
            bytes(roce_frame(0x04, b"wxyz1234", rng=rng)), 42, "!B", lambda v: 0x11)),
         V.BAD_LENGTH),
        ("trailing bytes", base + b"\0" * 8, V.BAD_LENGTH),
        ("opcode 0x12", _reicrc(_edit(base, 42, "!B", lambda v: 0x12)), V.BAD_OPCODE),
        ("opcode UD", _reicrc(_edit(base, 42, "!B", lambda v: 0x64)), V.BAD_OPCODE),
        ("opcode UC READ", _reicrc(_edit(base, 42, "!B", lambda v: 0x2C)), V.BAD_OPCODE),
        ("truncated in Ethernet", base[:10], V.TRUNCATED),
        ("truncated in IPv4", base[:30], V.TRUNCATED),
        ("truncated in UDP", base[:40], V.TRUNCATED),
        ("truncated in BTH", base[:50], V.TRUNCATED),
        ("truncated in payload", base[:100], V.TRUNCATED),
        ("truncated in ICRC", base[:-1], V.TRUNCATED),
        ("PSN", _edit(base, 51, "!B", lambda v: v ^ 1), V.BAD_ICRC),
        ("QPN", _edit(base, 49, "!B", lambda v: v ^ 0x80), V.BAD_ICRC),
        ("RETH", _edit(base, 60, "!B", lambda v: v ^ 4), V.BAD_ICRC),
        ("IP source", _edit(base, 26, "!B", lambda v: v ^ 1), V.BAD_ICRC),
    ]
    for _ in range(12):
        bit = rng.randrange(8 * (len(base) - 74)) + 8 * 74   # payload or ICRC
        flipped = bytearray(base)
        flipped[bit // 8] ^= 1 << (bit % 8)
        cases.append((f"bit flip {bit}", bytes(flipped), V.BAD_ICRC))
    return cases


def _reicrc(frame: bytes) -> bytes:
    """The frame with the ICRC scapy computes for its (edited) bytes."""
    pkt = Ether(frame)
    pkt[BTH].icrc = None
    return bytes(pkt)


@cocotb.test()
async def corrupted_frames(dut):
    """Each bad frame is dropped with its reason; the good frames around it pass untouched."""
    idle, bp = _mode()
    tb = DatapathTB(dut, loopback=True, idle=idle, backpressure=bp, seed=14)
    await tb.reset()
    rng = random.Random(WIDTH + 3)
    cases = corruptions(rng)
    good, expected = [], {v.name: 0 for v in V if v != V.OK}
    for n, (_, bad, verdict) in enumerate(cases):
        before = bytes(roce_frame(0x0A, bytes(rng.randrange(256) for _ in range(n % 70)),
                                    rng=rng, psn=2 * n))
        after = bytes(roce_frame(0x04, bytes(rng.randrange(256) for _ in range(n % 33)),
                                   rng=rng, psn=2 * n + 1))
        for frame in (before, bad, after):
            await tb.send(frame)
        good += [before, after]
        expected[verdict.name] += 1
    # Frames whose variant fields changed, and one with Ethernet padding, still pass.
    masked = _edit(good[0], 15, "!B", lambda v: 0xB9)          # DSCP and ECN
    masked = _edit(masked, 22, "!B", lambda v: 3)               # TTL
    masked = _edit(masked, 46, "!B", lambda v: v | 0xC0, False)  # FECN, BECN
    short = bytes(roce_frame(0x04, b"", rng=rng))
    for frame in (masked, short + b"\0" * (60 - len(short))):
        await tb.send(frame)
    good += [masked, short]
    got = await tb.recv_frames(tb.sink, len(good), tb.cycles_for(good) * 3)
    assert len(got) == len(good)
    for n, (want, have) in enumerate(zip(good, got)):
        assert have == want, f"good frame {n} changed"
    await ClockCycles(dut.clk, 50)
    counters = tb.counters()
    assert counters.pop("passed") == len(good)
    names = {name: verdict.name for name, _, verdict in cases}
    assert counters == expected, (counters, expected, names)


@cocotb.test()
async def runt_behind_each_size(dut):
    """A one-beat frame right behind good frames of every payload size and class: when a
    good frame's last beat completes two payload beats, the parser still owes the second
    and the frame's header entry as the runt arrives. The good frames pass untouched and
    every runt is counted as TRUNCATED."""
    tb = DatapathTB(dut, loopback=True, seed=16, source=False)
    dut.rx_tvalid.value = 0
    await tb.reset()
    nb = WIDTH // 8
    good = F.sweep(random.Random(WIDTH + 5), range(2 * nb + 13))
    runt = good[0][:8]
    frames = [frame for g in good for frame in (g, runt)]
    await drive_back_to_back(dut, frames)
    got = await tb.recv_frames(tb.sink, len(good), tb.cycles_for(frames))
    for n, (want, have) in enumerate(zip(good, got)):
        assert have == want, f"good frame {n} ({len(want)} bytes) changed"
    await ClockCycles(dut.clk, 50)
    counters = tb.counters()
    assert counters.pop("passed") == len(good)
    assert counters == {v.name: len(good) if v == V.TRUNCATED else 0
                        for v in V if v != V.OK}, counters
