"""The RoCEv2 ICRC a byte at a time, on the boards' MACs (``Mac(icrc=True)``), in front of
the switch's ports: `IcrcCheck` gives each received frame its ICRC verdict, `IcrcFill` writes
the ICRC into each UDP frame the switch sends. A few hundred LUTs per port instead of the
switch's 64-bit ICRC engines (`hw.icrc`), and every path starts at a flip-flop: what a byte
offset means is kept in flags one byte ahead.
"""

from amaranth import Cat, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from netagg.contract import headers as C

from .icrc import PREFIX_STATE, RESIDUE
from .mac_bytes import BYTE, CHECKED_BYTE, ICRC_CHECKED_BYTE, crc32_byte

# Bytes an IPv4 (without options) UDP frame has at these offsets. Every UDP frame the switch
# sends is RoCEv2: its results and control replies, from its own UDP port to the worker's,
# so no port marks them (ARP replies, the board's only other frames, do not match).
UDP_SIGNATURE = {12: C.ETHERTYPE_IPV4 >> 8, 13: C.ETHERTYPE_IPV4 & 0xFF, 14: 0x45,
                 23: C.IP_PROTO_UDP}


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
    following = [position == offset - 1 for offset in C.ICRC_MASKED_BYTES]
    m.d.comb += [
        flags.header.eq(position < C.ICRC_START - 1),
        flags.start.eq(position == C.ICRC_START - 1),
        flags.variant.eq(Cat(*following).any()),
        flags.total_high.eq(position == C.IPV4_OFFSET + 1),
        flags.total_low.eq(position == C.IPV4_OFFSET + 2),
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
                m.d.sync += region_last.eq(C.IPV4_OFFSET - 1 + Cat(byte, total_high))
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
                m.d.sync += [fill_from.eq(C.IPV4_OFFSET - 5 + total),
                             fill_to.eq(C.IPV4_OFFSET - 2 + total)]
            with m.If(self.i.payload.last):
                m.d.sync += [position.eq(0), at.eq(FIRST_BYTE), filling.eq(0), roce.eq(1),
                             fill_from.eq(fill_from.init), fill_to.eq(fill_to.init)]
            with m.Else():
                m.d.sync += [at.eq(after),
                             filling.eq((position >= fill_from) & (position <= fill_to))]
                with m.If(position != 2047):
                    m.d.sync += position.eq(position + 1)
        return m
