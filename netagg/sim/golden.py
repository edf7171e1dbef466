"""The golden model: a plain-Python, bit-exact description of what the switch does.

Frames in, frames out. `GoldenSwitch.receive(port, frame, fill=0, null=None)` applies one
frame, in the order the switch commits frames (the end of the frame, then the lower port
first), and returns the frames it sends as (port, frame) pairs; on each port they leave in
that order. The RTL is checked against this model, and the host can use it as a switch where
no compiler is available (`send`/`run` is the interface every backend has). Frames are read
and written by `sim.codec`, bit for bit in `netagg.contract.wire`'s format.

What the switch does, frame by frame:

1. The parser's checks (`hw.parser`), with the same verdicts; a frame that fails is dropped
   and counted on its port by reason (`drop_<verdict>`). A good frame counts `rx`.
2. Priority drop, at ingress: a contribution (opcode 0x2B) marked droppable in its ImmDt
   becomes a NULL contribution when `fill` (bytes of payload its port's queue holds ahead of
   it) is at least the drop threshold of its priority class (IPv4 DSCP >> 3; registers
   REG_DROP_THRESHOLD + class, reset NEVER_DROP). A null keeps its whole header, its payload
   length included, and its payload is discarded (it adds zeros); it counts `drop_priority`
   on its port and goes on like any frame. `null=True/False` forces the decision (a
   testbench that saw the RTL's); only a droppable contribution can be null.
3. Classification: opcode 0x2B (UC RDMA WRITE Only with Immediate) is a contribution; opcode
   0x24 (UC SEND Only) to QPN 3 (CONTROL_QPN) is a control request; anything else is
   `drop_unhandled`.
4. A control request whose payload is not 1..64 whole records is `drop_bad_payload`; else
   each record is applied in order and the reply (`netagg.contract.wire`) goes out of the same port.
5. A contribution is checked in this order: payload 4..max_payload bytes, a multiple of 4,
   equal to RETH.dma_length (else `drop_bad_payload`, port); job below `jobs` and enabled
   (else `drop_bad_job`, port); rank below the job's workers and source IP the rank's (else
   `drop_bad_worker`, job); RETH.rkey the job's KEY (else `drop_bad_key`, job); slot below
   the job's slot count and inside the pool (else `drop_bad_slot`, job); its message
   sequence number (MSN, the top 32 bits of RETH.va, `wire.CONTRIBUTION_VA`) inside the
   job's credit: with CREDITS != 0, signed32(msn - COMPLETED) >= CREDITS is `drop_credit`
   (a message far behind COMPLETED is a retransmission of an old use, and passes).
6. Slot state, per (slot, version) copy: the bitmap of contributors, the count of arrivals of
   the current use (it returns to 0 when the use completes), how many of them carried data
   (not null), the payload length, the low 16 bits of the use's MSN, the running sums (int32
   lanes, saturating), the exponent (signed, maximum) and the overflow flag. With
   d = signed16(msn - copy's MSN) (low 16 bits):
   - no use in progress (count 0): if the copy is fresh (empty bitmap) or d > 0, a NEW USE
     begins: bitmap, count, data, length, MSN, sums, exponent and overflow are overwritten
     by this contribution's (zeros for a null's sums); if d == 0, the use is complete and
     its result goes again to this worker alone, whether or not its bit is set (it may have
     arrived after the use closed early) (`replays`), unless its length is not the use's
     (`drop_bad_length`); if d < 0, `drop_stale`;
   - a use in progress: d != 0 is `drop_stale`; the worker's bit already set is
     `duplicates`, unless the use is at least the job's DEADLINE ticks old (ticks since it
     began, modulo 2**DEADLINE_BITS; `tick`) and the length is the use's: then the use closes
     short (`closed_late`, and it is complete as below, its result, of the contributions it
     has, to every worker); a different length is `drop_bad_length`; else the lanes are added
     (a null adds zeros), the exponent is the maximum (a null's included), the bit is set,
     the count goes up;
   - a NEW USE or an add counts `contributions`. When the count reaches the quorum (QUORUM
     if 0 < QUORUM < workers, else the workers; a use already past a QUORUM written lower
     while it was in progress completes at its next contribution), it returns to 0: the use
     is complete
     (`completed`, the job's COMPLETED register + 1, `overflows` if a lane saturated), and
     the result goes to every worker of the job, in rank order, each on the port its
     job-table entry names.
   The two copies are independent (a worker alternates versions across its uses of a slot).
7. A result is addressed from the job table: the worker's MAC, IP, UDP port, QPN and R_Key,
   RETH.va = the worker's base address + the contribution's offset (RETH.va's low 32
   bits). Its BTH.psn is the job's credit limit, (COMPLETED + CREDITS) & 0xFFFFFF,
   COMPLETED read after the use's completion was counted (for a replay, its current
   value). Its ImmDt count is the number of contributions with data (nulls excluded); a use
   of nulls only sums to zeros.
8. A write of a job's CONFIG clears its COMPLETED register (not its EPOCH and KEY) and, if
   the job is enabled when the control request's last record has been applied, the slot
   state of its slot range then (the gateware clears them after the request, one slot per
   cycle; a disabled job's range may overlap an enabled job's, and its slots are cleared
   when it is enabled).
9. Who may write (`sim.golden_registers.Registers.apply`, `netagg.contract.regmap`'s rules): an
enabled
   job's block only its owner (the source of the request that enabled it) and the manager,
   and a worker's entry also the address it holds (anyone while it holds none); the switch's
   own writable registers, once a manager is set, only the manager; a job's slot range is
   fixed while it is enabled, and a CONFIG write enables it only inside the switch's slots
   and apart from every other enabled job's range. A refused record changes nothing and
   answers the register's value.
"""

from __future__ import annotations

import collections
import dataclasses
import struct

import numpy as np

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.contract.headers import Verdict
from netagg.sim.codec import (
    OK,
    Extension,
    Header,
    Request,
    ResultTemplate,
    contribution,
    decode,
    result_imm,
)
from netagg.sim.golden_registers import Registers

# The port counter of each verdict but OK (as `hw.control` counts them).
VERDICT_COUNTERS = {v: f"drop_{v.name.lower()}" for v in Verdict if v != Verdict.OK}
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
PORT_REFUSALS = {"drop_bad_payload", "drop_bad_job"}     # counted on the port, not the job


def parse(frame: bytes):
    """The parser's verdict on a frame, and (opcode, payload offset, payload length)."""
    verdict, header = decode(frame)
    return verdict, header and (header.opcode, header.start, header.length)


@dataclasses.dataclass
class Worker:
    port: int = 0
    udp_port: int = 0
    mac: int = 0
    ip: int = 0
    qpn: int = 0
    rkey: int = 0
    va: int = 0


@dataclasses.dataclass
class Job:
    enable: bool = False
    workers: int = 0
    slot_base: int = 0
    slot_count: int = 0
    credits: int = 0                  # uses beyond COMPLETED a worker may open; 0: no limit
    quorum: int = 0                   # contributions that complete a use; 0: all workers
    completed: int = 0                # the COMPLETED register (32 bits, wraps)
    epoch: int = 0                    # the EPOCH register
    key: int = 0                      # the KEY register: every contribution's RETH.rkey
    deadline: int = 0                 # the DEADLINE register: ticks; 0: none
    owner: int = 0                    # IPv4 source of the request that enabled it (0: none)
    table: list = dataclasses.field(default_factory=list)
    beats: list = dataclasses.field(default_factory=list)     # by rank: BEAT registers

    @property
    def config(self) -> int:
        return R.CONFIG.pack(enable=int(self.enable), workers=self.workers)

    @property
    def needed(self) -> int:
        """Contributions that complete a use."""
        return self.quorum if 0 < self.quorum < self.workers else self.workers

    @property
    def limit(self) -> int:
        """The credit limit, as results carry it in BTH.psn."""
        return (self.completed + self.credits) & 0xFFFFFF


@dataclasses.dataclass(eq=False)
class SlotCopy:
    """One version of a slot."""

    bitmap: int = 0
    count: int = 0                    # arrivals of the use in progress (0: none)
    data: int = 0                     # contributions of the use that carried data
    sums: np.ndarray | None = None    # int64 lanes holding saturated int32 sums
    length: int = 0
    msn16: int = 0                    # low 16 bits of the use's MSN
    exponent: int = 0
    overflow: bool = False
    begun: int = 0                    # the tick the use began at

    def begin(self, bit: int, sums: np.ndarray, null: bool, msn: int, exponent: int, now: int):
        """A new use, begun at tick `now` by one contribution (its rank's `bit`) with its
        lanes as the `sums` (a null's are zeros)."""
        self.bitmap, self.count, self.data = bit, 1, int(not null)
        self.sums, self.length, self.msn16 = sums, 4 * len(sums), msn & 0xFFFF
        self.exponent, self.overflow, self.begun = exponent, False, now

    def __eq__(self, other):
        if not isinstance(other, SlotCopy):
            return NotImplemented
        pairs = ((getattr(self, f.name), getattr(other, f.name))
                 for f in dataclasses.fields(self))
        return all(np.array_equal(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray)
                   else a == b for a, b in pairs)


def copy_field(name: str, kind=int) -> property:
    """A `SlotCopy` field of a view onto copies held in numpy arrays (`view.copies.<name>`
    at `view.c`), as the fast switch and the echo switch keep them."""
    def get(view):
        return kind(getattr(view.copies, name)[view.c])

    def set_(view, value):
        getattr(view.copies, name)[view.c] = value
    return property(get, set_)


def wide_lanes(payload: bytes) -> np.ndarray:
    """The int32 lanes of a payload, widened to int64 for saturating sums."""
    return np.frombuffer(payload, "<i4").astype(np.int64)


def add_saturating(sums: np.ndarray, payload: bytes) -> bool:
    """Add a payload's int32 lanes into `sums`, each lane saturating at the int32 range (the
    aggregator's saturating adders); whether any lane saturated."""
    np.add(sums, np.frombuffer(payload, "<i4"), out=sums)
    if np.minimum.reduce(sums) >= INT32_MIN and np.maximum.reduce(sums) <= INT32_MAX:
        return False
    np.clip(sums, INT32_MIN, INT32_MAX, out=sums)
    return True


def signed(v: int, bits: int) -> int:
    """The low `bits` bits of `v` as a two's complement number (a wrapped difference)."""
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


class GoldenSwitch(Registers):
    """The switch as a Python object. Parameters as the gateware's: `ports`, `jobs`,
    `max_workers` (per job), `slots` (per version), `width` (reported in PARAMS only),
    `max_payload` (bytes of lanes), `queue_capacity` (bytes of payload a port's queue holds:
    a larger frame is OVERSIZE). A leaf or a spine (`sim.golden_leaf`) keeps more per job
    and per slot copy: its `job_type` and `copy_type`."""

    job_type, copy_type = Job, SlotCopy

    def __init__(self, ports: int = 4, jobs: int = 4, max_workers: int = 8, slots: int = 64,
                 width: int = 64, max_payload: int = W.MAX_PAYLOAD,
                 queue_capacity: int = 4096, mac: int = 0, ip: int = 0):
        if not 2 <= ports <= 16:
            raise ValueError(f"ports must be 2..16, not {ports}")
        if not 1 <= jobs <= W.MAX_JOBS or not 1 <= max_workers <= W.MAX_WORKERS:
            raise ValueError("jobs must be 1..16 and max_workers 1..32")
        if not 1 <= slots <= W.MAX_SLOTS:
            raise ValueError(f"slots must be 1..{W.MAX_SLOTS}")
        self.ports, self.jobs, self.max_workers, self.slots = ports, jobs, max_workers, slots
        self.width, self.max_payload, self.queue_capacity = width, max_payload, queue_capacity
        self.mac, self.ip, self.udp_sport = mac, ip, R.UDP_SPORT_RESET
        self.manager = 0                # REG_MANAGER: its IPv4 address, 0 for none
        self.drop_thresholds = [R.NEVER_DROP] * R.PRIORITY_CLASSES
        self.job = [self.job_type(table=[Worker() for _ in range(max_workers)],
                                  beats=[0] * max_workers) for _ in range(jobs)]
        self.state = [[self.copy_type(), self.copy_type()] for _ in range(slots)]
        self.port_counters = [dict.fromkeys(R.PORT_COUNTERS, 0) for _ in range(ports)]
        self.job_counters = [dict.fromkeys(R.JOB_COUNTERS, 0) for _ in range(jobs)]
        self._pending = collections.deque()
        self._cleared = None          # in a control request: the jobs whose CONFIG it wrote
        self._templates = {}          # the result headers of each destination and length
        self.now = 0                  # ticks of the deadlines' clock, wrapping

    # --- the backend interface ------------------------------------------------------------

    def send(self, port: int, frame: bytes, fill: int = 0, null: bool | None = None):
        self._pending.append((port, bytes(frame), fill, null))

    def run(self) -> list:
        out = []
        while self._pending:
            out += self.receive(*self._pending.popleft())
        return out

    # --- one frame ------------------------------------------------------------------------

    def drops_payload(self, frame: bytes, fill: int) -> bool:
        """Whether the ingress drops this frame's payload by priority (to a null
        contribution) when its queue holds `fill` bytes ahead of it."""
        request = contribution(frame, decode(frame)[1])
        return _droppable(request) and fill >= self.drop_threshold(frame)

    def drop_threshold(self, frame: bytes) -> int:
        """The drop threshold of the frame's priority class (IPv4 DSCP >> 3)."""
        return self.drop_thresholds[frame[W.IP_OFFSET + 1] >> 5]

    def receive(self, port: int, frame: bytes, fill: int = 0,
                null: bool | None = None) -> list:
        """Apply one frame that arrived on `port`; the frames sent, as (port, frame).

        `fill`: bytes of payload the port's queue holds ahead of this frame, for the priority
        drop. `null`: None to decide by the drop thresholds, True/False to force the decision
        (True only for a droppable contribution, else ValueError)."""
        if not 0 <= port < self.ports:
            raise ValueError(f"port {port} does not exist (ports 0..{self.ports - 1})")
        counters = self.port_counters[port]
        verdict, header = decode(frame)
        if verdict == OK and header.length > self.queue_capacity:
            verdict, header = Verdict.OVERSIZE, None
        request = contribution(frame, header)
        droppable = _droppable(request) and not self.from_parent(header)
        if null and not droppable:
            raise ValueError("only a droppable contribution that the parser takes can be null")
        if verdict != OK:
            counters[VERDICT_COUNTERS[verdict]] += 1
            return []
        counters["rx"] += 1
        if null is None:
            null = droppable and fill >= self.drop_threshold(frame)
        if null:
            counters["drop_priority"] += 1
        start, length = header.start, header.length
        payload = bytes(length) if null else frame[start:start + length]
        if request is not None:
            out = self._contribution(port, frame, header, *request, payload, bool(null))
        elif header.opcode == W.OP_CONTROL and header.dqpn == W.CONTROL_QPN:
            out = self._control(port, frame, payload)
        else:
            counters["drop_unhandled"] += 1
            out = []
        for p, _ in out:
            self.port_counters[p]["tx"] += 1
        return out

    def from_parent(self, header: Header | None) -> bool:
        """Whether a frame is a spine's to this switch as a leaf (`sim.golden_leaf`): not a
        contribution, never nulled by priority. A switch without uplinks has no parent."""
        return False

    def _contribution(self, port: int, frame: bytes, header: Header, reth: Extension,
                      req: Request, payload: bytes, null: bool) -> list:
        if not self._admitted(port, header, reth, req, len(payload)):
            return []
        j, rank, slot, version = req.job, req.rank, req.slot, req.version
        job, counters = self.job[j], self.job_counters[j]
        msn, offset = W.split_va(reth.va)
        copy, needed, ranks = self._aggregation(job, job.slot_base + slot, version, rank)
        bit = 1 << rank
        d = signed(msn - copy.msn16, 16)
        if copy.count == 0:
            if copy.bitmap and d == 0 and len(payload) != copy.length:
                counters["drop_bad_length"] += 1
                return []
            if copy.bitmap and d == 0:
                counters["replays"] += 1
                return self._results(j, slot, version, copy, [rank], offset)
            if copy.bitmap and d < 0:
                counters["drop_stale"] += 1
                return []
            copy.begin(bit, wide_lanes(payload), null, msn, req.exponent, self.now)
        elif d != 0:
            counters["drop_stale"] += 1
            return []
        elif copy.bitmap & bit and self._late(job, copy) and len(payload) == copy.length:
            counters["closed_late"] += 1
            self._complete(job, counters, copy)
            return self._results(j, slot, version, copy, ranks, offset)
        elif copy.bitmap & bit:
            counters["duplicates"] += 1
            return []
        elif len(payload) != copy.length:
            counters["drop_bad_length"] += 1
            return []
        else:
            copy.overflow |= add_saturating(copy.sums, payload)
            copy.exponent = max(copy.exponent, req.exponent)
            copy.bitmap |= bit
            copy.count += 1
            copy.data += int(not null)
        counters["contributions"] += 1
        if copy.count < needed:
            return []
        self._complete(job, counters, copy)
        return self._results(j, slot, version, copy, ranks, offset)

    def _admitted(self, port: int, header: Header, reth: Extension, req: Request,
                  length: int) -> bool:
        """Whether a contribution with `length` bytes of payload passes the checks that the
        slot's state takes no part in (`_refusal`, then the credit); what fails is counted."""
        refusal = self._refusal(header.src_ip, reth.dma_length, req, length, reth.rkey, port)
        if refusal is not None:
            scope = self.port_counters[port] if refusal in PORT_REFUSALS else \
                self.job_counters[req.job]
            scope[refusal] += 1
            return False
        job = self.job[req.job]
        if job.credits and signed(W.split_va(reth.va)[0] - job.completed, 32) >= job.credits:
            self.job_counters[req.job]["drop_credit"] += 1
            return False
        return True

    def _refusal(self, src_ip: int, dma_length: int, req: Request, length: int,
                 key: int, port: int | None = None) -> str | None:
        """The drop counter of a contribution of `length` bytes of payload and RETH.rkey
        `key`, in at `port` (None: any), that its length or the job table refuses (payload,
        job, worker, key, slot), or None: the checks that neither the slot's state nor the
        credit take part in. The first two count on the port, the others on the job
        (`PORT_REFUSALS`)."""
        if not (4 <= length <= self.max_payload and length % 4 == 0 and dma_length == length):
            return "drop_bad_payload"
        if req.job >= self.jobs or not self.job[req.job].enable:
            return "drop_bad_job"
        job = self.job[req.job]
        if req.rank >= job.workers or src_ip != job.table[req.rank].ip or \
                not self._by_entry_port(job, req.rank, port):
            return "drop_bad_worker"
        if key != job.key:
            return "drop_bad_key"
        if req.slot >= job.slot_count or job.slot_base + req.slot >= self.slots:
            return "drop_bad_slot"
        return None

    def _by_entry_port(self, job: Job, rank: int, port: int | None) -> bool:
        """Whether a contribution of `rank` in at `port` comes by the port its entry names
        where the job asks for it: a single switch takes a worker's from any port (its source
        IP names it); a spine's job takes a leaf's only from its entry's (`sim.golden_leaf`)."""
        return True

    def tick(self):
        """A tick of the deadlines' clock (`netagg.contract.regmap.TICK_SECONDS`), between two
        frames."""
        self.now = (self.now + 1) % (1 << R.DEADLINE_BITS)

    def _late(self, job: Job, copy: SlotCopy) -> bool:
        """Whether a use in progress is past its job's deadline (its age modulo the tick
        count's range)."""
        return job.deadline != 0 and (self.now - copy.begun) % (1 << R.DEADLINE_BITS) >= \
            job.deadline

    def _complete(self, job: Job, counters: dict, copy: SlotCopy):
        """A use of a slot copy is complete: counted, and the job's COMPLETED + 1."""
        copy.count = 0
        counters["completed"] += 1
        job.completed = (job.completed + 1) & 0xFFFFFFFF
        counters["overflows"] += int(copy.overflow)

    def _aggregation(self, job: Job, index: int, version: int, rank: int):
        """Where a contribution of `rank` to slot `index` goes: the slot copy it adds to, the
        contributions that complete a use of it, and the ranks its result goes to."""
        return self.state[index][version], job.needed, range(job.workers)

    def _clear(self, job: Job):
        """The slot state of the job's slot range, if it is enabled, and its COMPLETED, back
        to reset. Inside a control request the slots wait for its last record (`_control`)."""
        job.completed = 0
        if self._cleared is not None:
            if not any(j is job for j in self._cleared):
                self._cleared.append(job)
            return
        if not job.enable:
            return
        for s in range(job.slot_base, min(job.slot_base + job.slot_count, self.slots)):
            self.state[s] = [self.copy_type(), self.copy_type()]

    def _results(self, j: int, slot: int, version: int, copy: SlotCopy, ranks, offset: int,
                 va: int | None = None):
        """The result of a use of a slot copy, to each of `ranks` (RETH.va: the worker's base
        address + `offset`, or `va` when given: a spine's)."""
        job = self.job[j]
        imm = result_imm(j, copy.data, version, slot, copy.exponent, int(copy.overflow))
        sums, limit = copy.sums.astype("<i4").tobytes(), job.limit
        out = []
        for rank in ranks:
            w = job.table[rank]
            if w.port >= self.ports:
                continue                      # no such port: the result cannot leave
            at = w.va + offset if va is None else va
            template = self.result_template(w, len(sums))
            out.append((w.port, template.frame(limit, at, imm, sums)))
        self.job_counters[j]["results"] += len(out)
        return out

    def result_template(self, w: Worker, length: int) -> ResultTemplate:
        """The headers of results of `length` bytes to worker `w` (from the switch's MAC, IP
        and UDP port; to the worker's MAC, IP, UDP port, QPN and R_Key)."""
        key = (self.mac, self.ip, self.udp_sport, w.mac, w.ip, w.udp_port, w.qpn, w.rkey, length)
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) >= 4096:
                self._templates.clear()
            template = self._templates[key] = ResultTemplate(
                (self.mac, self.ip, self.udp_sport), (w.mac, w.ip, w.udp_port), w.qpn, w.rkey,
                length)
        return template

    # --- control ----------------------------------------------------------------------------

    def _control(self, port: int, frame: bytes, payload: bytes) -> list:
        if not 8 <= len(payload) <= 8 * W.MAX_CONTROL_RECORDS or len(payload) % 8:
            self.port_counters[port]["drop_bad_payload"] += 1
            return []
        self.port_counters[port]["control"] += 1
        pkt = W.parse_frame(frame[:W.IP_OFFSET + struct.unpack_from("!H", frame, 16)[0]])
        source = W.ip_to_int(pkt.src.ip)
        replies, self._cleared = [], []
        for addr, value in W.unpack_records(payload):
            if addr & R.WRITE:
                self.apply(addr & ~R.WRITE, value, source, port)
            replies.append((addr, self.read(addr & ~R.WRITE, port)))
        cleared, self._cleared = self._cleared, None
        for job in cleared:
            self._clear(job)
        reply = W.Packet(W.OP_CONTROL, W.CONTROL_QPN, pkt.psn, W.pack_records(replies),
                         src=pkt.dst, dst=pkt.src)
        return [(port, reply.frame())]

    def counters(self) -> dict:
        return {"ports": [dict(c) for c in self.port_counters],
                "jobs": [dict(c) for c in self.job_counters]}


def _droppable(request: tuple[Extension, Request] | None) -> bool:
    """A contribution the parser takes, marked droppable in its ImmDt."""
    return request is not None and bool(request[1].droppable)
