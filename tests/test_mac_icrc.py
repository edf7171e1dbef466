"""The MAC's byte-serial ICRC stages (hw.mac_icrc.IcrcCheck, hw.mac_icrc.IcrcFill) in amaranth.sim,
against scapy's ICRC (scapy.contrib.roce computes it for every frame of tests/frames.py)."""

import random

from amaranth.sim import Simulator
from scapy.layers.inet import IP
from scapy.layers.l2 import ARP, Ether

from netagg.contract import wire as W
from netagg.hw import headers as H
from netagg.hw.mac_icrc import IcrcCheck, IcrcFill
from netagg.sim.scapy_frames import roce_frame
from tests import frames as F


def _roce_frames(rng):
    frames = F.sweep(rng, [0, 1, 4, 13, 64, 255, 1024])
    # A short SEND Only without payload (58 bytes) arrives padded to 60: the padding is
    # after the ICRC, outside what it covers.
    frames.append(bytes(roce_frame(0x04, rng=rng)) + b"\0\0")
    return frames


def _through(dut, frames, seed):
    """Feeds `frames` into a byte stage `dut` a byte at a time, with idle cycles between
    some, and reads its output with a reader that stalls; returns each frame out with its
    last byte's payload."""
    out_frames = []

    async def source(ctx):
        rng = random.Random(seed)
        for frame in frames:
            for i, byte in enumerate(frame):
                while rng.random() < 0.2:
                    ctx.set(dut.i.valid, 0)
                    await ctx.tick()
                ctx.set(dut.i.valid, 1)
                ctx.set(dut.i.payload, {"data": byte, "last": i == len(frame) - 1})
                await ctx.tick().until(dut.i.ready)
        ctx.set(dut.i.valid, 0)

    async def sink(ctx):
        rng = random.Random(seed + 1)
        got = bytearray()
        while len(out_frames) < len(frames):
            ready = rng.random() < 0.7
            ctx.set(dut.o.ready, ready)
            taken = ready and ctx.get(dut.o.valid)
            out = ctx.get(dut.o.payload)
            await ctx.tick()
            if taken:
                got.append(out.data)
                if out.last:
                    out_frames.append((bytes(got), out))
                    got = bytearray()

    sim = Simulator(dut)
    sim.add_clock(8e-9)
    sim.add_testbench(source)
    sim.add_testbench(sink)
    sim.run()
    return out_frames


def _check(frames):
    """Each frame out of IcrcCheck, with the icrc_ok of its last byte."""
    return [(data, bool(last.icrc_ok)) for data, last in _through(IcrcCheck(), frames, 3)]


def test_icrc_check_against_scapy():
    rng = random.Random(1)
    good = _roce_frames(rng)
    bad = []
    for frame in good[:6]:
        flipped = bytearray(frame)
        at = rng.randrange(H.IPV4_OFFSET, len(frame) - 4)
        while at in H.ICRC_MASKED_BYTES:
            at += 1
        flipped[at] ^= 1 << rng.randrange(8)
        bad.append(bytes(flipped))
    variant = bytearray(good[2])            # a new TTL and TOS leave the ICRC right
    variant[H.IPV4_OFFSET + 8] -= 1
    variant[H.IPV4_OFFSET + 1] ^= 0x20
    runt = good[0][:12]
    frames = good + bad + [bytes(variant), runt]
    results = _check(frames)
    assert [data for data, _ in results] == frames
    assert [ok for _, ok in results] == ([True] * len(good) + [False] * len(bad)
                                         + [True, False])


def _fill(frames, seed=5):
    return [data for data, _ in _through(IcrcFill(), frames, seed)]


def test_icrc_fill_against_scapy():
    """RoCEv2 frames sent with four zero bytes for the ICRC leave with scapy's ICRC, also
    when Ethernet padding follows, and so do results and control replies, which go from the
    switch's UDP port to a worker's own (not to 4791); other frames (ARP, IPv4 that is not
    UDP, a frame too short to be RoCEv2) leave unchanged."""
    rng = random.Random(2)
    roce = F.sweep(rng, [0, 4, 12, 100, 1024])
    switch, worker = W.Endpoint("192.168.1.50", 0xC000, 2), W.Endpoint("192.168.2.1", 0xD0D0, 3)
    result = F.scapy_frame(W.OP_RESULT, 0x123456, 9, bytes(range(64)), switch, worker,
                           reth=(0, 0x77, 64), imm=0x1234)
    reply = F.scapy_frame(W.OP_CONTROL, W.CONTROL_QPN, 3, bytes(16),
                          W.Endpoint("192.168.1.50", W.ROCEV2_PORT, 2), worker)
    roce += [result, reply]
    placeholders = [f[:-4] + bytes(4) for f in roce]
    arp = bytes(Ether(src="02:00:00:00:00:07") / ARP(op=2, psrc="192.168.1.50"))
    other = bytes(Ether() / IP(dst="10.0.0.1", proto=253) / bytes(40))
    tiny = bytes([1, 2, 3])
    padded = placeholders[0] + bytes(60 - len(placeholders[0]))
    frames = placeholders + [arp, other, tiny, padded] + placeholders[:2]
    assert _fill(frames) == roce + [arp, other, tiny, roce[0] + bytes(60 - len(roce[0]))] \
        + roce[:2]


def _beats(frame: bytes, nb: int = 8):
    for at in range(0, len(frame), nb):
        chunk = frame[at:at + nb]
        yield int.from_bytes(chunk, "little"), (1 << len(chunk)) - 1, at + nb >= len(frame)


def test_parser_takes_the_macs_verdict():
    """Parser(icrc="mac") has no ICRC engine: a frame's verdict on the ICRC is the icrc_ok
    its MAC gave with the last beat, whatever the frame's ICRC bytes say."""
    from netagg.hw.parser import Parser
    from tests.tb import layout_to_dict

    rng = random.Random(4)
    frames = F.sweep(rng, [0, 4, 20, 300])
    wrong = bytearray(frames[1])
    wrong[-1] ^= 0xFF
    cases = [(f, True) for f in frames] + [(frames[2], False), (bytes(wrong), True)]
    dut = Parser(64, icrc="mac")
    entries = []

    async def bench(ctx):
        ctx.set(dut.payload.ready, 1)
        ctx.set(dut.header.ready, 1)
        for frame, ok in cases:
            for data, keep, last in _beats(frame):
                ctx.set(dut.i.valid, 1)
                ctx.set(dut.i.payload, {"data": data, "keep": keep, "last": last,
                                        "icrc_ok": ok and last})
                await ctx.tick().until(dut.i.ready)
            ctx.set(dut.i.valid, 0)
            for _ in range(4):
                if ctx.get(dut.header.valid):
                    entries.append(layout_to_dict(ctx.get(dut.header.payload)))
                await ctx.tick()

    sim = Simulator(dut)
    sim.add_clock(40e-9)
    sim.add_testbench(bench)
    sim.run()
    verdicts = [H.Verdict(e["verdict"]) for e in entries]
    assert verdicts == [H.Verdict.OK] * 4 + [H.Verdict.BAD_ICRC, H.Verdict.OK]
    assert entries[:4] == [F.header_fields(f) for f in frames]


def test_deparser_and_icrc_fill_make_scapys_frames():
    """Deparser(icrc="mac") sends four zero bytes where the ICRC goes; the MAC's IcrcFill
    after it writes the ICRC: together they give scapy's frames byte for byte."""
    from amaranth import Module

    from netagg.hw.deparser import Deparser
    from tests.tb import pack_header

    rng = random.Random(6)
    frames = F.sweep(rng, [0, 4, 8, 60, 257, 1024])
    m = Module()
    m.submodules.deparser = deparser = Deparser(64, icrc="mac")
    m.submodules.fill = fill = IcrcFill()
    out_frames = []

    async def headers(ctx):
        for frame in frames:
            ctx.set(deparser.header.valid, 1)
            ctx.set(deparser.header.payload, H.PACKET_HEADER.from_bits(
                pack_header(F.header_fields(frame))))
            await ctx.tick().until(deparser.header.ready)
        ctx.set(deparser.header.valid, 0)

    async def payloads(ctx):
        for frame in frames:
            payload = F.payload_of(frame)
            for data, keep, last in _beats(payload) if payload else []:
                ctx.set(deparser.payload.valid, 1)
                ctx.set(deparser.payload.payload, {"data": data, "keep": keep, "last": last})
                await ctx.tick().until(deparser.payload.ready)
        ctx.set(deparser.payload.valid, 0)

    async def narrow(ctx):
        """The deparser's beats, a byte at a time, into IcrcFill (what the MAC's Narrow8
        does), and IcrcFill's bytes out."""
        got = bytearray()
        pending = []
        ctx.set(fill.o.ready, 1)
        while len(out_frames) < len(frames):
            fetch = not pending and ctx.get(deparser.o.valid)
            ctx.set(deparser.o.ready, fetch)
            if fetch:
                beat = ctx.get(deparser.o.payload)
                count = bin(beat.keep).count("1")
                pending = [(b, bool(beat.last) and i == count - 1)
                           for i, b in enumerate(beat.data.to_bytes(8, "little")[:count])]
            ctx.set(fill.i.valid, bool(pending))
            if pending:
                ctx.set(fill.i.payload, {"data": pending[0][0], "last": pending[0][1]})
            took = pending and ctx.get(fill.i.ready)
            gave = ctx.get(fill.o.valid)
            out = ctx.get(fill.o.payload)
            await ctx.tick()
            if took:
                pending.pop(0)
            if gave:
                got.append(out.data)
                if out.last:
                    out_frames.append(bytes(got))
                    got = bytearray()

    sim = Simulator(m)
    sim.add_clock(8e-9)
    sim.add_testbench(headers)
    sim.add_testbench(payloads)
    sim.add_testbench(narrow)
    sim.run()
    assert out_frames == frames
