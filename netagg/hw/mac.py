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

`RgmiiPhy` (netagg.hw.mac_rgmii) turns the GMII side into RGMII on an ECP5; simulation drives GMII.
This file holds the GMII stages and the MAC that ties the others: the buffers and byte
gearboxes are in `hw.mac_buffers`, the ICRC stages in `hw.mac_icrc`, the byte layouts and the
byte-serial CRC-32 in `hw.mac_bytes`.
"""

from amaranth import Cat, ClockDomain, ClockSignal, Const, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from .beat import FrameStream, check_width
from .cdc import AsyncFifo
from .mac_buffers import (
    COUNTER_WIDTH,
    FrameBuffer,
    Narrow8,
    Skid,
    Widen8,
    packed_beat,
    received_beat,
)
from .mac_bytes import BYTE, CHECKED_BYTE, ICRC_CHECKED_BYTE, crc32_byte
from .mac_icrc import IcrcCheck, IcrcFill

PREAMBLE = 0x55
SFD = 0xD5
MIN_FRAME = 60          # bytes before the FCS
IFG = 12                # idle bytes between frames
CRC_RESIDUE = 0xDEBB20E3  # register over a frame and its own FCS (before the final inversion)


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
