"""Parser: a frame stream in; a header stream and a payload stream out.

Every frame gives exactly one header entry, which carries every header of a RoCEv2 packet
(Ethernet, IPv4, UDP, BTH, and RETH, ImmDt or AETH as the opcode's class says; absent ones
read as zero), the class, the payload length (without pad and ICRC) and the verdict
(`hw.headers.Verdict`). The payload, realigned to start at byte 0 of a beat and cut before the
pad, goes out on the payload stream, before the header entry of its frame, with `last` on its
final beat; a frame with no payload sends none. A frame whose verdict is not OK may have sent
any payload beats: the packet queue after the parser discards them.

Checks, in this order, each giving its verdict: frame long enough for each header; Ethernet
type IPv4, IPv4 version 4 and IHL 5 (no options), not fragmented, protocol UDP, UDP
destination port 4791, BTH TVer 0 (else NOT_ROCE); IPv4 header checksum; opcode supported;
IPv4 total length against the frame (which may carry Ethernet padding up to 60 bytes); UDP
length against IPv4; PadCnt and the lengths the opcode class allows; the ICRC.

Throughput: one beat per cycle. A payload beat goes out in the cycle of the frame beat that
completes it; when a frame's last beat completes two payload beats, the second goes out in
the next cycle, in parallel with the next frame's first beat, which never completes a payload
beat unless that frame is a single beat (then the input waits one cycle). The verdict and
the header entry are made from registered header bytes in the cycle after the frame's last
beat, and the entry goes out in the cycle after that, or after the payload's final beat; a
frame's last beat waits while the previous frame is being judged.
"""

from amaranth import Cat, Const, Module, Mux, Signal, unsigned
from amaranth.lib import stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from netagg.contract import headers as C

from . import headers as H
from .beat import BeatLayout, FrameStream, beat_index, check_icrc, check_width
from .icrc import IcrcEngine

MIN_ETHERNET_FRAME = 60  # without FCS: shorter frames arrive padded to this length


class Parser(wiring.Component):
    """`icrc`: "engine" checks the ICRC here; "mac" takes the MAC's verdict, the ``icrc_ok``
    field of a checked beat stream (`hw.beat`), on each frame's last beat."""

    def __init__(self, width: int, icrc: str = "engine"):
        self.width = check_width(width)
        self.icrc = check_icrc(icrc)
        super().__init__({
            "i": In(FrameStream(width, checked=icrc == "mac")),
            "header": Out(stream.Signature(H.PACKET_HEADER)),
            "payload": Out(FrameStream(width)),
        })

    def elaborate(self, platform):
        m = Module()
        nb = self.width // 8
        beat = self.i.payload
        fire = self.i.valid & self.i.ready
        index = beat_index(m, fire, beat.last)

        # The first MAX_HEADER_LENGTH bytes, registered as they pass. The verdict and the
        # header entry are made from these in the cycle after the frame's last beat
        # (`judging`), when all of them are in. The payload's placement needs a few of them
        # earlier (`live`: from the beat that brings them, else from the registers).
        cap_beats = -(-C.MAX_HEADER_LENGTH // nb)
        captured = Signal(unsigned(cap_beats * nb * 8), reset_less=True)
        for k in range(cap_beats):
            with m.If(fire & (index == k)):
                m.d.sync += captured[k * self.width : (k + 1) * self.width].eq(beat.data)
        held = [captured[8 * p : 8 * p + 8] for p in range(C.MAX_HEADER_LENGTH)]

        def live(p):
            return Mux(index == p // nb, beat.data.word_select(p % nb, 8), held[p])

        def view(layout, offset, byte=held.__getitem__):
            return H.from_wire(layout, [byte(p) for p in range(offset, offset + layout.size // 8)])

        def opcode_class(opcode, name):
            """(supported, class) of an opcode, from a ROM."""
            rom = Memory(shape=4, depth=256, init=[int(c.value) for c in H.opclass_rom()])
            m.submodules[f"{name}_rom"] = rom
            read = rom.read_port(domain="comb")
            m.d.comb += read.addr.eq(opcode)
            return read.data[3], read.data[:3]

        def lengths(udp, bth, opclass, name):
            """(padded: payload + pad, from the UDP length; payload length; extension
            headers' length, beat and lane where the payload starts)."""
            ext_length, start_first, shift = H.payload_start(m, opclass, nb)
            padded = Signal(unsigned(17), name=f"{name}_padded")
            payload_length = Signal(unsigned(16), name=f"{name}_payload_length")
            m.d.comb += [
                padded.eq(udp.length - fixed - ext_length),
                payload_length.eq(padded - bth.padcnt),
            ]
            return padded, payload_length, ext_length, start_first, shift

        fixed = H.UDP.length + H.BTH.length + C.ICRC_LENGTH

        # For the payload, as the frame's beats pass.
        udp_live, bth_live = view(H.UDP, C.UDP_OFFSET, live), view(H.BTH, C.BTH_OFFSET, live)
        _, opclass_live = opcode_class(bth_live.opcode, "live")
        _, payload_length, _, start_first, shift = lengths(
            udp_live, bth_live, opclass_live, "live")

        if self.icrc == "mac":
            icrc_good = beat.icrc_ok
        else:
            m.submodules.icrc = icrc = IcrcEngine(self.width)
            ip_live = view(H.IPV4, C.IPV4_OFFSET, live)
            region_end = Signal(unsigned(17))
            m.d.comb += region_end.eq(C.IPV4_OFFSET + ip_live.total_length)
            total_length_known = index >= (C.IPV4_OFFSET + 3) // nb
            m.d.comb += [
                icrc.valid.eq(fire),
                icrc.data.eq(beat.data),
                icrc.last.eq(beat.last),
                icrc.end.eq(Mux(total_length_known & (region_end <= 0xFFFF), region_end,
                                0xFFFF)),
            ]
            icrc_seen_ok = Signal()
            with m.If(fire & icrc.in_region_end):
                m.d.sync += icrc_seen_ok.eq(icrc.ok)
            icrc_good = Mux(icrc.in_region_end, icrc.ok, icrc_seen_ok)

        # The IPv4 header's one's complement sum, gathered as its words pass (one 16-bit word
        # per lane pair, those of the header's bytes in this beat), rather than summed from the
        # registered bytes in the judging cycle: a few narrow adders instead of one ten-word
        # adder tree. In the judging cycle it holds the whole header's sum.
        ip_sum = Signal(unsigned(20))           # ten words: at most 10 x 0xFFFF < 2 ** 20
        ip_words = []
        for lane in range(nb // 2):
            beats = [k for k in range(-(-C.UDP_OFFSET // nb))
                     if C.IPV4_OFFSET <= k * nb + 2 * lane < C.UDP_OFFSET]
            if beats:
                word = Cat(beat.data.word_select(2 * lane + 1, 8),
                           beat.data.word_select(2 * lane, 8))
                ip_words.append(Mux(Cat(*(index == k for k in beats)).any(), word, 0))
        with m.If(fire):
            m.d.sync += ip_sum.eq(Mux(index == 0, 0, ip_sum) + sum(ip_words))

        # What the last beat tells, kept for the judging cycle.
        judging = Signal()
        frame_length = Signal(unsigned(17))
        too_long = Signal()
        icrc_ok = Signal()
        m.d.sync += judging.eq(fire & beat.last)
        with m.If(fire & beat.last):
            m.d.sync += [frame_length.eq(index * nb + sum(beat.keep)),
                         too_long.eq(index == 0xFFFF), icrc_ok.eq(icrc_good)]

        eth = view(H.ETHERNET, C.ETH_OFFSET)
        ip = view(H.IPV4, C.IPV4_OFFSET)
        udp = view(H.UDP, C.UDP_OFFSET)
        bth = view(H.BTH, C.BTH_OFFSET)
        supported, opclass = opcode_class(bth.opcode, "opclass")
        padded, judged_length, ext_length, _, _ = lengths(udp, bth, opclass, "judged")

        verdict = Signal(C.Verdict)
        checksum_ok = H.ones_complement_fold(ip_sum) == 0xFFFF
        fragmented = ip.flags[0] | (ip.fragment_offset != 0)   # MF bit, or an offset
        ip_end = Signal(unsigned(17))
        m.d.comb += ip_end.eq(C.IPV4_OFFSET + ip.total_length)
        length_ok = (frame_length == ip_end) | (
            (frame_length == MIN_ETHERNET_FRAME) & (ip_end < MIN_ETHERNET_FRAME))
        no_payload = (opclass == C.OpClass.READ_REQ) | (opclass == C.OpClass.ACK)
        V = C.Verdict
        with m.If(frame_length < C.IPV4_OFFSET):
            m.d.comb += verdict.eq(V.TRUNCATED)
        with m.Elif(eth.ethertype != C.ETHERTYPE_IPV4):
            m.d.comb += verdict.eq(V.NOT_ROCE)
        with m.Elif(frame_length < C.UDP_OFFSET):
            m.d.comb += verdict.eq(V.TRUNCATED)
        with m.Elif((ip.version != 4) | (ip.ihl != 5) | fragmented |
                    (ip.protocol != C.IP_PROTO_UDP)):
            m.d.comb += verdict.eq(V.NOT_ROCE)
        with m.Elif(~checksum_ok):
            m.d.comb += verdict.eq(V.BAD_IP_CHECKSUM)
        with m.Elif(frame_length < C.BTH_OFFSET):
            m.d.comb += verdict.eq(V.TRUNCATED)
        with m.Elif(udp.dst_port != C.ROCEV2_PORT):
            m.d.comb += verdict.eq(V.NOT_ROCE)
        with m.Elif(frame_length < C.EXT_OFFSET):
            m.d.comb += verdict.eq(V.TRUNCATED)
        with m.Elif(bth.tver != 0):
            m.d.comb += verdict.eq(V.NOT_ROCE)
        with m.Elif(~supported):
            m.d.comb += verdict.eq(V.BAD_OPCODE)
        with m.Elif((frame_length < ip_end) | too_long):
            m.d.comb += verdict.eq(V.TRUNCATED)
        with m.Elif(~length_ok | (udp.length != ip.total_length - H.IPV4.length) |
                    (udp.length < fixed + ext_length) | (padded[:2] != 0) |
                    (padded < bth.padcnt) | (no_payload & (padded != 0))):
            m.d.comb += verdict.eq(V.BAD_LENGTH)
        with m.Elif(~icrc_ok):
            m.d.comb += verdict.eq(V.BAD_ICRC)
        with m.Else():
            m.d.comb += verdict.eq(V.OK)

        # The header entry, registered in the judging cycle.
        entry = Signal(H.PACKET_HEADER)
        m.d.comb += [
            entry.eth.eq(eth), entry.ip.eq(ip), entry.udp.eq(udp), entry.bth.eq(bth),
            entry.opclass.eq(opclass), entry.verdict.eq(verdict),
            entry.payload_length.eq(Mux(verdict == V.OK, judged_length, 0)),
        ]
        with m.Switch(opclass):
            with m.Case(C.OpClass.RETH, C.OpClass.READ_REQ):
                m.d.comb += entry.reth.eq(view(H.RETH, C.EXT_OFFSET))
            with m.Case(C.OpClass.RETH_IMM):
                m.d.comb += entry.reth.eq(view(H.RETH, C.EXT_OFFSET))
                m.d.comb += entry.immdt.eq(view(H.IMMDT, C.EXT_OFFSET + H.RETH.length))
            with m.Case(C.OpClass.IMM):
                m.d.comb += entry.immdt.eq(view(H.IMMDT, C.EXT_OFFSET))
            with m.Case(C.OpClass.AETH, C.OpClass.ACK):
                m.d.comb += entry.aeth.eq(view(H.AETH, C.EXT_OFFSET))

        # Payload realignment. Payload byte q is frame byte start + q; output beat j is
        # frame beats first+j (from lane `shift`) and first+j+1 (below `shift`), sent with
        # frame beat first+j+1, or with the last frame beat for the final one (first is
        # `start_first`, from `H.payload_start` above).
        previous = Signal(unsigned(self.width), reset_less=True)
        with m.If(fire):
            m.d.sync += previous.eq(beat.data)

        def realign(low, high):
            both = Cat(low, high)
            out = Signal(unsigned(self.width))
            with m.Switch(shift):
                for s in range(nb):
                    with m.Case(s):
                        m.d.comb += out.eq(both[8 * s : 8 * s + self.width])
            return out

        def keep_for(remaining):
            return Cat(*(remaining > lane for lane in range(nb)))

        beats_out = Signal(unsigned(17))     # payload beats the frame has
        m.d.comb += beats_out.eq((payload_length + nb - 1) // nb)
        j = Signal(unsigned(17))             # payload beat this frame beat completes
        m.d.comb += j.eq(index - start_first - 1)
        normal = (index > start_first) & (j < beats_out)
        remaining = Signal(unsigned(17))
        m.d.comb += remaining.eq(payload_length - j * nb)
        # On the last frame beat: is a payload beat left over, starting in this beat?
        j_tail = Signal(unsigned(17))
        m.d.comb += j_tail.eq(index - start_first)
        tail_due = beat.last & (index >= start_first) & (j_tail < beats_out)
        remaining_tail = Signal(unsigned(17))
        m.d.comb += remaining_tail.eq(payload_length - j_tail * nb)

        pending = Signal()                   # a tail payload beat waits in `pending_beat`
        pending_beat = Signal(BeatLayout(self.width), reset_less=True)
        header_pending = Signal()

        # What this frame beat sends now: the normal beat, or the tail when it is alone.
        send = Signal(BeatLayout(self.width))
        send_now = Signal()
        tail_data = realign(beat.data, Const(0, self.width))
        tail_beat = Signal(BeatLayout(self.width))
        m.d.comb += [
            tail_beat.data.eq(tail_data),
            tail_beat.keep.eq(keep_for(remaining_tail)),
            tail_beat.last.eq(1),
        ]
        with m.If(normal):
            m.d.comb += [
                send.data.eq(realign(previous, beat.data)),
                send.keep.eq(keep_for(remaining)),
                send.last.eq((remaining <= nb) | (beat.last & ~tail_due)),
                send_now.eq(1),
            ]
        with m.Elif(tail_due):
            m.d.comb += [send.eq(tail_beat), send_now.eq(1)]
        defer_tail = normal & tail_due

        # Handshakes. The header slot must be free (or freeing: its entry leaves in this
        # cycle) to take a last beat, and a payload beat can go only when no tail is waiting
        # and the sink takes it. An entry waiting behind a tail beat is not leaving yet,
        # whatever `header.ready` says.
        header_free = ~judging & (~header_pending | (self.header.valid & self.header.ready))
        beat_may_go = ~beat.last | header_free
        m.d.comb += self.i.ready.eq(
            beat_may_go & (~send_now | (~pending & self.payload.ready)))
        with m.If(pending):
            m.d.comb += [self.payload.valid.eq(1), self.payload.payload.eq(pending_beat)]
        with m.Else():
            m.d.comb += [self.payload.valid.eq(self.i.valid & send_now & beat_may_go),
                         self.payload.payload.eq(send)]
        with m.If(pending & self.payload.ready):
            m.d.sync += pending.eq(0)
        with m.If(fire & beat.last & defer_tail):
            m.d.sync += [pending.eq(1), pending_beat.eq(tail_beat)]

        judged = Signal(H.PACKET_HEADER, reset_less=True)
        m.d.comb += [self.header.valid.eq(header_pending & ~pending),
                     self.header.payload.eq(judged)]
        with m.If(self.header.valid & self.header.ready):
            m.d.sync += header_pending.eq(0)
        with m.If(judging):
            m.d.sync += [header_pending.eq(1), judged.eq(entry)]
        return m
