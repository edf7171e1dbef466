"""The echo switch: a measurement switch that answers each contribution at once.

`EchoSwitch` is the golden model (`sim.golden.GoldenSwitch`) but for where a contribution
goes: every rank has its own copy of each slot version, and a contribution completes a use
of it by itself, so it is answered at once, to its sender alone, with the result a job of one
worker would give: its own lanes as the sums, ImmDt count 1 (0 for a null), its exponent,
no overflow, addressed from the job table as every result is. Everything else is the golden
model's: the control path (registers, job table, counters), the parser's checks and the
contribution's checks (job, rank, key, slot, credit), a retransmission of a completed use
answered again (`replays`), an older message dropped (`drop_stale`).

Every contribution counts a completed use of its job (COMPLETED + 1), so the credit limit
its result carries (COMPLETED + CREDITS) is at least the one a switch that aggregates would
send: it never holds a sender back. It measures the host and the path to a switch without
the cost of aggregating (`sim.bench.contributions_per_second("echo")`); it is not a switch a
job of several workers can reduce with: each worker gets its own data back.

The ranks' copies are arrays (`RankCopies`), so that a run of contributions reads and writes
them in a few array operations. Three paths, one behaviour (tests/test_echo.py compares each
with `receive` frame for frame, output and counters):

- `send_run` takes a run of datagrams of one length from one sender (a GRO run, a batch):
  its longest prefix of contributions that each begin a new use of their copy is answered
  as one run of results (`sim.echo_run`); the row that ends it goes through `send`, and the
  rest is a run again;
- `send` applies one frame at once. The common frame, a contribution that begins a new use
  of its copy, takes a lean path: what all contributions with its headers, ingress port,
  RETH.rkey and dma_length and ImmDt share (the parser's verdict and the ICRC's state after the
  headers, as `sim.codec` caches them, the job table's checks, the copy, the result's headers
  and ImmDt) is a `Reply` looked up once and kept until the next register write; the
  contribution then costs its ICRC, the MSN's and credit's checks, the copy's new use, the
  counters and its result;
- any other frame (control, a parser drop, a refused, stale or retransmitted contribution,
  one beyond the credit, a forced priority decision) goes through the golden model's
  `receive`, which decides and counts it as for any frame.

`run` returns the frames sent since the last `run` or `sent_runs`; `sent_runs` returns them
with each run of results as one `netagg.host.udp_offload.FrameRun`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from netagg.contract import wire as W
from netagg.host.udp_offload import FrameRun
from netagg.sim import echo_run
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
from netagg.sim.golden import GoldenSwitch, Job, copy_field, signed

_RETH_AT = W.BTH_OFFSET + W.BTH_LEN                     # the RETH's offset in a frame
_SHORTEST = _RETH_AT + RETH_IMM.size + 4 + ICRC_WORD.size   # a contribution of one lane
RUN_MIN = 10        # rows a run needs to take `echo_run` (fewer: the per-frame lean path)


class RankCopies:
    """Every rank's own copy of each slot version: `sim.golden.SlotCopy`'s fields as arrays
    over copies numbered (slot index * 2 + version) * max_workers + rank (`index`), the sums
    as int32 lanes (a use of one completes with its first contribution: the golden model's
    saturating adds, on int64 sums, never happen to a copy)."""

    FIELDS = ("bitmap", "count", "data", "length", "msn16", "exponent", "overflow")

    def __init__(self, slots: int, max_workers: int, max_lanes: int):
        self.max_workers = max_workers
        n = slots * 2 * max_workers
        self.bitmap = np.zeros(n, np.int64)
        self.count = np.zeros(n, np.int64)      # 0 but while `receive` applies a frame
        self.data = np.zeros(n, np.int64)
        self.length = np.zeros(n, np.int64)
        self.msn16 = np.zeros(n, np.int64)
        self.exponent = np.zeros(n, np.int64)
        self.overflow = np.zeros(n, np.int64)
        self.sums = np.zeros((n, max_lanes), np.int32)
        self.row = np.zeros(n, np.int64)        # scratch: a run's first row of each copy

    def index(self, slot_index, version, rank):
        return (slot_index * 2 + version) * self.max_workers + rank

    def begin(self, c, bit, lanes: np.ndarray, null, msn, exponent, count: int = 1):
        """A new use of copies `c` (one, or an array with a row of `lanes` each), begun by one
        contribution (of the rank's `bit`), as `SlotCopy.begin`: its lanes (a null's are
        zeros) as the sums; `count` 0: the use complete with it."""
        self.bitmap[c], self.count[c], self.data[c] = bit, count, np.logical_not(null)
        self.length[c], self.msn16[c] = 4 * lanes.shape[-1], np.bitwise_and(msn, 0xFFFF)
        self.exponent[c], self.overflow[c] = exponent, 0
        self.sums[c, :lanes.shape[-1]] = lanes

    def clear(self, first_slot: int, end_slot: int):
        """The copies of slots first_slot .. end_slot - 1 back to fresh."""
        span = slice(first_slot * 2 * self.max_workers, end_slot * 2 * self.max_workers)
        for name in self.FIELDS:
            getattr(self, name)[span] = 0
        self.sums[span] = 0

    def view(self, c: int) -> CopyView:
        return CopyView(self, c)


class CopyView:
    """One copy of a `RankCopies`, read and written as a `SlotCopy` is by the golden model's
    contribution path. A rank's own copy completes each use at its first contribution, so
    none is ever in progress for a deadline to close: the tick a use began at is not kept."""

    __slots__ = ("copies", "c")
    bitmap, count, data = copy_field("bitmap"), copy_field("count"), copy_field("data")
    length, msn16, exponent = copy_field("length"), copy_field("msn16"), copy_field("exponent")
    overflow = copy_field("overflow", bool)

    def __init__(self, copies: RankCopies, c: int):
        self.copies, self.c = copies, c

    @property
    def sums(self) -> np.ndarray:
        return self.copies.sums[self.c, :self.length // 4]

    def begin(self, bit: int, sums: np.ndarray, null: bool, msn: int, exponent: int,
              now: int = 0):
        self.copies.begin(self.c, bit, sums, null, msn, exponent)


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
    copy: int                       # the rank's own copy of the slot version (`RankCopies`)
    bit: int                        # the rank's bit
    port: int                       # the port the result leaves by
    tx: dict | None                 # its counters; None: no such port, no result leaves
    template: ResultTemplate
    va: int                         # the worker's base address
    imm: int                        # the result's ImmDt


@dataclasses.dataclass
class Paths:
    """How many frames each path took (`run_rows` in `runs` runs)."""

    runs: int = 0
    run_rows: int = 0
    lean: int = 0
    receive: int = 0


class EchoSwitch(GoldenSwitch):
    """The echo switch; parameters as `GoldenSwitch`'s. It keeps no deadlines' clock
    (`tick`): a rank's own copy completes each use at once."""

    tick = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.copies = RankCopies(self.slots, self.max_workers, self.max_payload // 4)
        self.paths = Paths()
        self._replies: dict[tuple, Reply] = {}
        # the `Rows` of each run's headers, first row and size (`echo_run.answer`'s cache)
        self.run_layouts: dict[tuple, echo_run.Rows | None] = {}
        self._sent: list = []

    def send(self, port: int, frame: bytes, fill: int = 0, null: bool | None = None):
        """Apply a frame at once; `run` returns what it sent."""
        frame = bytes(frame)
        out = self._answer(port, frame) if fill == 0 and null is None else None
        if out is None:
            self.paths.receive += 1
            out = self.receive(port, frame, fill, null)
        else:
            self.paths.lean += 1
        self._sent += out

    def send_run(self, port: int, heads, body, size: int):
        """Apply a run of frames at once, in order: frame i is `heads[i]` (its Ethernet,
        IPv4 and UDP headers, `W.BTH_OFFSET` bytes) and the datagram at `i * size` in `body`
        (BTH .. ICRC); `sent_runs` returns what it sent."""
        heads, view, at = tuple(heads), memoryview(body), 0
        while at < len(heads):
            taken, alone, out = (
                echo_run.answer(self, port, heads[at:], view[at * size:len(heads) * size], size)
                if len(heads) - at >= RUN_MIN else (0, len(heads) - at, None))
            if taken:
                self.paths.runs += 1
                self.paths.run_rows += taken
                if out is not None:
                    self._sent.append(out)
            at += taken
            for i in range(at, at + alone):
                self.send(port, heads[i] + bytes(view[i * size:(i + 1) * size]))
            at += alone

    def run(self) -> list:
        out, self._sent = self._sent, []
        return [f for item in out for f in (item.frames() if isinstance(item, FrameRun)
                                            else (item,))]

    def sent_runs(self) -> list:
        """What `run` returns, but each run of results as one `FrameRun`."""
        out, self._sent = self._sent, []
        return out

    def write(self, addr: int, value: int):
        super().write(addr, value)
        self._replies.clear()               # what they hold comes from the registers

    def _aggregation(self, job: Job, index: int, version: int, rank: int):
        """The rank's own copy of the slot version, one contribution per use, the result to
        the rank alone."""
        return self.copies.view(self.copies.index(index, version, rank)), 1, (rank,)

    def _clear(self, job: Job):
        deferred = self._cleared is not None        # to the end of the control request
        super()._clear(job)
        if not deferred and job.enable:             # a disabled job's range is no one's
            self.copies.clear(job.slot_base, min(job.slot_base + job.slot_count, self.slots))

    # --- the lean path ----------------------------------------------------------------------

    def _answer(self, port: int, frame: bytes) -> list | None:
        """What the switch sends for a contribution that begins a new use of its copy, as
        `receive` would, or None for any other frame."""
        if len(frame) < _SHORTEST:
            return None
        va, rkey, dma_length, imm = RETH_IMM.unpack_from(frame, _RETH_AT)
        msn, offset = W.split_va(va)
        key = (port, frame[CHECKED], rkey, dma_length, imm)
        reply = self._replies.get(key)
        if reply is None:
            reply = self._reply(port, frame, rkey, dma_length, imm)
            if reply is None:
                return None
            if len(self._replies) >= 1 << 14:
                self._replies.clear()
            self._replies[key] = reply
        copies, c, job = self.copies, reply.copy, reply.job
        bitmap = int(copies.bitmap[c])
        if (len(frame) != reply.size or not icrc_matches(frame, reply.body_end, reply.state)
                or copies.count[c] or bitmap and not 0 < (msn - int(copies.msn16[c])) & 0xFFFF
                < 0x8000 or job.credits and signed(msn - job.completed, 32) >= job.credits):
            return None             # a drop, a use in progress, a replay or an older message
        start, length = reply.start, reply.length
        payload = bytes(length) if reply.null else memoryview(frame)[start:start + length]
        copies.begin(c, reply.bit, np.frombuffer(payload, "<i4"), reply.null, msn,
                     reply.exponent)
        reply.rx["rx"] += 1
        if reply.null:
            reply.rx["drop_priority"] += 1
        counters = reply.counters
        counters["contributions"] += 1
        self._complete(job, counters, copies.view(c))
        if reply.tx is None:
            return []
        counters["results"] += 1
        reply.tx["tx"] += 1
        return [(reply.port, reply.template.frame(job.limit, reply.va + offset, reply.imm,
                                                  payload))]

    def _reply(self, port: int, frame: bytes, rkey: int, dma_length: int,
               imm: int) -> Reply | None:
        """The `Reply` of a contribution the parser and the job table take, or None."""
        verdict, header, body_end, state = checks(frame[CHECKED], len(frame))
        if (verdict != OK or header.opcode != W.OP_CONTRIBUTION
                or header.length > self.queue_capacity):
            return None
        req = request(imm)
        if self._refusal(header.src_ip, dma_length, req, header.length, rkey) is not None:
            return None
        null = bool(req.droppable) and self.drop_threshold(frame) <= 0
        job = self.job[req.job]
        w = job.table[req.rank]
        return Reply(
            size=len(frame), body_end=body_end, state=state, start=header.start,
            length=header.length, null=null, exponent=req.exponent, job=job,
            counters=self.job_counters[req.job], rx=self.port_counters[port],
            copy=self.copies.index(job.slot_base + req.slot, req.version, req.rank),
            bit=1 << req.rank, port=w.port,
            tx=self.port_counters[w.port] if w.port < self.ports else None,
            template=self.result_template(w, header.length), va=w.va,
            imm=result_imm(req.job, int(not null), req.version, req.slot, req.exponent, 0))
