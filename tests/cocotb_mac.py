"""cocotb testbench of the Ethernet MAC (sim.tops.MacTop) against cocotbext-eth's GMII models.

Frames are scapy's (Ethernet / IPv4 that is not UDP, with random payloads, and RoCEv2 frames
from tests/frames.py); the FCS, preamble and SFD on the GMII side are cocotbext-eth's (zlib's
CRC-32). Clocks: GMII receive and transmit at 125 MHz (different phases), core at 62.5 MHz.
"""

import random
import struct
import zlib

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge, Timer
from cocotbext.axi import AxiStreamBus, AxiStreamFrame, AxiStreamSink, AxiStreamSource
from cocotbext.eth import GmiiFrame, GmiiSink, GmiiSource
from scapy.layers.inet import IP
from scapy.layers.l2 import Ether

from netagg.contract import headers as H
from tests import frames as F
from tests.tb import pauses

CORE_NS, GMII_NS = 16, 8
PREAMBLE = bytes([0x55] * 7 + [0xD5])


class MacTB:
    def __init__(self, dut, seed=1, idle=0.0, backpressure=0.0):
        self.dut = dut
        self.rng = random.Random(seed)
        cocotb.start_soon(Clock(dut.clk, CORE_NS, unit="ns").start())
        cocotb.start_soon(Clock(dut.rx_clk, GMII_NS, unit="ns").start())
        cocotb.start_soon(self._tx_clock())
        self.gmii_source = GmiiSource(dut.gmii_rx_d, dut.gmii_rx_er, dut.gmii_rx_dv,
                                      dut.rx_clk, dut.rst)
        self.gmii_sink = GmiiSink(dut.gmii_tx_d, dut.gmii_tx_er, dut.gmii_tx_en,
                                  dut.tx_clk, dut.rst)
        self.sink = AxiStreamSink(AxiStreamBus.from_prefix(dut, "rx"), dut.clk, dut.rst)
        self.source = AxiStreamSource(AxiStreamBus.from_prefix(dut, "tx"), dut.clk, dut.rst)
        if backpressure:
            self.sink.set_pause_generator(pauses(random.Random(seed + 1), backpressure))
        if idle:
            self.source.set_pause_generator(pauses(random.Random(seed + 2), idle))
        self.gaps = []       # idle tx clock cycles between transmitted frames
        self.starts = []     # the first 8 bytes of each transmitted frame
        cocotb.start_soon(self._watch_gaps())

    async def _tx_clock(self):
        await Timer(3, unit="ns")
        await Clock(self.dut.tx_clk, GMII_NS, unit="ns").start()

    async def _watch_gaps(self):
        """GMII transmit as seen on the wires (GmiiSink leaves out a frame's first byte)."""
        idle, seen, start = 0, False, None
        while True:
            await RisingEdge(self.dut.tx_clk)
            if int(self.dut.gmii_tx_en.value):
                if start is None:
                    start = bytearray()
                    if seen:
                        self.gaps.append(idle)
                if len(start) < 8:
                    start.append(int(self.dut.gmii_tx_d.value))
                    if len(start) == 8:
                        self.starts.append(bytes(start))
                seen, idle = True, 0
            else:
                start = None
                idle += 1

    async def reset(self):
        self.dut.rst.value = 1
        await ClockCycles(self.dut.clk, 6)
        self.dut.rst.value = 0
        await ClockCycles(self.dut.clk, 4)

    def counters(self):
        return {name: int(getattr(self.dut, name).value)
                for name in ("rx_frames", "rx_crc_errors", "rx_overflows")}

    async def recv_rx(self, count, timeout_ns):
        got = []
        for _ in range(count):
            frame = await with_timeout(self.sink.recv(), timeout_ns)
            got.append(bytes(frame.tdata))
        return got

    async def recv_tx(self, count, timeout_ns):
        got = []
        for _ in range(count):
            got.append(await with_timeout(self.gmii_sink.recv(), timeout_ns))
        return got


async def with_timeout(coro, ns):
    from cocotb.triggers import with_timeout as wt
    return await wt(coro, ns, "ns")


def ip_frame(rng, size):
    """A scapy Ethernet/IPv4 frame of `size` bytes (without FCS, at least 34) that is not
    UDP: the MAC sends it as it is, with no ICRC written in."""
    head = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02") / IP(
        src="10.0.0.1", dst="10.0.0.2", proto=253)
    return bytes(head / bytes(rng.randrange(256) for _ in range(size - len(head))))


def padded(frame):
    return frame + bytes(max(0, 60 - len(frame)))


def mixed_frames(rng, count):
    sizes = [60, 61, 64, 100, 1000, 1100, 1514] + [rng.randrange(60, 1100) for _ in range(count)]
    frames = [ip_frame(rng, s) for s in sizes]
    frames += F.sweep(rng, [0, 4, 256, 1024])[:8]
    rng.shuffle(frames)
    return frames


def corrupt(rng, frame, how):
    """A GMII frame with a wrong FCS, a flipped data bit, or rx_er on one byte."""
    body = padded(frame)
    fcs = struct.pack("<L", zlib.crc32(body))
    if how == "fcs":
        fcs = bytes([fcs[0] ^ 0x01]) + fcs[1:]
        return GmiiFrame.from_raw_payload(body + fcs)
    if how == "data":
        at = rng.randrange(len(body))
        body = body[:at] + bytes([body[at] ^ (1 << rng.randrange(8))]) + body[at + 1:]
        return GmiiFrame.from_raw_payload(body + fcs)
    gmii = GmiiFrame.from_raw_payload(body + fcs)
    gmii.error = [0] * len(gmii.data)
    gmii.error[rng.randrange(8, len(gmii.data))] = 1
    return gmii


async def receive(tb, rng, count, bad_every=3):
    """Send good and bad frames back to back on GMII; the good ones come out on rx."""
    frames = mixed_frames(rng, count)
    good, bad = [], 0
    hows = ["fcs", "data", "er"]
    for n, frame in enumerate(frames):
        if n % bad_every == 1:
            await tb.gmii_source.send(corrupt(rng, frame, hows[bad % 3]))
            bad += 1
        else:
            await tb.gmii_source.send(GmiiFrame.from_payload(frame))
            good.append(padded(frame))
    time_ns = sum(len(f) + 24 for f in frames) * GMII_NS * 3 + 20_000
    got = await tb.recv_rx(len(good), time_ns)
    for n, (want, have) in enumerate(zip(good, got)):
        assert have == want, f"frame {n} ({len(want)} bytes) changed:\n{want.hex()}\n{have.hex()}"
    # A bad frame may still be on the wire behind the last good one (the good ones leave
    # the buffer 8 bytes a core cycle); it is counted once it has crossed.
    await tb.gmii_source.wait()
    await ClockCycles(tb.dut.clk, 50)
    return len(good), bad


async def transmit(tb, rng, count):
    """Send frames from the core; GMII carries preamble, SFD, padding, FCS, 12-byte gaps."""
    sizes = [14, 20, 59, 60, 61, 64, 1514] + [rng.randrange(14, 1100) for _ in range(count)]
    frames = [ip_frame(rng, s) if s >= 42 else bytes(rng.randrange(256) for _ in range(s))
              for s in sizes]
    for frame in frames:
        await tb.source.send(AxiStreamFrame(frame))
    time_ns = sum(max(len(f), 60) + 24 for f in frames) * GMII_NS * 2 + 20_000
    got = await tb.recv_tx(len(frames), time_ns)
    for n, (want, have) in enumerate(zip(frames, got)):
        assert tb.starts[n] == PREAMBLE, f"frame {n}: preamble {tb.starts[n].hex()}"
        assert have.error is None or not any(have.error), f"frame {n}: tx_er"
        assert have.check_fcs(), f"frame {n}: bad FCS"
        assert bytes(have.get_payload()) == padded(want), f"frame {n} changed"
    return len(frames)


@cocotb.test()
async def receive_checks_fcs(dut):
    """Good frames pass untouched (padding kept, FCS stripped); frames with a wrong FCS, a
    flipped bit, or rx_er are dropped and counted; frames come back to back (12-byte gap)."""
    tb = MacTB(dut, seed=1, backpressure=0.3)
    await tb.reset()
    good, bad = await receive(tb, random.Random(1), 30)
    assert tb.counters() == {"rx_frames": good, "rx_crc_errors": bad, "rx_overflows": 0}
    assert tb.sink.empty()


@cocotb.test()
async def transmit_line_rate(dut):
    """Frames from the core leave with preamble, SFD, padding to 60 bytes and the FCS, and
    back to back with exactly the 12-byte inter-frame gap (line rate)."""
    tb = MacTB(dut, seed=2)
    await tb.reset()
    sent = await transmit(tb, random.Random(2), 30)
    assert len(tb.gaps) == sent - 1
    assert min(tb.gaps) >= 12, tb.gaps
    # The core is faster than the wire: after the first frames, every gap is the minimum.
    assert all(g == 12 for g in tb.gaps[2:]), tb.gaps


@cocotb.test()
async def both_directions(dut):
    """Receive (with bad frames) and transmit at once, idle cycles on the core's source and
    backpressure on its sink."""
    tb = MacTB(dut, seed=3, idle=0.2, backpressure=0.2)
    await tb.reset()
    rx = cocotb.start_soon(receive(tb, random.Random(3), 20))
    tx = cocotb.start_soon(transmit(tb, random.Random(4), 20))
    good, bad = await rx
    await tx
    assert tb.counters() == {"rx_frames": good, "rx_crc_errors": bad, "rx_overflows": 0}
    assert min(tb.gaps) >= 12


@cocotb.test()
async def receive_overflow(dut):
    """With the core not taking frames, the receive buffer fills: frames that do not fit are
    dropped whole and counted, the others come out intact and in order."""
    tb = MacTB(dut, seed=4)
    await tb.reset()
    tb.sink.pause = True
    rng = random.Random(5)
    frames = [ip_frame(rng, 1000) for _ in range(5)]
    for frame in frames:
        await tb.gmii_source.send(GmiiFrame.from_payload(frame))
    while not tb.gmii_source.empty() or tb.gmii_source.active:
        await ClockCycles(dut.rx_clk, 100)
    await ClockCycles(dut.rx_clk, 100)
    counters = tb.counters()
    assert counters["rx_overflows"] > 0 and counters["rx_crc_errors"] == 0, counters
    assert counters["rx_frames"] + counters["rx_overflows"] == len(frames), counters
    tb.sink.pause = False
    got = await tb.recv_rx(counters["rx_frames"], 100_000)
    assert got == frames[:counters["rx_frames"]]
    # And the buffer is usable again.
    more = ip_frame(rng, 200)
    await tb.gmii_source.send(GmiiFrame.from_payload(more))
    assert await tb.recv_rx(1, 50_000) == [more]


@cocotb.test()
async def icrc_both_ways(dut):
    """The boards' MAC does the RoCEv2 ICRC: received frames carry its verdict (rx_tuser on
    the last beat: scapy's frames right, a flipped bit wrong, with a good FCS either way),
    and RoCEv2 frames sent with four zero bytes for the ICRC leave with scapy's ICRC."""
    tb = MacTB(dut, seed=6, backpressure=0.2)
    await tb.reset()
    rng = random.Random(6)
    frames = F.sweep(rng, [0, 4, 33, 256, 1024, 8])
    flipped = []
    for frame in frames[:3]:
        body = bytearray(frame)
        at = rng.randrange(H.UDP_OFFSET + 8, len(body))    # BTH on, past the UDP checksum
        while at == H.BTH_OFFSET + 4:                       # a variant byte, not covered
            at += 1
        body[at] ^= 1 << rng.randrange(8)
        flipped.append(bytes(body))
    sent = frames + flipped
    for frame in sent:
        await tb.gmii_source.send(GmiiFrame.from_payload(frame))
    verdicts = []
    for _ in sent:
        frame = await with_timeout(tb.sink.recv(), 200_000)
        tuser = frame.tuser
        verdicts.append(bool(tuser[-1] if isinstance(tuser, list) else tuser))
        assert bytes(frame.tdata) in (padded(f) for f in sent)
    assert verdicts == [True] * len(frames) + [False] * len(flipped)
    assert tb.counters()["rx_crc_errors"] == 0

    for frame in frames:
        await tb.source.send(AxiStreamFrame(frame[:-4] + bytes(4)))
    got = await tb.recv_tx(len(frames), 200_000)
    for n, (want, have) in enumerate(zip(frames, got)):
        assert have.check_fcs(), f"frame {n}: bad FCS"
        assert bytes(have.get_payload()) == padded(want), f"frame {n}: ICRC not scapy's"
