"""Egress of one switch port: result packets to each contributor on the port, and control
replies.

Takes the wide payload beats the aggregator sends this port (a result or a control reply,
its descriptor on its last beat) into a ring of `capacity` bytes, then sends one packet per
destination: for a result, each worker of the descriptor's `dests` whose job-table entry
names this port, in rank order, from the same stored payload; for a control reply, the one
requester. Each packet's header entry is built from the job table (worker MAC, IP, UDP port,
QPN, R_Key, base address + offset; the PSN is the job's credit limit, from the descriptor)
or, for a reply, from the request's addresses swapped (`reply_to`, which this port's
ingress holds until `reply_sent`), and goes with the payload (through a `Narrow` gearbox)
to the `Deparser`, which computes lengths, checksum and ICRC.

Throughput: the deparser's, one beat per cycle, no gap between packets when the payload is
stored. Latency: the first beat of a packet leaves 3 cycles after its payload's last beat
arrived (descriptor queued, header built, deparser). Drops nothing; a result for a worker on
no existing port is never sent.
"""

from amaranth import Array, Cat, Const, Module, Mux, Signal
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from netagg.contract import headers as C

from . import headers as H
from .aggregator_command import egress_beat, result_descriptor
from .beat import BeatLayout, FrameStream
from .control import ADDRESSES, JobTable, WorkerRead
from .deparser import Deparser
from .fabric import NO_FABRIC, UPLINK, Fabric
from .gearbox import Narrow
from .ingress import REPLY_TO


class Egress(wiring.Component):
    def __init__(self, *, port: int, ports: int, width: int, factor: int, jobs: int,
                 max_workers: int, capacity: int = 4096, icrc: str = "engine",
                 fabric: Fabric = NO_FABRIC):
        self.port, self.ports, self.width, self.factor = port, ports, width, factor
        self.fabric = fabric
        self.jobs, self.max_workers = jobs, max_workers
        self.icrc = icrc
        wide = width * factor
        self.depth = capacity // (wide // 8)
        if self.depth < 2 or self.depth & (self.depth - 1):
            raise ValueError(f"egress capacity {capacity} must be a power of two of 2+ beats")
        more = {} if not fabric.spine else {
            "pull": Out(1),                       # ... and it was a spine's pull
        }
        if fabric.uplinks:
            more["uplinks"] = In(UPLINK).array(fabric.uplinks)     # a leaf's uplink table
        super().__init__({
            **more,
            "i": In(stream.Signature(egress_beat(wide, ports, max_workers, fabric))),
            "reply_to": In(REPLY_TO),             # the control reply's addresses
            "table": In(JobTable(jobs, max_workers, fabric)),    # which ports the workers are on
            "workers": Out(WorkerRead(jobs * max_workers)),   # the entry of a destination
            "addresses": In(ADDRESSES),           # the switch's, the source of results
            "reply_sent": Out(1),                 # its header went to the deparser
            "o": Out(FrameStream(width)),
            "sent": Out(1),                       # a packet's header went to the deparser
            "result_job": Out(range(max(jobs, 2))),
            "result": Out(1),                     # ... and it was a result, of result_job
        })

    def elaborate(self, platform):
        m = Module()
        MW, J = self.max_workers, self.jobs
        wide = self.width * self.factor
        ptr = range(2 * self.depth)
        m.submodules.ring = ring = Memory(shape=BeatLayout(wide), depth=self.depth, init=[])
        ring_wr, ring_rd = ring.write_port(), ring.read_port()
        entry_layout = data.StructLayout(
            {"desc": result_descriptor(MW, self.fabric), "start": ptr, "beats": ptr})
        m.submodules.descriptors = descriptors = fifo.SyncFIFOBuffered(
            width=entry_layout.size, depth=8)
        m.submodules.narrow = narrow = Narrow(self.width, self.factor)
        m.submodules.deparser = deparser = Deparser(self.width, self.icrc)
        wiring.connect(m, narrow.o, deparser.payload)
        wiring.connect(m, deparser.o, wiring.flipped(self.o))

        # Payload in.
        write_ptr, free_ptr, frame_start = Signal(ptr), Signal(ptr), Signal(ptr)
        room = (write_ptr - free_ptr)[: len(write_ptr)] != self.depth
        m.d.comb += self.i.ready.eq(room & descriptors.w_rdy)
        take = self.i.valid & self.i.ready
        beat = self.i.payload.beat
        entry = Signal(entry_layout)
        m.d.comb += [
            ring_wr.addr.eq(write_ptr), ring_wr.data.eq(beat), ring_wr.en.eq(take),
            entry.desc.eq(self.i.payload.desc), entry.start.eq(frame_start),
            entry.beats.eq(write_ptr + 1 - frame_start),
            descriptors.w_data.eq(entry), descriptors.w_en.eq(take & beat.last),
        ]
        with m.If(take):
            m.d.sync += write_ptr.eq(write_ptr + 1)
            with m.If(beat.last):
                m.d.sync += frame_start.eq(write_ptr + 1)

        # Packets out: one header entry and one replay of the payload per destination.
        head = Signal(entry_layout)
        m.d.comb += head.eq(descriptors.r_data)
        desc = head.desc
        on_port = Signal(MW)            # the job's ranks whose results leave here
        job = desc.job[:max(1, (J - 1).bit_length())]
        m.d.comb += on_port.eq(Cat(*(
            Array(self.table.worker_port[j * MW + r] for j in range(J))[job] == self.port
            for r in range(MW))))
        remaining = Signal(MW)           # destinations still to send to
        rank = Signal(range(max(MW, 2)))
        for r in reversed(range(MW)):
            with m.If(remaining[r]):
                m.d.comb += rank.eq(r)
        m.d.comb += self.workers.at.eq(desc.job * MW + rank)
        worker = self.workers.worker

        header = Signal(H.PACKET_HEADER)
        reply_to = self.reply_to
        m.d.comb += [
            header.eth.ethertype.eq(C.ETHERTYPE_IPV4),
            header.ip.version.eq(C.IPV4_VERSION), header.ip.ihl.eq(C.IPV4_IHL),
            header.ip.flags.eq(C.IP_FLAGS_DF),
            header.ip.ttl.eq(C.RESULT_TTL), header.ip.protocol.eq(C.IP_PROTO_UDP),
            header.bth.pkey.eq(C.PKEY_DEFAULT), header.payload_length.eq(desc.length),
        ]
        m.d.comb += header.bth.psn.eq(desc.psn)
        with m.If(desc.control):
            m.d.comb += [
                header.eth.dst.eq(reply_to.eth_src), header.eth.src.eq(reply_to.eth_dst),
                header.ip.src.eq(reply_to.ip_dst), header.ip.dst.eq(reply_to.ip_src),
                header.udp.src_port.eq(reply_to.udp_dst), header.udp.dst_port.eq(reply_to.udp_src),
                header.bth.opcode.eq(C.OP_CONTROL), header.bth.dqpn.eq(C.CONTROL_QPN),
                header.opclass.eq(C.OpClass.NONE),
            ]
        with m.Else():
            imm = Signal(H.RESULT_IMM)
            m.d.comb += [
                imm.job.eq(desc.job), imm.count.eq(desc.count), imm.version.eq(desc.version),
                imm.slot.eq(desc.slot), imm.exponent.eq(desc.exponent),
                imm.overflow.eq(desc.overflow),
                header.eth.dst.eq(worker.mac), header.eth.src.eq(self.addresses.mac),
                header.ip.src.eq(self.addresses.ip), header.ip.dst.eq(worker.ip),
                header.udp.src_port.eq(self.addresses.udp_sport),
                header.udp.dst_port.eq(worker.udp_port),
                header.bth.opcode.eq(C.OP_RESULT), header.bth.dqpn.eq(worker.qpn),
                header.opclass.eq(C.OpClass.RETH_IMM),
                header.reth.va.eq(worker.va + desc.offset), header.reth.rkey.eq(worker.rkey),
                header.reth.dma_length.eq(desc.length), header.immdt.data.eq(imm.as_value()),
            ]
            if self.fabric.spine:
                # a spine's result or pull: RETH.va the use's CONTRIBUTION_VA; a pull has no
                # payload
                with m.If(desc.fabric_va):
                    m.d.comb += header.reth.va.eq(Cat(desc.offset, desc.msn))
                with m.If(desc.pull):
                    m.d.comb += [header.payload_length.eq(0), header.reth.dma_length.eq(0)]
            if self.fabric.uplinks:
                with m.If(desc.up):
                    self._partial(m, header, desc)

        # The payload of the packet being sent, read again from the ring.
        read_ptr, to_read = Signal(ptr), Signal(ptr)
        out_valid = Signal()
        advance = ~out_valid | narrow.i.ready
        m.d.comb += [
            ring_rd.addr.eq(read_ptr), ring_rd.en.eq(advance),
            narrow.i.valid.eq(out_valid), narrow.i.payload.eq(ring_rd.data),
        ]
        with m.If(advance):
            m.d.sync += out_valid.eq(to_read != 0)
            with m.If(to_read != 0):
                m.d.sync += [read_ptr.eq(read_ptr + 1), to_read.eq(to_read - 1)]

        loaded = Signal()                # `remaining` holds the head descriptor's destinations
        header_sent = Signal()           # the current destination's header has gone
        m.d.comb += [
            deparser.header.payload.eq(header),
            deparser.header.valid.eq(loaded & (remaining != 0) & ~header_sent),
            self.result_job.eq(desc.job),
        ]
        sent = deparser.header.valid & deparser.header.ready
        m.d.comb += [self.sent.eq(sent), self.result.eq(sent & ~desc.control),
                     self.reply_sent.eq(sent & desc.control)]
        with m.If(sent):
            m.d.sync += [header_sent.eq(1), read_ptr.eq(head.start), to_read.eq(head.beats)]
        if self.fabric.spine:
            m.d.comb += [self.pull.eq(sent & desc.pull),
                         self.result.eq(sent & ~desc.control & ~desc.pull)]
            with m.If(sent & desc.pull):            # its stored beat is not sent
                m.d.sync += to_read.eq(0)
        if self.fabric.uplinks:
            m.d.comb += self.result.eq(sent & ~desc.control & ~desc.pull & ~desc.up)
        done_reading = header_sent & (to_read == 0)
        dests = Mux(desc.control, 1, desc.dests & on_port)
        if self.fabric.uplinks:
            dests = Mux(desc.up, 1, dests)          # a partial: to this port's uplink
        with m.If(descriptors.r_rdy & ~loaded):
            m.d.sync += [loaded.eq(1), remaining.eq(dests), header_sent.eq(0)]
        with m.If(loaded & done_reading):
            m.d.sync += [header_sent.eq(0), remaining.eq(remaining & ~(Const(1, MW) << rank))]
        last_one = (remaining & (remaining - 1)) == 0
        finished = loaded & ((remaining == 0) | (done_reading & last_one))
        with m.If(finished):
            m.d.comb += descriptors.r_en.eq(1)
            m.d.sync += [loaded.eq(0), free_ptr.eq(head.start + head.beats), header_sent.eq(0)]
        return m

    def _partial(self, m, header, desc):
        """A leaf's partial up uplink `desc.uplink` (docs/leafspine.md): from the switch's
        addresses to the spine's, DSCP 7, BTH.dqpn 0 and BTH.psn its PARTIAL, RETH.va the
        use's CONTRIBUTION_VA and RETH.rkey the job's PARENT_KEY, its ImmDt a REQUEST_IMM of
        the leaf's rank in the spines' job."""
        J = self.jobs
        up = Array(self.uplinks)[desc.uplink]
        job = Array(self.table.job)[desc.job[:max(1, (J - 1).bit_length())]]
        part, imm = Signal(H.PARTIAL), Signal(H.REQUEST_IMM)
        m.d.comb += [
            part.count.eq(desc.count), part.overflow.eq(desc.overflow),
            part.resent.eq(desc.resent), part.final.eq(desc.final),
            imm.job.eq(desc.job), imm.rank.eq(job.parent[:5]), imm.version.eq(desc.version),
            imm.slot.eq(desc.slot), imm.exponent.eq(desc.exponent),
            header.eth.dst.eq(up.mac), header.ip.dst.eq(up.ip),
            header.ip.dscp.eq(C.PARTIAL_DSCP), header.udp.dst_port.eq(up.udp_port),
            header.bth.dqpn.eq(0), header.bth.psn.eq(part.as_value()),
            header.reth.va.eq(Cat(desc.offset, desc.msn)), header.reth.rkey.eq(job.parent_key),
            header.immdt.data.eq(imm.as_value()),
        ]
