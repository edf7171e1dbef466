"""cocotb testbench of the ICRC engine alone (sim.tops.IcrcTop), against scapy and zlib."""

import random
import zlib

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ReadOnly, RisingEdge

from netagg.contract import headers as H
from tests import frames as F
from tests.tb import WIDTH


async def fold(dut, frame: bytes, end: int, idle: random.Random | None = None):
    """Feed `frame` beat by beat with region end `end`; return (final, ok) at that end."""
    nb = WIDTH // 8
    beats = [frame[i : i + nb] for i in range(0, len(frame), nb)]
    result = None
    for n, chunk in enumerate(beats):
        while idle is not None and idle.random() < 0.3:
            dut.valid.value = 0
            await RisingEdge(dut.clk)
        dut.valid.value = 1
        dut.data.value = int.from_bytes(chunk, "little")
        dut.last.value = int(n == len(beats) - 1)
        dut.region_end.value = end
        await ReadOnly()
        if dut.at_end.value:
            result = (int(dut.crc_state.value), int(dut.check_ok.value))
        await RisingEdge(dut.clk)
    dut.valid.value = 0
    return result


@cocotb.test()
async def icrc_matches_scapy(dut):
    """Checking passes for scapy's frames, the generated ICRC equals scapy's, and a flipped
    bit anywhere in the covered bytes fails the check; the variant fields do not matter."""
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    dut.rst.value = 1
    dut.valid.value = 0
    await RisingEdge(dut.clk)
    await RisingEdge(dut.clk)
    dut.rst.value = 0
    rng = random.Random(WIDTH)
    idle = random.Random(7)
    for frame in F.sweep(rng, [*range(0, 128, 3), 512, 1024, 4096]):
        final, ok = await fold(dut, frame, len(frame), idle)
        assert ok == 1, f"check of a good {len(frame)}-byte frame failed"
        final, _ = await fold(dut, frame[:-4] + bytes(4), len(frame) - 4, idle)
        assert (final ^ 0xFFFFFFFF).to_bytes(4, "little") == frame[-4:], "generated ICRC"
        bit = rng.randrange(8 * (len(frame) - H.ICRC_START))
        pos = H.ICRC_START + bit // 8
        if pos in H.ICRC_MASKED_BYTES:
            continue
        flipped = bytearray(frame)
        flipped[pos] ^= 1 << (bit % 8)
        _, ok = await fold(dut, bytes(flipped), len(frame), idle)
        assert ok == 0, f"flip of bit {bit % 8} of byte {pos} went unnoticed"
        varied = bytearray(frame)
        for b in H.ICRC_MASKED_BYTES:
            varied[b] = rng.randrange(256)
        varied[:H.ICRC_START] = bytes(rng.randrange(256) for _ in range(H.ICRC_START))
        _, ok = await fold(dut, bytes(varied), len(frame), idle)
        assert ok == 1, "a variant field or the Ethernet header changed the ICRC"


@cocotb.test()
async def crc_of_random_bytes(dut):
    """Over arbitrary bytes (no masked fields touched) the engine is zlib's CRC-32."""
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    dut.valid.value = 0
    await RisingEdge(dut.clk)
    rng = random.Random(WIDTH + 1)
    for length in [55, 56, 57, 63, 64, 65, 127, 128, 129, 200, 1000]:
        frame = bytearray(rng.randrange(256) for _ in range(length))
        for b in H.ICRC_MASKED_BYTES:
            frame[b] = 0xFF
        final, _ = await fold(dut, bytes(frame), length)
        want = zlib.crc32(b"\xff" * 8 + bytes(frame[H.ICRC_START :]))
        assert final ^ 0xFFFFFFFF == want, length
