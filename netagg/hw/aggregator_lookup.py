"""The aggregator's lookup stage: what a packet is, and whether the job table lets it in.

Takes committed header entries (`header`) one a cycle, unless a control request is being
served (`barrier`: none is taken behind it), and classifies each (`Look`): a contribution,
checked for its payload length, job, rank and source IP, key (RETH.rkey, the job's KEY),
slot, and credit (its message number, the top half of RETH.va, below the job's completed
uses plus its credits; the use the packet in the decide stage completes, `completing`,
which the job's count takes only a cycle later, included), in that order, the first failed
check naming it; a control request, checked for
its length; on a leaf, a spine's frame (marked by the ingress), its RESULT_IMM read as the
contribution's fields and checked as the golden leaf's `drop_parent` (`parent`,
`parent_ok`); or none of these (unhandled).
It gives the slot's index in the state memory (`index`, read in the same cycle) and passes
the packet on (`o`) with what the decide stage needs of its job: its workers, its quorum (at
most its workers; 0 means all), the ports its workers are on (`completion_ports`) and the
port of the packet's worker (`worker_port`).

Latency: 2 cycles (a register for the header, one for the verdict, beside the state read);
the whole stage moves when `o.ready`, or waits. Drops nothing: the decide stage drops what
this stage judged bad.
"""

import enum

from amaranth import Array, Cat, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from netagg.contract import headers as C
from netagg.contract import regmap as R

from . import headers as H
from .aggregator_command import MAX_CONTROL_PAYLOAD
from .control import JobTable
from .fabric import NO_FABRIC, Fabric
from .ingress import ingress_header


class Look(enum.IntEnum):
    UNHANDLED = 0
    BAD_PAYLOAD = 1
    BAD_JOB = 2
    BAD_WORKER = 3
    BAD_KEY = 4
    BAD_SLOT = 5
    BAD_CREDIT = 6
    CONTROL = 7
    AGGREGATE = 8


def looked_up(ports: int, slots: int, fabric: Fabric = NO_FABRIC):
    """A packet as the lookup stage passes it on: its header entry, the verdict, and what the
    decide stage reads of its job and slot; on a leaf, whether it is a spine's frame of a
    job of this switch (`parent`, its `imm` read from its RESULT_IMM) and whether it passed
    the checks of one (`parent_ok`)."""
    more = {"parent": 1, "parent_ok": 1} if fabric.uplinks else {}
    return data.StructLayout({
        "header": ingress_header(ports, fabric), "look": Look, "imm": H.REQUEST_IMM,
        "index": range(slots), "workers": 6, "quorum": 6,
        "completion_ports": ports, "worker_port": ports, **more,
    })


class Lookup(wiring.Component):
    def __init__(self, *, ports: int, jobs: int, max_workers: int, slots: int,
                 max_payload: int, fabric: Fabric = NO_FABRIC):
        self.ports, self.jobs, self.max_workers = ports, jobs, max_workers
        self.slots, self.max_payload = slots, max_payload
        self.fabric = fabric
        super().__init__({
            "header": In(stream.Signature(ingress_header(ports, fabric))),
            "barrier": In(1),             # a control request is being served: take none
            "table": In(JobTable(jobs, max_workers, fabric)),
            "completing": In(1),          # the packet in decide completes a use of its job
            "completing_job": In(H.REQUEST_IMM.wire_fields["job"]),
            "request": Out(1),            # a control request was taken (raises the barrier)
            "index": Out(17),             # the slot to read the state of, when o.ready
            "o": Out(stream.Signature(looked_up(ports, slots, fabric))),
        })

    def elaborate(self, platform):
        m = Module()
        P, MW, J = self.ports, self.max_workers, self.jobs
        table = self.table
        go = self.o.ready

        a_valid = Signal()
        a = Signal(self.header.payload.shape(), reset_less=True)
        m.d.comb += self.header.ready.eq(go & ~self.barrier)
        with m.If(go):
            m.d.sync += a_valid.eq(self.header.valid & ~self.barrier)
            m.d.sync += a.eq(self.header.payload)
        m.d.comb += self.request.eq(
            self.header.valid & self.header.ready & H.is_control(self.header.payload.bth))

        imm = H.REQUEST_IMM(a.immdt.data)
        if self.fabric.uplinks:
            imm = self._parent_imm(m, a, imm)
        job_number = imm.job
        job = Array(table.job)[job_number[: max(1, (J - 1).bit_length())]]
        index = self.index
        m.d.comb += index.eq(job.slot_base + imm.slot)
        look = self._look(m, a, imm, job, index)
        completion_ports = Signal(P)
        rank_ports = [Array(table.worker_port[j * MW + r] for j in range(J))[job_number]
                      for r in range(MW)]
        m.d.comb += completion_ports.eq(Cat(*(
            Cat(*(((rank_ports[r] == p) & (r < job.workers)) for r in range(MW))).any()
            for p in range(P))))
        worker_port = Signal(P)
        worker_port_number = Array(table.worker_port)[job_number * MW + imm.rank]
        m.d.comb += worker_port.eq(Cat(*((worker_port_number == p) for p in range(P))))

        b_valid, b = Signal(), Signal(a.shape(), reset_less=True)
        b_look, b_imm = Signal(Look), Signal(H.REQUEST_IMM, reset_less=True)
        b_index = Signal(range(self.slots), reset_less=True)
        b_workers, b_quorum = Signal(6, reset_less=True), Signal(6, reset_less=True)
        b_completion_ports = Signal(P, reset_less=True)
        b_worker_port = Signal(P, reset_less=True)
        if self.fabric.uplinks:
            self._parent(m, a, imm, job, index, look, go)
        with m.If(go):
            m.d.sync += [
                b_valid.eq(a_valid), b.eq(a), b_look.eq(look), b_imm.eq(imm),
                b_index.eq(index), b_workers.eq(job.workers),
                b_quorum.eq(Mux((job.quorum == 0) | (job.quorum >= job.workers),
                                job.workers, job.quorum)),
                b_completion_ports.eq(completion_ports), b_worker_port.eq(worker_port),
            ]
        o = self.o.payload
        m.d.comb += [
            self.o.valid.eq(b_valid), o.header.eq(b), o.look.eq(b_look), o.imm.eq(b_imm),
            o.index.eq(b_index), o.workers.eq(b_workers), o.quorum.eq(b_quorum),
            o.completion_ports.eq(b_completion_ports), o.worker_port.eq(b_worker_port),
        ]
        return m

    @staticmethod
    def _parent_imm(m, a, imm):
        """A leaf's view of a packet's ImmDt: a spine's frame's RESULT_IMM read as a
        REQUEST_IMM of rank 0 (its job, version, slot and exponent), another's as it is."""
        given, result = Signal(H.REQUEST_IMM), H.RESULT_IMM(a.immdt.data)
        m.d.comb += given.eq(imm)
        with m.If(a.parent):
            m.d.comb += [given.rank.eq(0), given.version.eq(result.version),
                         given.slot.eq(result.slot), given.exponent.eq(result.exponent),
                         given.droppable.eq(0), given.reserved.eq(0)]
        return given

    def _parent(self, m, a, imm, job, index, look, go):
        """A leaf's checks of a spine's frame, as the golden leaf's `drop_parent`: its job's
        enabled with a parent (PARENT.enable), from the uplink by its port, RETH.rkey the
        job's PARENT_KEY, RETH.dma_length its payload's, its slot the job's. A job beyond
        the switch's is `drop_bad_job` (its port's)."""
        enable = R.PARENT.bits("enable")[0]
        ok = (job.enable & job.parent[enable] & a.by & (a.reth.rkey == job.parent_key)
              & (a.reth.dma_length == a.payload_length) & (imm.slot < job.slot_count)
              & (index < self.slots))
        with m.If(a.parent):
            m.d.comb += look.eq(Mux(imm.job < self.jobs, Look.UNHANDLED, Look.BAD_JOB))
        o = self.o.payload
        b_parent, b_ok = Signal(), Signal()
        with m.If(go):
            m.d.sync += [b_parent.eq(a.parent & (imm.job < self.jobs)), b_ok.eq(ok)]
        m.d.comb += [o.parent.eq(b_parent), o.parent_ok.eq(b_ok)]

    def _look(self, m, a, imm, job, index):
        """The packet's class: the first check it fails, or what it is."""
        MW, J = self.max_workers, self.jobs
        length = a.payload_length
        job_number = imm.job
        worker_ip = Array(self.table.worker_ip)[job_number * MW + imm.rank]
        contribution = a.bth.opcode == C.OP_CONTRIBUTION
        control = H.is_control(a.bth)
        length_ok = ((length >= 4) & (length <= self.max_payload) & (length[:2] == 0)
                     & (a.reth.dma_length == length))
        control_length_ok = (length >= 8) & (length <= MAX_CONTROL_PAYLOAD) & (length[:3] == 0)
        job_ok = (job_number < J) & job.enable
        worker_ok = (imm.rank < job.workers) & (imm.rank < MW) & (worker_ip == a.ip.src)
        if self.fabric.spine:
            # a spine's job takes a leaf's partial only by the port of the leaf's entry
            entry_port = Array(self.table.worker_port)[job_number * MW + imm.rank]
            worker_ok &= ~job.partials | (entry_port == a.port)
        key_ok = a.reth.rkey == job.key
        slot_ok = (imm.slot < job.slot_count) & (index < self.slots)
        ahead = Signal(32)          # the message's distance beyond the job's completed uses
        m.d.comb += ahead.eq(H.CONTRIBUTION_VA(a.reth.va).msn - job.completed
                             - (self.completing & (self.completing_job == job_number)))
        credit_ok = (job.credits == 0) | (ahead[-1] | (ahead < job.credits))

        look = Signal(Look)
        with m.If(contribution):
            with m.If(~length_ok):
                m.d.comb += look.eq(Look.BAD_PAYLOAD)
            with m.Elif(~job_ok):
                m.d.comb += look.eq(Look.BAD_JOB)
            with m.Elif(~worker_ok):
                m.d.comb += look.eq(Look.BAD_WORKER)
            with m.Elif(~key_ok):
                m.d.comb += look.eq(Look.BAD_KEY)
            with m.Elif(~slot_ok):
                m.d.comb += look.eq(Look.BAD_SLOT)
            with m.Elif(~credit_ok):
                m.d.comb += look.eq(Look.BAD_CREDIT)
            with m.Else():
                m.d.comb += look.eq(Look.AGGREGATE)
        with m.Elif(control):
            m.d.comb += look.eq(Mux(control_length_ok, Look.CONTROL, Look.BAD_PAYLOAD))
        with m.Else():
            m.d.comb += look.eq(Look.UNHANDLED)
        return look
