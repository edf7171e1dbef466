"""Bus models and helpers shared by the cocotb testbenches (imported inside the simulator)."""

from __future__ import annotations

import os
import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge
from cocotbext.axi import AxiStreamBus, AxiStreamFrame, AxiStreamSink, AxiStreamSource

from netagg.hw import headers as H

WIDTH = int(os.environ.get("NETAGG_WIDTH", "64"))


def pauses(rng: random.Random, fraction: float):
    """A pause generator: True for about `fraction` of the cycles."""
    while True:
        yield rng.random() < fraction


def layout_to_dict(value) -> dict:
    """A data.Const of a struct layout as nested dicts of ints."""
    out = {}
    for name, _ in value.shape():
        item = getattr(value, name)
        out[name] = layout_to_dict(item) if hasattr(item, "shape") and hasattr(
            item.shape(), "__iter__") else int(item)
    return out


def pack_header(fields: dict) -> int:
    return H.PACKET_HEADER.const(fields).as_value().value


def unpack_header(bits: int) -> dict:
    return layout_to_dict(H.PACKET_HEADER.from_bits(bits))


class HeaderSource:
    """Drives a valid/ready/data header port, entries in order, with optional idle cycles."""

    def __init__(self, dut, prefix, clock, rng=None, idle=0.0):
        self.data = getattr(dut, f"{prefix}_data")
        self.valid = getattr(dut, f"{prefix}_valid")
        self.ready = getattr(dut, f"{prefix}_ready")
        self.clock, self.rng, self.idle = clock, rng or random.Random(1), idle
        self.queue = []
        self.valid.value = 0
        cocotb.start_soon(self._run())

    def send(self, entry: int):
        self.queue.append(entry)

    async def _run(self):
        while True:
            if not self.valid.value and self.queue and self.rng.random() >= self.idle:
                self.data.value = self.queue[0]
                self.valid.value = 1
            await ReadOnly()
            fired = bool(self.valid.value) and bool(self.ready.value)
            await RisingEdge(self.clock)
            if fired:
                self.queue.pop(0)
                self.valid.value = 0


class HeaderSink:
    """Takes entries from a valid/ready/data header port, with optional backpressure."""

    def __init__(self, dut, prefix, clock, rng=None, backpressure=0.0):
        self.data = getattr(dut, f"{prefix}_data")
        self.valid = getattr(dut, f"{prefix}_valid")
        self.ready = getattr(dut, f"{prefix}_ready")
        self.clock, self.rng, self.backpressure = clock, rng or random.Random(2), backpressure
        self.entries = []
        self.ready.value = 0
        cocotb.start_soon(self._run())

    async def _run(self):
        while True:
            self.ready.value = int(self.rng.random() >= self.backpressure)
            await ReadOnly()
            if self.valid.value and self.ready.value:
                self.entries.append(int(self.data.value))
            await RisingEdge(self.clock)


class DatapathTB:
    def __init__(self, dut, loopback: bool, idle=0.0, backpressure=0.0, seed=0, source=True):
        self.dut = dut
        self.rng = random.Random(seed)
        cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
        dut.loopback.value = int(loopback)
        if source:
            self.source = AxiStreamSource(AxiStreamBus.from_prefix(dut, "rx"), dut.clk, dut.rst)
        self.sink = AxiStreamSink(AxiStreamBus.from_prefix(dut, "tx"), dut.clk, dut.rst)
        if idle and source:
            self.source.set_pause_generator(pauses(random.Random(seed + 1), idle))
        if backpressure:
            self.sink.set_pause_generator(pauses(random.Random(seed + 2), backpressure))
        if not loopback:
            self.pl_sink = AxiStreamSink(AxiStreamBus.from_prefix(dut, "pl_o"), dut.clk, dut.rst)
            self.pl_source = AxiStreamSource(
                AxiStreamBus.from_prefix(dut, "pl_i"), dut.clk, dut.rst)
            self.hdr_sink = HeaderSink(dut, "hdr_o", dut.clk, random.Random(seed + 3),
                                       backpressure)
            self.hdr_source = HeaderSource(dut, "hdr_i", dut.clk, random.Random(seed + 4), idle)
            if idle:
                self.pl_source.set_pause_generator(pauses(random.Random(seed + 5), idle))
            if backpressure:
                self.pl_sink.set_pause_generator(pauses(random.Random(seed + 6), backpressure))

    async def reset(self):
        self.dut.rst.value = 1
        await ClockCycles(self.dut.clk, 4)
        self.dut.rst.value = 0
        await ClockCycles(self.dut.clk, 2)

    async def send(self, frame: bytes):
        await self.source.send(AxiStreamFrame(frame))

    async def recv_frames(self, sink, count: int, timeout_cycles: int) -> list[bytes]:
        out = []
        for _ in range(count):
            frame = await cocotb.triggers.with_timeout(
                sink.recv(), timeout_cycles * 10, "ns")
            out.append(bytes(frame.tdata))
        return out

    def counters(self) -> dict:
        out = {"passed": int(self.dut.passed.value)}
        for v in H.Verdict:
            if v != H.Verdict.OK:
                out[v.name] = int(getattr(self.dut, f"drops_{v.name.lower()}").value)
        return out

    def cycles_for(self, frames) -> int:
        """A generous bound on the cycles a list of frames needs."""
        beats = sum(len(f) // (WIDTH // 8) + 2 for f in frames)
        return 20 * beats + 2000
