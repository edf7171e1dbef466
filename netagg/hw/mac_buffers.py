"""The MAC's buffers and byte gearboxes: `FrameBuffer` (a ring that lets out whole frames
only, rolling back bad ones), `Skid` (a register slice), and `Widen8` / `Narrow8` between
bytes and packed beats (`packed_beat`, `received_beat`).
"""

from amaranth import Cat, Const, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from .mac_bytes import BYTE, CHECKED_BYTE, ICRC_CHECKED_BYTE

COUNTER_WIDTH = 32

class FrameBuffer(wiring.Component):
    """A ring of `depth` entries of `shape` (a layout with a ``last`` field) that lets out
    only whole frames.

    `ok` is read with the last entry of each frame: a frame is committed when it ends ok and
    fits; otherwise the write pointer rolls back to the frame's start, and `crc_errors` (not
    ok) or `overflows` (did not fit) counts it. With `backpressure`, the input waits for room
    instead of dropping, `ok` is ignored, and a frame larger than the ring is let out as it
    comes once it fills the ring. Output: one entry per cycle, one cycle after a frame is
    committed.

    `full` is a register computed from the previous cycle's pointers, and conservative: it is
    set when at most one entry is free, so the ring holds `depth` - 1 entries. The read side
    computes the pointer after this one a cycle ahead.
    """

    def __init__(self, shape, depth: int, backpressure: bool = False):
        if depth < 16 or depth & (depth - 1):
            raise ValueError(f"depth must be a power of two of at least 16, not {depth}")
        self.shape, self.depth, self.backpressure = shape, depth, backpressure
        super().__init__({
            "i": In(stream.Signature(shape, always_ready=not backpressure)),
            "ok": In(1),
            "o": Out(stream.Signature(shape)),
            "frames": Out(COUNTER_WIDTH),
            "crc_errors": Out(COUNTER_WIDTH),
            "overflows": Out(COUNTER_WIDTH),
        })

    def elaborate(self, platform):
        m = Module()
        depth = self.depth
        ptr = range(2 * depth)
        m.submodules.ring = ring = Memory(shape=self.shape, depth=depth, init=[])
        write_port = ring.write_port()
        read_port = ring.read_port(transparent_for=())
        write_ptr, commit_ptr, read_ptr = Signal(ptr), Signal(ptr), Signal(ptr)
        overflow = Signal()
        # At most one entry was written since the pointers this is computed from.
        full = Signal()
        m.d.sync += full.eq((write_ptr - read_ptr)[:len(write_ptr)] >= depth - 1)

        last = self.i.payload.last
        if self.backpressure:
            m.d.comb += self.i.ready.eq(~full)
            with m.If(full & (commit_ptr == read_ptr)):     # a frame larger than the ring
                m.d.sync += commit_ptr.eq(write_ptr)
        with m.If(self.i.valid & (~full if self.backpressure else 1)):
            with m.If(~full & ~overflow):
                m.d.comb += [write_port.addr.eq(write_ptr), write_port.data.eq(self.i.payload),
                             write_port.en.eq(1)]
            with m.If(last):
                m.d.sync += overflow.eq(0)
                ok = self.ok | Const(int(self.backpressure))
                with m.If(~ok):
                    m.d.sync += [write_ptr.eq(commit_ptr),
                                 self.crc_errors.eq(self.crc_errors + 1)]
                with m.Elif(full | overflow):
                    m.d.sync += [write_ptr.eq(commit_ptr), self.overflows.eq(self.overflows + 1)]
                with m.Else():
                    m.d.sync += [write_ptr.eq(write_ptr + 1), commit_ptr.eq(write_ptr + 1),
                                 self.frames.eq(self.frames + 1)]
            with m.Elif(full):
                m.d.sync += overflow.eq(1)
            with m.Elif(~overflow):
                m.d.sync += write_ptr.eq(write_ptr + 1)

        next_read = Signal(ptr)
        after = Signal(ptr, init=1)         # read_ptr + 1
        advance = self.o.valid & self.o.ready
        m.d.comb += [
            next_read.eq(Mux(advance, after, read_ptr)),
            read_port.addr.eq(next_read),
            self.o.payload.eq(read_port.data),
        ]
        m.d.sync += [
            read_ptr.eq(next_read), after.eq(next_read + 1),
            self.o.valid.eq(Mux(advance, after != commit_ptr, read_ptr != commit_ptr)),
        ]
        return m


class Skid(wiring.Component):
    """A register slice of a stream of `shape`: `o` (valid and payload) and `i.ready` come
    from flip-flops, so no combinational path crosses it; one entry per cycle, latency 1.
    A second register (the skid) holds the entry taken in a cycle in which `o` stalled."""

    def __init__(self, shape):
        self.shape = shape
        super().__init__({"i": In(stream.Signature(shape)), "o": Out(stream.Signature(shape))})

    def elaborate(self, platform):
        m = Module()
        # Only the valid flags are reset: a reset net into every payload bit is routing
        # that 125 MHz paths cannot spare.
        payload = Signal(self.shape, reset_less=True)
        spare = Signal(self.shape, reset_less=True)
        spare_valid = Signal()
        m.d.comb += [self.i.ready.eq(~spare_valid), self.o.payload.eq(payload)]
        with m.If(self.o.ready | ~self.o.valid):
            with m.If(spare_valid):
                m.d.sync += [payload.eq(spare), self.o.valid.eq(1), spare_valid.eq(0)]
            with m.Else():
                m.d.sync += [payload.eq(self.i.payload), self.o.valid.eq(self.i.valid)]
        with m.Elif(self.i.valid & ~spare_valid):
            m.d.sync += [spare.eq(self.i.payload), spare_valid.eq(1)]
        return m


def packed_beat(width: int):
    """A beat with its byte count instead of `keep` (beats are packed from byte 0): 68 bits
    at width 64, one 72-bit block RAM word."""
    return data.StructLayout({"data": width, "count": range(width // 8), "last": 1})


def received_beat(width: int, checked: bool = False):
    """A received beat as it crosses into the core clock: packed (`packed_beat`), with the
    frame's FCS verdict ``ok`` (and, when `checked`, its ICRC verdict ``icrc_ok``), both read
    on the last beat."""
    fields = {"data": width, "count": range(width // 8), "last": 1, "ok": 1}
    if checked:
        fields["icrc_ok"] = 1
    return data.StructLayout(fields)


class Widen8(wiring.Component):
    """Gathers bytes into packed beats of `width` bits (`received_beat`: first byte in the
    lowest bits, the byte count less one); a frame's last byte ends its beat and gives it
    its ``ok`` (and, when `checked`, ``icrc_ok``). One byte in per cycle; latency 1 cycle."""

    def __init__(self, width: int, checked: bool = False):
        self.width, self.checked = width, checked
        super().__init__({
            "i": In(stream.Signature(ICRC_CHECKED_BYTE if checked else CHECKED_BYTE)),
            "o": Out(stream.Signature(received_beat(width, checked))),
        })

    def elaborate(self, platform):
        m = Module()
        n = self.width // 8
        gathered = Signal(self.width, reset_less=True)
        lane = Signal(range(n))
        closes = self.i.payload.last | (lane == n - 1)
        m.d.comb += self.i.ready.eq(~self.o.valid | self.o.ready | ~closes)
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        with m.If(self.i.valid & self.i.ready):
            data = Cat(*(Mux(lane == k, self.i.payload.data, gathered[8 * k:8 * k + 8])
                         for k in range(n)))
            with m.If(closes):
                m.d.sync += [
                    self.o.payload.data.eq(data), self.o.payload.count.eq(lane),
                    self.o.payload.last.eq(self.i.payload.last),
                    self.o.payload.ok.eq(self.i.payload.ok), self.o.valid.eq(1), lane.eq(0),
                ]
                if self.checked:
                    m.d.sync += self.o.payload.icrc_ok.eq(self.i.payload.icrc_ok)
            with m.Else():
                m.d.sync += [gathered.eq(data), lane.eq(lane + 1)]
        return m


class Narrow8(wiring.Component):
    """Gives out the bytes of packed beats of `width` bits (`packed_beat`: bytes from byte 0
    and their count less one), one per cycle, the frame's last byte marked. Latency 1 cycle.
    The held beat shifts down a byte per byte given, and whether the byte given is the
    beat's last is a register, so the output and `i.ready` come from flip-flops."""

    def __init__(self, width: int):
        self.width = width
        super().__init__({
            "i": In(stream.Signature(packed_beat(width))),
            "o": Out(stream.Signature(BYTE)),
        })

    def elaborate(self, platform):
        m = Module()
        held = Signal(self.width, reset_less=True)
        frame_ends = Signal()               # the held beat is its frame's last
        left = Signal(range(self.width // 8))   # bytes held after the one given now
        single = Signal()                   # left == 0
        full = Signal()
        m.d.comb += [
            self.o.valid.eq(full),
            self.o.payload.data.eq(held[:8]),
            self.o.payload.last.eq(frame_ends & single),
            self.i.ready.eq(~full | (self.o.ready & single)),
        ]
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += [held.eq(held >> 8), left.eq(left - 1), single.eq(left == 1)]
            with m.If(single):
                m.d.sync += full.eq(0)
        with m.If(self.i.valid & self.i.ready):
            count = self.i.payload.count
            m.d.sync += [held.eq(self.i.payload.data), frame_ends.eq(self.i.payload.last),
                         left.eq(count), single.eq(count == 0), full.eq(1)]
        return m
