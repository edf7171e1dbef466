"""Deparser: a header stream and a payload stream in; a frame out.

Takes one header entry, then its `payload_length` bytes from the payload stream (none when
the length is zero), and sends the frame: Ethernet, IPv4, UDP, BTH and the extension headers
of the opcode's class (`hw.headers.OpClass`), the payload, PadCnt zero bytes to a multiple
of four, and the ICRC. It computes the IPv4 total length and header checksum, the UDP length,
the BTH PadCnt and the ICRC (with ``icrc="mac"``, four zero bytes that the MAC fills in,
`hw.mac_icrc.IcrcFill`); every other field is sent as the header entry gives it.
The payload stream must carry exactly `payload_length` bytes for each entry.

Throughput: one beat out per cycle with no gap between frames, whenever the inputs keep up
(the next entry is taken with the previous frame's last beat). Latency: the first beat
leaves the cycle after its header entry is taken. Drops nothing.
"""

from amaranth import Cat, Module, Mux, Signal, signed, unsigned
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from netagg.contract import headers as C

from . import headers as H
from .beat import FrameStream, beat_index, check_icrc, check_width
from .icrc import IcrcEngine


class Deparser(wiring.Component):
    def __init__(self, width: int, icrc: str = "engine"):
        self.width = check_width(width)
        self.icrc = check_icrc(icrc)
        super().__init__({
            "header": In(stream.Signature(H.PACKET_HEADER)),
            "payload": In(FrameStream(width)),
            "o": Out(FrameStream(width)),
        })

    def elaborate(self, platform):
        m = Module()
        nb = self.width // 8
        active = Signal()
        entry = Signal(H.PACKET_HEADER, reset_less=True)
        fire = self.o.valid & self.o.ready
        last = Signal()
        index = beat_index(m, fire, last)       # output beat within the frame

        # Lengths of the frame being sent. `shift`: the lane where the payload starts, and
        # the bytes of the previous payload beat in each out beat.
        ext_length, header_beats, shift = H.payload_start(m, entry.opclass, nb)
        no_payload = (entry.opclass == C.OpClass.READ_REQ) | (entry.opclass == C.OpClass.ACK)
        payload_length = Mux(no_payload, 0, entry.payload_length)
        pad = Signal(2)
        header_end = Signal(unsigned(17))
        payload_end = Signal(unsigned(17))
        icrc_start = Signal(unsigned(17))
        frame_end = Signal(unsigned(17))
        m.d.comb += [
            pad.eq(-payload_length),
            header_end.eq(C.EXT_OFFSET + ext_length),
            payload_end.eq(header_end + payload_length),
            icrc_start.eq(payload_end + pad),
            frame_end.eq(icrc_start + C.ICRC_LENGTH),
        ]

        # The headers, with the fields the deparser owns filled in.
        ip = Signal(H.IPV4)
        udp = Signal(H.UDP)
        bth = Signal(H.BTH)
        m.d.comb += [
            ip.eq(entry.ip), ip.checksum.eq(0),
            ip.total_length.eq(frame_end - C.IPV4_OFFSET),
            udp.eq(entry.udp), udp.length.eq(frame_end - C.UDP_OFFSET),
            bth.eq(entry.bth), bth.padcnt.eq(pad),
        ]
        ip_wire = H.to_wire(ip)
        checksum = ~H.ipv4_checksum_sum([ip_wire[8 * i : 8 * i + 8] for i in range(H.IPV4.length)])
        ip_sent = Signal(H.IPV4)
        m.d.comb += [ip_sent.eq(ip), ip_sent.checksum.eq(checksum)]
        ext = Signal(unsigned(8 * C.MAX_EXT_LENGTH))
        with m.Switch(entry.opclass):
            with m.Case(C.OpClass.RETH, C.OpClass.READ_REQ):
                m.d.comb += ext.eq(H.to_wire(entry.reth))
            with m.Case(C.OpClass.RETH_IMM):
                m.d.comb += ext.eq(Cat(H.to_wire(entry.reth), H.to_wire(entry.immdt)))
            with m.Case(C.OpClass.IMM):
                m.d.comb += ext.eq(H.to_wire(entry.immdt))
            with m.Case(C.OpClass.AETH, C.OpClass.ACK):
                m.d.comb += ext.eq(H.to_wire(entry.aeth))
        wire = Signal(unsigned(8 * C.MAX_HEADER_LENGTH))
        m.d.comb += wire.eq(
            Cat(H.to_wire(entry.eth), H.to_wire(ip_sent), H.to_wire(udp), H.to_wire(bth), ext))

        # Payload beats: out beat k carries payload beat k - header_beats from lane `shift`
        # on, and the top `shift` bytes of the beat before it below.
        payload_beats = (payload_length + nb - 1) // nb
        wanted = index - header_beats
        needs_payload = Signal()
        m.d.comb += needs_payload.eq((index >= header_beats) & (wanted < payload_beats))
        previous = Signal(unsigned(self.width), reset_less=True)
        both = Cat(previous, self.payload.payload.data)
        realigned = Signal(unsigned(self.width))
        with m.Switch(shift):
            for s in range(nb):
                with m.Case(s):
                    m.d.comb += realigned.eq(both[8 * (nb - s) : 8 * (nb - s) + self.width])

        # The beat without its ICRC (what the ICRC covers), then with it.
        base = Signal(unsigned(17))
        m.d.comb += base.eq(index * nb)
        plain = Signal(unsigned(self.width))
        keep = Signal(nb)
        header_lanes = Signal(unsigned(self.width))
        with m.Switch(index):
            for k in range(-(-C.MAX_HEADER_LENGTH // nb)):
                with m.Case(k):
                    chunk = wire[k * self.width : (k + 1) * self.width]
                    m.d.comb += header_lanes.eq(chunk)

        def lanes_below(end, name):
            """The lanes of this beat at frame offsets below `end`, as a mask: one
            subtraction per beat rather than a comparison per lane."""
            ahead = Signal(signed(18), name=f"{name}_ahead")
            count = Signal(range(nb + 1), name=f"{name}_lanes")
            mask = Signal(nb, name=f"{name}_mask")
            m.d.comb += [
                ahead.eq(end - base),
                count.eq(Mux(ahead[-1], 0, Mux(ahead[exact_log2(nb):-1].any(), nb, ahead))),
            ]
            with m.Switch(count):
                for k in range(nb + 1):
                    with m.Case(k):
                        m.d.comb += mask.eq((1 << k) - 1)
            return mask

        in_header = lanes_below(header_end, "header")
        in_payload = lanes_below(payload_end, "payload")
        m.d.comb += keep.eq(lanes_below(frame_end, "frame"))
        for lane in range(nb):
            byte = slice(8 * lane, 8 * lane + 8)
            with m.If(in_header[lane]):
                m.d.comb += plain[byte].eq(header_lanes[byte])
            with m.Elif(in_payload[lane]):
                m.d.comb += plain[byte].eq(realigned[byte])

        sent = Signal(unsigned(self.width))
        m.d.comb += sent.eq(plain)
        if self.icrc == "engine":
            m.submodules.icrc = icrc = IcrcEngine(self.width)
            icrc_saved = Signal(32)
            icrc_value = Signal(32)
            m.d.comb += [
                icrc.valid.eq(fire), icrc.data.eq(plain), icrc.last.eq(last),
                icrc.end.eq(icrc_start),
                icrc_value.eq(Mux(icrc.in_region_end, ~icrc.final, icrc_saved)),
            ]
            for lane in range(nb):
                offset = base + lane - icrc_start
                for n in range(C.ICRC_LENGTH):
                    with m.If(offset == n):
                        m.d.comb += sent[8 * lane : 8 * lane + 8].eq(
                            icrc_value[8 * n : 8 * n + 8])
            with m.If(fire & icrc.in_region_end):
                m.d.sync += icrc_saved.eq(~icrc.final)

        m.d.comb += [
            last.eq(frame_end <= base + nb),
            self.o.valid.eq(active & (~needs_payload | self.payload.valid)),
            self.o.payload.data.eq(sent),
            self.o.payload.keep.eq(keep),
            self.o.payload.last.eq(last),
            self.payload.ready.eq(active & needs_payload & self.o.ready),
        ]
        with m.If(self.payload.valid & self.payload.ready):
            m.d.sync += previous.eq(self.payload.payload.data)
        with m.If(fire & last):
            m.d.sync += active.eq(0)
        m.d.comb += self.header.ready.eq(~active | (fire & last))
        with m.If(self.header.valid & self.header.ready):
            m.d.sync += [active.eq(1), entry.eq(self.header.payload)]
        return m
