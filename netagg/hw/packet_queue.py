"""Packet queue: commits a frame only after the parser has judged it whole.

Takes the parser's payload stream (written as it arrives) and header stream (one entry per
frame, after its payload). A header whose verdict is OK commits the frame's payload and
queues the header; any other verdict rewinds the payload written since the last commit, so
a bad frame leaves nothing behind, and is counted in `drops`, indexed by verdict (and shown
on `dropped` in the cycle it is dropped). A frame
whose payload would not fit in an empty queue is dropped as OVERSIZE. A good header that
comes with `null` set is queued but its payload is rewound: the frame goes on as a header
alone (a contribution dropped by priority). `level` is the committed payload not yet read,
in bytes: what the queue holds ahead of a frame being judged. Frames out keep their
order. Latency: a committed payload beat leaves two cycles after its header arrives; one beat
per cycle in and out.

`capacity` is in bytes of payload; the header FIFO holds `headers` entries, of
`header_layout` (`hw.headers.PACKET_HEADER`, or any layout with its `verdict` and
`payload_length`).
"""

from amaranth import Module, Signal, unsigned
from amaranth.lib import fifo, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from netagg.contract import headers as C

from . import headers as H
from .beat import BeatLayout, FrameStream, check_wide_width

COUNTER_WIDTH = 32


class PacketQueue(wiring.Component):
    def __init__(self, width: int, capacity: int = 16384, headers: int = 32,
                 header_layout=H.PACKET_HEADER):
        self.width = check_wide_width(width)
        depth = capacity // (width // 8)
        if depth < 4 or depth & (depth - 1):
            raise ValueError(f"capacity {capacity} must be a power of two of at least 4 beats")
        if headers < 2:
            raise ValueError("the header FIFO needs at least two entries")
        self.depth = depth
        self.headers = headers
        super().__init__({
            "i_header": In(stream.Signature(header_layout)),
            "i_null": In(1),       # with i_header: queue the header, discard the payload
            "i_payload": In(FrameStream(width)),
            "o_header": Out(stream.Signature(header_layout)),
            "o_payload": Out(FrameStream(width)),
            "passed": Out(unsigned(COUNTER_WIDTH)),
            "committed": Out(1),   # high in the cycle a frame is committed
            "level": Out(range(capacity + 1)),
            "drops": Out(unsigned(COUNTER_WIDTH)).array(len(C.Verdict)),
            "dropped": Out(len(C.Verdict)),    # a frame dropped this cycle, by verdict
        })

    def elaborate(self, platform):
        m = Module()
        ptr = unsigned(self.depth.bit_length())   # one bit more than the address
        m.submodules.memory = memory = Memory(
            shape=BeatLayout(self.width), depth=self.depth, init=[])
        write = memory.write_port()
        read = memory.read_port()
        m.submodules.header_fifo = header_fifo = fifo.SyncFIFOBuffered(
            width=self.i_header.payload.shape().size, depth=self.headers)

        write_ptr = Signal(ptr)
        commit_ptr = Signal(ptr)
        read_ptr = Signal(ptr)
        overflowed = Signal()   # this frame did not fit: its beats are being thrown away

        # Header in: commit, rewind or wait (for room in the header FIFO).
        header = self.i_header.payload
        good = header.verdict == C.Verdict.OK
        m.d.comb += self.i_header.ready.eq(~good | overflowed | header_fifo.w_rdy)
        take_header = self.i_header.valid & self.i_header.ready
        queued = take_header & good & ~overflowed
        commit = queued & ~self.i_null
        rewind = take_header & ~commit
        m.d.comb += [header_fifo.w_data.eq(header), header_fifo.w_en.eq(queued),
                     self.committed.eq(queued)]

        # Payload in. A beat waits while a header is waiting, so that no beat of the next
        # frame is taken before the current frame is committed or rewound. A beat taken in
        # the cycle a header is taken belongs to the next frame.
        header_stuck = self.i_header.valid & ~self.i_header.ready
        base = Signal(ptr)          # where this cycle's beat goes
        frame_start = Signal(ptr)   # where the frame of this cycle's beat starts
        m.d.comb += [base.eq(write_ptr), frame_start.eq(commit_ptr)]
        with m.If(rewind):
            m.d.comb += base.eq(commit_ptr)
        with m.If(commit):
            m.d.comb += frame_start.eq(write_ptr)
        room = Signal()
        m.d.comb += room.eq((base - read_ptr)[: ptr.width] != self.depth)
        doomed = ~room & (frame_start == read_ptr)   # the frame alone fills the memory
        discarding = (overflowed & ~take_header) | doomed
        m.d.comb += self.i_payload.ready.eq(~header_stuck & (room | discarding))
        take_beat = self.i_payload.valid & self.i_payload.ready
        store = take_beat & room & ~(overflowed & ~take_header)
        m.d.comb += [
            write.addr.eq(base),
            write.data.eq(self.i_payload.payload),
            write.en.eq(store),
        ]
        m.d.sync += write_ptr.eq(base + store)
        with m.If(commit):
            m.d.sync += commit_ptr.eq(write_ptr)
        with m.If(take_header):
            m.d.sync += overflowed.eq(0)
        with m.If(take_beat & doomed):
            m.d.sync += overflowed.eq(1)

        # Counters.
        with m.If(commit):
            m.d.sync += self.passed.eq(self.passed + 1)
        with m.If(rewind & ~queued):
            with m.Switch(header.verdict):
                for v in C.Verdict:
                    with m.Case(v):
                        # An OK frame is only rewound when it overflowed.
                        reason = C.Verdict.OVERSIZE if v == C.Verdict.OK else v
                        m.d.comb += self.dropped[reason].eq(1)
                        m.d.sync += self.drops[reason].eq(self.drops[reason] + 1)

        # Payload out, from the committed region, through the read port's register.
        out_valid = Signal()
        advance = ~out_valid | self.o_payload.ready
        available = read_ptr != commit_ptr
        m.d.comb += self.level.eq((commit_ptr - read_ptr)[: ptr.width] * (self.width // 8))
        m.d.comb += [
            read.addr.eq(read_ptr),
            read.en.eq(advance),
            self.o_payload.valid.eq(out_valid),
            self.o_payload.payload.eq(read.data),
        ]
        with m.If(advance):
            m.d.sync += out_valid.eq(available)
            with m.If(available):
                m.d.sync += read_ptr.eq(read_ptr + 1)

        m.d.comb += [
            self.o_header.valid.eq(header_fifo.r_rdy),
            self.o_header.payload.eq(header_fifo.r_data),
            header_fifo.r_en.eq(self.o_header.ready),
        ]
        return m
