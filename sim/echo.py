"""The echo switch: a measurement switch that answers each contribution at once.

`EchoSwitch` is the golden model (`sim.golden.GoldenSwitch`) but for where a contribution
goes: every rank has its own copy of each slot version, and a contribution completes a use
of it by itself, so it is answered at once, to its sender alone, with the result a job of one
worker would give: its own lanes as the sums, ImmDt count 1 (0 for a null), its exponent,
no overflow, addressed from the job table as every result is. Everything else is the golden
model's: the control path (registers, job table, counters), the parser's checks and the
contribution's checks (job, rank, slot, credit), a retransmission of a completed use
answered again (`replays`), an older message dropped (`drop_stale`).

Every contribution counts a completed use of its job (COMPLETED + 1), so the credit limit
its result carries (COMPLETED + CREDITS) is at least the one a switch that aggregates would
send: it never holds a sender back. It measures the host and the path to a switch without
the cost of aggregating (`sim.bench.contributions_per_second("echo")`); it is not a switch a
job of several workers can reduce with: each worker gets its own data back.

`send` applies a frame at once (`run` returns the frames sent since the last `run`). The
common frame, a contribution that begins a new use of its copy, takes a lean path: what
all contributions with its headers, ingress port, RETH.dma_length and ImmDt share (the
parser's verdict and the ICRC's state after the headers, as `sim.codec` caches them, the
job table's checks, the slot copy, the result's headers and ImmDt) is a `Reply` looked up
once and kept until the next register write; the contribution then costs its ICRC, the
MSN's and credit's checks, the copy's new use, the counters and its result (about 3 µs of
Python for 1 KiB). Any other frame (control, a parser drop, a refused, stale or
retransmitted contribution, one beyond the credit, a forced priority decision) goes through
the golden model's `receive`, which decides and counts it as for any frame.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from netagg.sim import wire as W
from netagg.sim.codec import (
    CHECKED,
    ICRC_WORD,
    OK,
    RETH_IMM,
    ResultTemplate,
    checks,
    icrc_matches,
    request,
    result_imm,
)
from netagg.sim.golden import GoldenSwitch, Job, SlotCopy, _signed

_RETH_AT = W.BTH_OFFSET + W.BTH_LEN                     # the RETH's offset in a frame
_SHORTEST = _RETH_AT + RETH_IMM.size + 4 + ICRC_WORD.size   # a contribution of one lane


@dataclasses.dataclass(slots=True)
class Reply:
    """What the lean path needs for the contributions of one sender (headers, ingress port,
    RETH.dma_length, ImmDt) that the parser and the job table take."""

    size: int                       # the frame's length
    body_end: int                   # where its ICRC is
    state: int                      # the ICRC's state after the headers
    start: int                      # the payload's offset
    length: int                     # its length
    null: bool                      # dropped by priority to a null (queue fill 0)
    exponent: int
    job: Job
    counters: dict                  # the job's
    rx: dict                        # the ingress port's
    copy: SlotCopy                  # the rank's own copy of the slot version
    bit: int                        # the rank's bit
    port: int                       # the port the result leaves by
    tx: dict | None                 # its counters; None: no such port, no result leaves
    template: ResultTemplate
    va: int                         # the worker's base address
    imm: int                        # the result's ImmDt


class EchoSwitch(GoldenSwitch):
    """The echo switch; parameters as `GoldenSwitch`'s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.own: dict[tuple[int, int, int], SlotCopy] = {}   # (slot, version, rank) -> copy
        self._replies: dict[tuple, Reply] = {}
        self._sent: list = []

    def send(self, port: int, frame: bytes, fill: int = 0, null: bool | None = None):
        """Apply a frame at once; `run` returns what it sent."""
        frame = bytes(frame)
        out = self._answer(port, frame) if fill == 0 and null is None else None
        self._sent += self.receive(port, frame, fill, null) if out is None else out

    def run(self) -> list:
        out, self._sent = self._sent, []
        return out

    def write(self, addr: int, value: int):
        super().write(addr, value)
        self._replies.clear()               # what they hold comes from the registers

    def _aggregation(self, job: Job, index: int, version: int, rank: int):
        """The rank's own copy of the slot version, one contribution per use, the result to
        the rank alone."""
        copy = self.own.get((index, version, rank))
        if copy is None:
            copy = self.own[index, version, rank] = SlotCopy()
        return copy, 1, (rank,)

    def _clear(self, job: Job):
        super()._clear(job)
        end = job.slot_base + job.slot_count
        self.own = {key: copy for key, copy in self.own.items()
                    if not job.slot_base <= key[0] < end}

    # --- the lean path ----------------------------------------------------------------------

    def _answer(self, port: int, frame: bytes) -> list | None:
        """What the switch sends for a contribution that begins a new use of its copy, as
        `receive` would, or None for any other frame."""
        if len(frame) < _SHORTEST:
            return None
        va, msn, dma_length, imm = RETH_IMM.unpack_from(frame, _RETH_AT)
        key = (port, frame[CHECKED], dma_length, imm)
        reply = self._replies.get(key)
        if reply is None:
            reply = self._reply(port, frame, dma_length, imm)
            if reply is None:
                return None
            if len(self._replies) >= 1 << 14:
                self._replies.clear()
            self._replies[key] = reply
        copy, job = reply.copy, reply.job
        if (len(frame) != reply.size or not icrc_matches(frame, reply.body_end, reply.state)
                or copy.count or copy.bitmap and not 0 < (msn - copy.msn16) & 0xFFFF < 0x8000
                or job.credits and _signed(msn - job.completed, 32) >= job.credits):
            return None             # a drop, a use in progress, a replay or an older message
        start, length = reply.start, reply.length
        payload = bytes(length) if reply.null else memoryview(frame)[start:start + length]
        # the copy's sums: its one contribution's int32 lanes (a use of one adds nothing)
        copy.begin(reply.bit, np.frombuffer(payload, "<i4"), reply.null, msn, reply.exponent)
        reply.rx["rx"] += 1
        if reply.null:
            reply.rx["drop_priority"] += 1
        counters = reply.counters
        counters["contributions"] += 1
        self._complete(job, counters, copy)
        if reply.tx is None:
            return []
        counters["results"] += 1
        reply.tx["tx"] += 1
        return [(reply.port, reply.template.frame(job.limit, reply.va + va, reply.imm,
                                                  payload))]

    def _reply(self, port: int, frame: bytes, dma_length: int, imm: int) -> Reply | None:
        """The `Reply` of a contribution the parser and the job table take, or None."""
        verdict, header, body_end, state = checks(frame[CHECKED], len(frame))
        if (verdict != OK or header.opcode != W.OP_CONTRIBUTION
                or header.length > self.queue_capacity):
            return None
        req = request(imm)
        if self._refusal(header.src_ip, dma_length, req, header.length) is not None:
            return None
        null = bool(req.droppable) and self._threshold(frame) <= 0
        job = self.job[req.job]
        copy, _, _ = self._aggregation(job, job.slot_base + req.slot, req.version, req.rank)
        w = job.table[req.rank]
        return Reply(
            size=len(frame), body_end=body_end, state=state, start=header.start,
            length=header.length, null=null, exponent=req.exponent, job=job,
            counters=self.job_counters[req.job], rx=self.port_counters[port], copy=copy,
            bit=1 << req.rank, port=w.port,
            tx=self.port_counters[w.port] if w.port < self.ports else None,
            template=self._template(w, header.length), va=w.va,
            imm=result_imm(req.job, int(not null), req.version, req.slot, req.exponent, 0))
