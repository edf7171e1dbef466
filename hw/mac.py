"""Gigabit Ethernet MAC: GMII on one side, the switch's frame beats on the other.

    rx clock:   GMII rx -> GmiiRx: strip preamble/SFD, check and strip the FCS
                -> [IcrcCheck] -> Widen8 (8 -> width) -> AsyncFifo
    core clock: -> FrameBuffer (2 KB of beats: commits good frames, rolls back bad ones)
                -> rx beats
    core clock: tx beats -> FrameBuffer (2 KB of beats: a frame leaves once it is whole)
                -> AsyncFifo
    tx clock:   -> Narrow8 (width -> 8) -> Skid -> [IcrcFill -> Skid] -> GmiiTx: preamble/SFD,
                padding to 60 bytes, FCS, 12 idle bytes between frames -> GMII tx

The 125 MHz sides hold no block RAM and little logic: the buffers are on the core side of
the crossings, where the clock is 5 times slower, and every 125 MHz path starts and ends
at a flip-flop close by (see `hw.cdc`; the `Skid` slices cut a byte's ready path in front
of the FCS and ICRC networks).

Frames toward the switch carry no FCS and keep their Ethernet padding; frames from the switch
get padding and FCS here. A received frame is dropped, and counted, when its FCS is wrong or
the PHY signalled an error (`rx_crc_errors`), or when it does not fit in the receive buffer
because the core is not taking frames (`rx_overflows`); `rx_frames` counts frames passed on.
The counters are in the core clock domain. Latency: a received frame leaves a few core
cycles after its last FCS byte (store and forward); a frame to send starts on the wire about
25 tx cycles after its last beat reached the tx buffer. Memory: two block RAMs per direction
(256 beats of 69 bits received, 256 x 68 bits to send, at width 64). Gigabit only (one byte
per tx/rx clock).

With ``icrc=True`` (the boards), `IcrcCheck` checks each received frame's RoCEv2 ICRC and
`IcrcFill` before GmiiTx writes the ICRC of each RoCEv2 frame sent, a byte at a time: a few
hundred LUTs per port instead of the switch's 64-bit ICRC engines.

`RgmiiPhy` (hw/mac_rgmii.py) turns the GMII side into RGMII on an ECP5; simulation drives GMII.
"""

from amaranth import Cat, ClockDomain, ClockSignal, Const, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from . import headers as H
from .beat import FrameStream, check_width
from .cdc import AsyncFifo
from .icrc import PREFIX_STATE, RESIDUE

PREAMBLE = 0x55
SFD = 0xD5
MIN_FRAME = 60          # bytes before the FCS
IFG = 12                # idle bytes between frames
CRC_POLY = 0xEDB88320   # reflected IEEE 802.3
CRC_RESIDUE = 0xDEBB20E3  # register over a frame and its own FCS (before the final inversion)
COUNTER_WIDTH = 32

BYTE = data.StructLayout({"data": 8, "last": 1})
CHECKED_BYTE = data.StructLayout({"data": 8, "last": 1, "ok": 1})
ICRC_CHECKED_BYTE = data.StructLayout({"data": 8, "last": 1, "ok": 1, "icrc_ok": 1})
# Bytes an IPv4 (without options) UDP frame has at these offsets. Every UDP frame the switch
# sends is RoCEv2: its results and control replies, from its own UDP port to the worker's,
# so no port marks them (ARP replies, the board's only other frames, do not match).
UDP_SIGNATURE = {12: H.ETHERTYPE_IPV4 >> 8, 13: H.ETHERTYPE_IPV4 & 0xFF, 14: 0x45,
                 23: H.IP_PROTO_UDP}


def crc32_byte(crc, byte):
    """The CRC-32 register after one more byte (LSB first): an XOR network, derived by
    running the bitwise algorithm on each input bit alone (the map is linear)."""
    def step(c, d):
        for i in range(8):
            c = (c >> 1) ^ (CRC_POLY if (c ^ (d >> i)) & 1 else 0)
        return c
    terms = [[] for _ in range(32)]
    inputs = [(crc[i], 1 << i, 0) for i in range(32)] + [(byte[i], 0, 1 << i) for i in range(8)]
    for signal, c, d in inputs:
        out = step(c, d)
        for bit in range(32):
            if out >> bit & 1:
                terms[bit].append(signal)
    out = []
    for bit in range(32):
        value = terms[bit][0]
        for term in terms[bit][1:]:
            value = value ^ term
        out.append(value)
    return Cat(*out)


class GmiiRx(wiring.Component):
    """GMII receive: takes the bytes after the SFD, and gives them out without the FCS,
    delayed by 5 bytes (the FCS and one more), the last one marked with `ok` (FCS right, no
    rx_er, at least one byte before the FCS). The output cannot wait (always ready).

    Two register stages come first (2 cycles): one takes the GMII signals as they come, so
    that the wires from the pins, on the die's edge, end at a flip-flop; the other holds the
    byte with the preamble and SFD compares that the state machine branches on."""

    rx_data: In(8)
    rx_dv: In(1)
    rx_er: In(1)
    o: Out(stream.Signature(CHECKED_BYTE, always_ready=True))

    def elaborate(self, platform):
        m = Module()
        data_in, dv_in, er_in = Signal(8, reset_less=True), Signal(), Signal()
        data, dv, er = Signal(8, reset_less=True), Signal(), Signal()
        sfd, preamble = Signal(), Signal()
        m.d.sync += [
            data_in.eq(self.rx_data), dv_in.eq(self.rx_dv), er_in.eq(self.rx_er),
            data.eq(data_in), dv.eq(dv_in), er.eq(er_in),
            sfd.eq(dv_in & (data_in == SFD)), preamble.eq(data_in == PREAMBLE),
        ]
        held = Signal(40)            # the last five bytes, oldest in the low bits
        count = Signal(range(6))     # bytes held, up to 5
        crc = Signal(32, init=0xFFFFFFFF)
        error = Signal()
        with m.If(self.o.valid):
            m.d.sync += self.o.valid.eq(0)
        with m.FSM():
            with m.State("IDLE"):
                with m.If(sfd):
                    m.d.sync += [count.eq(0), crc.eq(0xFFFFFFFF), error.eq(0)]
                    m.next = "DATA"
                with m.Elif(dv & ~preamble):
                    m.next = "SKIP"
            with m.State("SKIP"):        # a frame without a proper preamble: ignore it
                with m.If(~dv):
                    m.next = "IDLE"
            with m.State("DATA"):
                with m.If(dv):
                    m.d.sync += [
                        held.eq(Cat(held[8:], data)),
                        crc.eq(crc32_byte(crc, data)),
                        error.eq(error | er),
                    ]
                    with m.If(count == 5):
                        m.d.sync += [self.o.valid.eq(1), self.o.payload.data.eq(held[:8]),
                                     self.o.payload.last.eq(0)]
                    with m.Else():
                        m.d.sync += count.eq(count + 1)
                with m.Else():
                    m.d.sync += [
                        self.o.valid.eq(count == 5), self.o.payload.data.eq(held[:8]),
                        self.o.payload.last.eq(1),
                        self.o.payload.ok.eq(~error & (crc == CRC_RESIDUE)),
                    ]
                    m.next = "IDLE"
        return m


# What the ICRC stages need to know of a frame offset, kept in flip-flops one byte ahead (each
# flag computed, when a byte goes, for the offset after it) so that the 125 MHz paths start
# at a register: offset compares never sit in front of the CRC's XOR network.
OFFSET_FLAGS = data.StructLayout({
    "header": 1,        # before the ICRC's coverage (Ethernet header)
    "start": 1,         # the first byte covered (IPv4 header)
    "variant": 1,       # a variant field, folded in as 0xFF
    "total_high": 1,    # IPv4 total length, high and low byte
    "total_low": 1,
    "signature": len(UDP_SIGNATURE),    # one of UDP_SIGNATURE's offsets, in its order
    "after_signature": 1,               # past every signature byte
})


def _flags_after(m, position, name):
    """OFFSET_FLAGS of offset `position` + 1, from compares on `position`."""
    flags = Signal(OFFSET_FLAGS, name=name)
    following = [position == offset - 1 for offset in H.ICRC_MASKED_BYTES]
    m.d.comb += [
        flags.header.eq(position < H.ICRC_START - 1),
        flags.start.eq(position == H.ICRC_START - 1),
        flags.variant.eq(Cat(*following).any()),
        flags.total_high.eq(position == H.IPV4_OFFSET + 1),
        flags.total_low.eq(position == H.IPV4_OFFSET + 2),
        flags.signature.eq(Cat(*(position == offset - 1 for offset in UDP_SIGNATURE))),
        flags.after_signature.eq(position >= max(UDP_SIGNATURE)),
    ]
    return flags


def _icrc_fold(crc, at, byte):
    """The ICRC register after `byte`, at a frame offset whose OFFSET_FLAGS are `at`: the
    first covered byte starts from the prefix's state, a variant field folds in as 0xFF."""
    return crc32_byte(Mux(at.start, PREFIX_STATE, crc), Mux(at.variant, 0xFF, byte))


# The flags of offset 0, where each frame starts.
FIRST_BYTE = OFFSET_FLAGS.const({"header": 1})


class IcrcCheck(wiring.Component):
    """Checks the RoCEv2 ICRC of received frames, a byte at a time (see `hw.icrc` for the
    CRC): passes the bytes on through one register stage (latency 1 cycle, one byte per
    cycle, waiting when the output waits) with ``icrc_ok`` on each frame's last byte, true
    when the CRC over IPv4 header to ICRC, with the variant fields masked, leaves the
    residue. The region ends where the IPv4 total length says, so Ethernet
    padding after the ICRC is not folded. Any frame gets a verdict; for one that is not
    RoCEv2 it means nothing, and the switch's parser does not read it."""

    i: In(stream.Signature(CHECKED_BYTE))
    o: Out(stream.Signature(ICRC_CHECKED_BYTE))

    def elaborate(self, platform):
        m = Module()
        position = Signal(range(2048))      # of the byte in `i`; frames of the rx buffer
        at = Signal(OFFSET_FLAGS, init=FIRST_BYTE)
        covered = Signal()                  # the byte in `i` is folded in
        region_last = Signal(17, init=0x1FFFE)  # 14 + IPv4 total length - 1, once known
        total_high = Signal(8)
        crc = Signal(32)
        byte = self.i.payload.data
        take = self.i.valid & self.i.ready
        m.d.comb += [self.i.ready.eq(~self.o.valid | self.o.ready),
                     self.o.payload.icrc_ok.eq(crc == RESIDUE)]
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        after = _flags_after(m, position, "after")
        with m.If(take):
            m.d.sync += [self.o.valid.eq(1), self.o.payload.data.eq(byte),
                         self.o.payload.last.eq(self.i.payload.last),
                         self.o.payload.ok.eq(self.i.payload.ok)]
            with m.If(covered):
                m.d.sync += crc.eq(_icrc_fold(crc, at, byte))
            with m.If(at.header):
                m.d.sync += crc.eq(0)       # a runt never shows a stale residue
            with m.If(at.total_high):
                m.d.sync += total_high.eq(byte)
            with m.If(at.total_low):
                m.d.sync += region_last.eq(H.IPV4_OFFSET - 1 + Cat(byte, total_high))
            with m.If(self.i.payload.last):
                m.d.sync += [position.eq(0), at.eq(FIRST_BYTE), covered.eq(0),
                             region_last.eq(region_last.init)]
            with m.Else():
                # The byte after this one is covered if it is in [ICRC_START, region_last].
                # (The region's end is known from offset 18, before any valid end.)
                m.d.sync += [at.eq(after),
                             covered.eq(~after.header & (position < region_last))]
                with m.If(position != 2047):
                    m.d.sync += position.eq(position + 1)
        return m


class IcrcFill(wiring.Component):
    """Writes the RoCEv2 ICRC into each UDP frame it passes (IPv4 without options, UDP:
    `UDP_SIGNATURE`; the switch sends no UDP frame that is not RoCEv2, and its results and
    control replies go to the workers' own ports, not to 4791), a byte at a time; other
    frames pass unchanged. The ICRC's 4 bytes are where the IPv4 total length ends the
    packet (Ethernet padding after them passes unchanged); the CRC covers the frame from the
    IPv4 header to just before them. The signature and the length are known before the ICRC
    (offset 54 at the earliest; a frame whose length would put it among the signature bytes
    is not filled), so each byte leaves as it comes: one register stage, latency 1 cycle,
    one byte per cycle."""

    i: In(stream.Signature(BYTE))
    o: Out(stream.Signature(BYTE))

    def elaborate(self, platform):
        m = Module()
        position = Signal(range(2048))      # of the byte in `i`
        at = Signal(OFFSET_FLAGS, init=FIRST_BYTE)
        total_high = Signal(8)
        fill_from = Signal(17, init=0x1FFFF)    # the ICRC's first and last offsets - 1,
        fill_to = Signal(17, init=0x1FFFF)      # once known
        filling = Signal()                  # the byte in `i` is one of the ICRC's
        roce = Signal(init=1)               # every signature byte so far matched
        crc = Signal(32, reset_less=True)   # starts again at each frame's ICRC_START
        byte = self.i.payload.data
        take = self.i.valid & self.i.ready
        m.d.comb += self.i.ready.eq(~self.o.valid | self.o.ready)
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        after = _flags_after(m, position, "after")
        with m.If(take):
            m.d.sync += [
                self.o.valid.eq(1), self.o.payload.last.eq(self.i.payload.last),
                self.o.payload.data.eq(Mux(filling & roce & at.after_signature, ~crc[:8], byte)),
            ]
            for k, value in enumerate(UDP_SIGNATURE.values()):
                with m.If(at.signature[k]):
                    m.d.sync += roce.eq(roce & (byte == value))
            with m.If(filling):         # the ICRC's bytes go out, least significant first
                m.d.sync += crc.eq(crc >> 8)
            with m.Elif(~at.header):
                m.d.sync += crc.eq(_icrc_fold(crc, at, byte))
            with m.If(at.total_high):
                m.d.sync += total_high.eq(byte)
            with m.If(at.total_low):
                total = Cat(byte, total_high)
                m.d.sync += [fill_from.eq(H.IPV4_OFFSET - 5 + total),
                             fill_to.eq(H.IPV4_OFFSET - 2 + total)]
            with m.If(self.i.payload.last):
                m.d.sync += [position.eq(0), at.eq(FIRST_BYTE), filling.eq(0), roce.eq(1),
                             fill_from.eq(fill_from.init), fill_to.eq(fill_to.init)]
            with m.Else():
                m.d.sync += [at.eq(after),
                             filling.eq((position >= fill_from) & (position <= fill_to))]
                with m.If(position != 2047):
                    m.d.sync += position.eq(position + 1)
        return m


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


class GmiiTx(wiring.Component):
    """GMII transmit: preamble (7 bytes) and SFD, the frame's bytes, zero padding to 60
    bytes, the FCS (least significant byte first), then at least 12 idle bytes. The input
    must give a frame's bytes on consecutive cycles once its first byte is taken (the tx
    FrameBuffer does); a missing byte is sent with tx_er."""

    i: In(stream.Signature(BYTE))
    tx_data: Out(8)
    tx_en: Out(1)
    tx_er: Out(1)

    def elaborate(self, platform):
        m = Module()
        count = Signal(range(MIN_FRAME + 1))
        crc = Signal(32, init=0xFFFFFFFF)
        byte = Signal(8)
        m.d.sync += [self.tx_en.eq(0), self.tx_er.eq(0)]
        with m.FSM():
            with m.State("IDLE"):
                with m.If(self.i.valid):
                    m.d.sync += [self.tx_en.eq(1), self.tx_data.eq(PREAMBLE), count.eq(1)]
                    m.next = "PREAMBLE"
            with m.State("PREAMBLE"):
                m.d.sync += [self.tx_en.eq(1), count.eq(count + 1),
                             self.tx_data.eq(Mux(count == 7, SFD, PREAMBLE))]
                with m.If(count == 7):
                    m.d.sync += [count.eq(0), crc.eq(0xFFFFFFFF)]
                    m.next = "DATA"
            with m.State("DATA"):
                m.d.comb += [self.i.ready.eq(1), byte.eq(self.i.payload.data)]
                m.d.sync += [self.tx_en.eq(1), self.tx_er.eq(~self.i.valid),
                             self.tx_data.eq(byte), crc.eq(crc32_byte(crc, byte))]
                with m.If(count != MIN_FRAME):
                    m.d.sync += count.eq(count + 1)
                with m.If(self.i.valid & self.i.payload.last):
                    with m.If(count >= MIN_FRAME - 1):
                        m.d.sync += count.eq(0)
                        m.next = "FCS"
                    with m.Else():
                        m.next = "PAD"
            with m.State("PAD"):
                m.d.sync += [self.tx_en.eq(1), self.tx_data.eq(0), count.eq(count + 1),
                             crc.eq(crc32_byte(crc, Const(0, 8)))]
                with m.If(count == MIN_FRAME - 1):
                    m.d.sync += count.eq(0)
                    m.next = "FCS"
            with m.State("FCS"):
                m.d.sync += [self.tx_en.eq(1), self.tx_data.eq(~crc[:8]), crc.eq(crc >> 8),
                             count.eq(count + 1)]
                with m.If(count == 3):
                    m.d.sync += count.eq(0)
                    m.next = "GAP"
            with m.State("GAP"):
                m.d.sync += count.eq(count + 1)
                with m.If(count == IFG - 1):
                    m.next = "IDLE"
        return m


class Mac(wiring.Component):
    """The MAC of one port (see the module's docstring). Domains: `rx_domain` (the PHY's
    receive clock), `tx_domain` (the transmit clock), and ``sync`` for `rx` and `tx`, the
    switch's port streams of `width` bits. Both crossings are `hw.cdc.AsyncFifo`s of 16
    beats, whose ready, valid and data come from flip-flops on both sides.

    With `icrc`, the MAC also does the RoCEv2 ICRC a byte at a time, so that the switch needs
    no ICRC engine per port (``Switch(icrc="mac")``): `IcrcCheck` gives each received frame
    an ``icrc_ok`` (on `rx`'s checked beats), and `IcrcFill` writes the ICRC of each RoCEv2
    frame sent."""

    def __init__(self, width: int = 64, *, rx_domain: str = "eth_rx", tx_domain: str = "eth_tx",
                 buffer_bytes: int = 2048, icrc: bool = False):
        self.width = check_width(width)
        self.rx_domain, self.tx_domain = rx_domain, tx_domain
        self.buffer_bytes = buffer_bytes
        self.icrc = icrc
        super().__init__({
            "gmii_rx_data": In(8), "gmii_rx_dv": In(1), "gmii_rx_er": In(1),
            "gmii_tx_data": Out(8), "gmii_tx_en": Out(1), "gmii_tx_er": Out(1),
            "rx": Out(FrameStream(width, checked=icrc)),
            "tx": In(FrameStream(width)),
            "rx_frames": Out(COUNTER_WIDTH),
            "rx_crc_errors": Out(COUNTER_WIDTH),
            "rx_overflows": Out(COUNTER_WIDTH),
        })

    def elaborate(self, platform):
        from amaranth.hdl import DomainRenamer

        m = Module()
        rx = DomainRenamer(self.rx_domain)
        tx = DomainRenamer(self.tx_domain)
        beats = self.buffer_bytes // (self.width // 8)
        # The crossings have no reset, so their core side runs on a reset-less copy of the
        # core clock: they start empty at configuration, and the switch sends nothing while
        # the core is in reset.
        m.domains.mac_core = core = ClockDomain("mac_core", local=True, reset_less=True)
        m.d.comb += core.clk.eq(ClockSignal("sync"))

        # Receive, 125 MHz: bytes, checked, gathered into beats, across.
        m.submodules.gmii_rx = gmii_rx = rx(GmiiRx())
        m.submodules.rx_widen = rx_widen = rx(Widen8(self.width, self.icrc))
        received = received_beat(self.width, self.icrc)
        m.submodules.rx_cdc = rx_cdc = AsyncFifo(
            received.size, 16, r_domain="mac_core", w_domain=self.rx_domain)
        m.d.comb += [
            gmii_rx.rx_data.eq(self.gmii_rx_data), gmii_rx.rx_dv.eq(self.gmii_rx_dv),
            gmii_rx.rx_er.eq(self.gmii_rx_er),
        ]
        first = rx_widen.i
        if self.icrc:
            # A register slice between the ICRC check and the gathering into beats: the
            # check's byte enables then wait on a flip-flop, not on the beat's ready, which
            # routed across the die missed 125 MHz.
            m.submodules.rx_icrc = rx_icrc = rx(IcrcCheck())
            m.submodules.rx_skid_icrc = skid_icrc = rx(Skid(ICRC_CHECKED_BYTE))
            wiring.connect(m, rx_icrc.o, skid_icrc.i)
            wiring.connect(m, skid_icrc.o, rx_widen.i)
            first = rx_icrc.i
        # GmiiRx cannot wait, and nothing after it does in practice: the crossing is read in
        # every core cycle, faster than beats come (one per 8 rx cycles at most, two at a
        # frame's end). Should a byte find no room all the same, the frame it belongs to is
        # marked bad, so that the receive buffer drops it and counts it.
        lost = Signal()
        m.d.comb += [
            first.valid.eq(gmii_rx.o.valid), first.payload.data.eq(gmii_rx.o.payload.data),
            first.payload.last.eq(gmii_rx.o.payload.last),
            first.payload.ok.eq(gmii_rx.o.payload.ok & ~lost),
        ]
        with m.If(gmii_rx.o.valid):
            with m.If(~first.ready):
                m.d[self.rx_domain] += lost.eq(1)
            with m.Elif(gmii_rx.o.payload.last):
                m.d[self.rx_domain] += lost.eq(0)
        m.d.comb += [rx_cdc.w_data.eq(rx_widen.o.payload), rx_cdc.w_en.eq(rx_widen.o.valid),
                     rx_widen.o.ready.eq(rx_cdc.w_rdy)]

        # Receive, core clock: whole frames in the buffer, then out as the switch's beats.
        crossed = received(rx_cdc.r_data)
        stored = data.StructLayout({name: field.shape for name, field in received
                                    if name != "ok"})
        m.submodules.rx_buffer = rx_buffer = FrameBuffer(stored, beats)
        m.d.comb += [getattr(rx_buffer.i.payload, name).eq(getattr(crossed, name))
                     for name, _ in stored]
        m.d.comb += [
            rx_cdc.r_en.eq(1), rx_buffer.i.valid.eq(rx_cdc.r_rdy), rx_buffer.ok.eq(crossed.ok),
            self.rx_frames.eq(rx_buffer.frames), self.rx_crc_errors.eq(rx_buffer.crc_errors),
            self.rx_overflows.eq(rx_buffer.overflows),
        ]
        out = rx_buffer.o.payload
        m.d.comb += [
            self.rx.payload.data.eq(out.data), self.rx.payload.last.eq(out.last),
            self.rx.payload.keep.eq((Const(2, self.width // 8 + 1) << out.count) - 1),
            self.rx.valid.eq(rx_buffer.o.valid), rx_buffer.o.ready.eq(self.rx.ready),
        ]
        if self.icrc:
            m.d.comb += self.rx.payload.icrc_ok.eq(out.icrc_ok)

        # Transmit, core clock: whole frames are gathered as packed beats, so that once a
        # frame starts on the wire its beats come faster than it is sent (8 bytes a core
        # cycle against 8 bytes per 8 tx cycles).
        packed = packed_beat(self.width)
        tx_beat = Signal(packed)
        m.d.comb += [
            tx_beat.data.eq(self.tx.payload.data), tx_beat.last.eq(self.tx.payload.last),
            tx_beat.count.eq(sum(self.tx.payload.keep[1:])),
        ]
        m.submodules.tx_buffer = tx_buffer = FrameBuffer(packed, beats, backpressure=True)
        m.submodules.tx_cdc = tx_cdc = AsyncFifo(
            packed.size, 16, r_domain=self.tx_domain, w_domain="mac_core")
        m.d.comb += [
            tx_buffer.i.payload.eq(tx_beat), tx_buffer.i.valid.eq(self.tx.valid),
            self.tx.ready.eq(tx_buffer.i.ready),
            tx_cdc.w_data.eq(tx_buffer.o.payload), tx_cdc.w_en.eq(tx_buffer.o.valid),
            tx_buffer.o.ready.eq(tx_cdc.w_rdy),
        ]

        # Transmit, 125 MHz: across, bytes, the ICRC, the wire.
        m.submodules.tx_narrow = tx_narrow = tx(Narrow8(self.width))
        m.submodules.gmii_tx = gmii_tx = tx(GmiiTx())
        m.submodules.tx_skid_byte = skid_byte = tx(Skid(BYTE))
        m.d.comb += [
            tx_narrow.i.payload.eq(tx_cdc.r_data), tx_narrow.i.valid.eq(tx_cdc.r_rdy),
            tx_cdc.r_en.eq(tx_narrow.i.ready),
        ]
        wiring.connect(m, tx_narrow.o, skid_byte.i)
        if self.icrc:
            m.submodules.tx_icrc = tx_icrc = tx(IcrcFill())
            m.submodules.tx_skid_icrc = skid_icrc = tx(Skid(BYTE))
            wiring.connect(m, skid_byte.o, tx_icrc.i)
            wiring.connect(m, tx_icrc.o, skid_icrc.i)
            wiring.connect(m, skid_icrc.o, gmii_tx.i)
        else:
            wiring.connect(m, skid_byte.o, gmii_tx.i)
        m.d.comb += [
            self.gmii_tx_data.eq(gmii_tx.tx_data), self.gmii_tx_en.eq(gmii_tx.tx_en),
            self.gmii_tx_er.eq(gmii_tx.tx_er),
        ]
        return m
