"""The protocol engine: one piece of code between tensors and any transport.

What it does, for one worker of one switch job (`job`, `rank`, `workers`):

- **Messages.** Every tensor submitted becomes messages, each one packet of
  `numerics.LANES + 1` int32 lanes (always 1024 bytes: every use of a slot has the same
  length, so a stray packet can never make a slot refuse the others as `drop_bad_length`).
  A fixed-point tensor starts with `D = ceil(slots / block)` exponent messages (the proposals
  for its first D blocks); each data chunk of block b carries the proposal for block b + D in
  its exponent field, and the switch's maximum comes back in the result just as block b + D
  needs it (SwitchML's piggybacking). int32 tensors are data chunks only.
- **Slots.** Messages are dealt round robin over the job's `slots` slots, in submission order,
  which is the same on every worker (collective semantics, as in torch.distributed). Each slot
  sends its messages one at a time: the next use of a slot, with the other version (shadow
  copy), starts only after the result of the current one. The window is the job's slot range.
- **Check lane.** The last lane of every packet holds `tag(slot, use)`, a 22-bit hash of
  (session, job, slot, use of the slot). A complete result holds `workers * tag` there. A
  result holding another value mixes a stray contribution from an earlier use (a duplicate the
  network delivered late), or is a late copy of an earlier result: the first is redone in the
  slot's next use, the second ignored. Sums are never silently wrong.
- **Retransmission.** A message without its result after the retransmission timeout (adaptive,
  from measured round trips, doubling per retry) is sent again: the switch counts a duplicate,
  or, if the result was lost, sends it again to this worker alone. Results for a slot's other
  version, earlier uses or unknown slots are ignored and counted.
- **Spraying.** With a transport of several paths (source UDP ports), each contribution,
  first sending or retransmission, leaves by the path the `Sprayer` picks (round robin, or the
  path with the fewest contributions awaiting their result). Every packet names its job, slot,
  version and offset, and slots are independent, so the order in which the switch sees them
  does not matter: reordering across paths costs neither correctness nor a retransmission.
  Control requests leave by path 0, where the answers come back.
- **Overflow.** A result with the overflow flag (or a worker's saturation marker in the check
  lane) is redone with the exponent plus one for fixed point, and is an `OverflowError` for
  int32.
- **Bounded waiting.** When no result and no control answer arrives for `timeout` seconds
  while work is pending, `step` raises `NetaggTimeout`, saying whether the switch still answers
  control requests (then a peer is missing) or not.

Cost: per worker, one packet of state per slot in flight, and per tensor one exponent per
block. `step` is non-blocking beyond its `timeout` argument.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import struct
import time
import zlib

import numpy as np

from host import numerics as N
from host import transport as T
from host import wire as W

PAYLOAD_LANES = N.LANES + 1
WIRE_OVERHEAD = W.BTH_LEN + W.RETH_LEN + W.IMM_LEN + W.ICRC_LEN    # UDP payload beyond lanes


class NetaggError(RuntimeError):
    """The allreduce cannot complete."""


class NetaggTimeout(NetaggError, TimeoutError):
    """The switch or a peer stopped answering."""


@dataclasses.dataclass
class Work:
    """One tensor (or shard) in flight: `sources` are the arrays whose sum this worker
    contributes (one for a flat allreduce, the node's local arrays for a hierarchical one)."""

    fmt: N.Format
    sources: list
    out: np.ndarray
    n: int
    world_size: int                 # workers whose values the sum holds (for F and mean)
    mean: bool = False
    frac: int = 0
    block: int = N.DEFAULT_BLOCK
    proposals: np.ndarray | None = None      # this worker's proposal per block
    exponents: dict = dataclasses.field(default_factory=dict)   # block -> shared E
    remaining: int = 0
    error: BaseException | None = None
    done: bool = False
    lookahead: int = 1

    @property
    def chunks(self) -> int:
        return max(1, -(-self.n // N.LANES))


@dataclasses.dataclass
class Message:
    work: Work
    kind: str                       # "exp" or "data"
    index: int                      # block (exp) or chunk (data)
    exponent: int | None = None     # scale of a data chunk once known (fixed point)
    bump: int = 0                   # overflow retries: exponent + bump
    slot: int = 0
    use: int = 0
    payload: bytes = b""
    packet: W.Packet | None = None
    sent_at: float = 0.0
    deadline: float = 0.0
    rto: float = 0.0
    attempts: int = 0
    path: int | None = None         # the path of the copy in flight (spraying)


class SlotState:
    __slots__ = ("queue", "inflight", "use", "recent", "last_tx")

    def __init__(self):
        self.queue = collections.deque()
        self.inflight: Message | None = None
        self.use = 0
        self.last_tx = [-math.inf, -math.inf]     # last transmission with each version
        self.recent = collections.deque(maxlen=4)   # tags of completed uses


class Engine:
    def __init__(self, transport, *, job: int, rank: int, workers: int, slots: int | None,
                 qpn: int = 0x100, session_tag: int = 0, timeout: float = 20.0,
                 fraction_bits: int | None = None, block: int = N.DEFAULT_BLOCK,
                 rto_initial: float = 0.2, rto_min: float = 0.05, rto_max: float = 1.0,
                 spray: str = "round_robin", stale_guard: float = 0.05):
        self.transport = transport
        # A slot's version is used again only `stale_guard` seconds after its last
        # transmission, so that a copy the network still holds cannot land in the next use
        # of that version (the shadow copy's one assumption).
        self.stale_guard = stale_guard
        self.sprayer = T.Sprayer(getattr(transport, "paths", 1), spray)
        self.job, self.rank, self.workers, self.nslots = job, rank, workers, slots
        self.qpn, self.session_tag, self.timeout = qpn, session_tag, timeout
        self.fraction_bits, self.block = fraction_bits, block
        self.rto_min, self.rto_max = rto_min, rto_max
        self.srtt, self.rttvar, self.rto = None, 0.0, rto_initial
        self.slots, self.nslots, self.prejoin = [], 0, []
        self.next_slot = 0
        self.psn = 0
        self.joined = True              # False until rank 0 has configured the job
        self.join_check = None          # (records, accept): accept(values) -> slots or None
        self._join_pending = False
        self._join_next = 0.0
        self.control_pending = {}       # psn -> [packet, callback, deadline, rto, attempts]
        self.last_progress = time.monotonic()
        self.failed: BaseException | None = None
        self.pending_works = 0
        self.stats = collections.Counter()
        if slots is not None:
            self.set_slots(slots)

    def set_slots(self, slots: int):
        """The job's slot count; works submitted before it is known are dealt now."""
        if slots < 1:
            raise NetaggError(f"job {self.job} has no slots")
        self.slots = [SlotState() for _ in range(slots)]
        self.nslots = slots
        for work in self.prejoin:
            self._deal(work)
        self.prejoin = []

    # --- submission ---------------------------------------------------------------------

    def submit(self, work: Work):
        if self.failed:
            raise self.failed
        n_chunks = work.chunks
        work.remaining = n_chunks
        if self.pending_works == 0:
            self.last_progress = time.monotonic()
        self.pending_works += 1
        if not self.nslots:
            self.prejoin.append(work)
        else:
            self._deal(work)

    def _deal(self, work: Work):
        n_chunks = work.chunks
        msgs = []
        if work.fmt.kind == "fixed":
            blocks = -(-n_chunks // work.block)
            work.lookahead = max(1, -(-self.nslots // work.block))
            msgs += [Message(work, "exp", b) for b in range(min(work.lookahead, blocks))]
        msgs += [Message(work, "data", c) for c in range(n_chunks)]
        for m in msgs:
            m.slot = self.next_slot
            self.slots[m.slot].queue.append(m)
            self.next_slot = (self.next_slot + 1) % self.nslots

    # --- one step -----------------------------------------------------------------------

    def busy(self) -> bool:
        return self.pending_works > 0 or bool(self.control_pending)

    def step(self, timeout: float = 0.0):
        """Receive, send what is ready, retransmit what is late; wait up to `timeout`."""
        if self.failed:
            raise self.failed
        try:
            self._send_ready()
            wait = min(timeout, max(0.0, self._next_deadline() - time.monotonic()))
            for pkt in self.transport.recv(wait):
                self._receive(pkt)
            self._send_ready()
            self._retransmit()
            self._check_progress()
        except NetaggError as e:
            self.failed = e
            raise

    def _next_deadline(self) -> float:
        now = time.monotonic()
        times = [s.inflight.deadline for s in self.slots if s.inflight]
        times += [s.last_tx[s.use & 1] + self.stale_guard for s in self.slots
                  if s.inflight is None and s.queue]
        times += [c[2] for c in self.control_pending.values()]
        if not self.joined:
            times.append(self._join_next)
        return min(times) if times else now + 0.05

    # --- sending ------------------------------------------------------------------------

    def _tag(self, slot: int, use: int) -> int:
        return zlib.crc32(struct.pack("<IIII", self.session_tag, self.job, slot, use)) & 0x3FFFFF

    def _ready(self, m: Message) -> bool:
        w = m.work
        if m.kind == "exp" or w.fmt.kind == "int":
            return True
        b = m.index // w.block
        return b in w.exponents

    def _send_ready(self):
        if not self.joined:
            self._poll_join()
            return
        now = time.monotonic()
        for st in self.slots:
            if st.inflight is None and st.queue and self._ready(st.queue[0]) \
                    and now - st.last_tx[st.use & 1] >= self.stale_guard:
                m = st.queue.popleft()
                self._start(st, m)

    def _start(self, st: SlotState, m: Message):
        m.use = st.use
        st.use += 1
        w = m.work
        lanes = np.zeros(PAYLOAD_LANES, np.int64)
        exponent = N.EXP_NONE
        if m.kind == "exp":
            exponent = int(w.proposals[m.index])
            va = 0
        else:
            lo = m.index * N.LANES
            hi = min(lo + N.LANES, w.n)
            va = lo * 4
            if w.fmt.kind == "int":
                for src in w.sources:
                    lanes[:hi - lo] += src[lo:hi]
            else:
                b = m.index // w.block
                m.exponent = w.exponents[b] + m.bump
                for src in w.sources:
                    lanes[:hi - lo] += N.quantize(N.to_float64(src[lo:hi], w.fmt), m.exponent,
                                                  w.frac)
                nb = b + w.lookahead
                if m.index % w.block == 0 and nb < len(w.proposals):
                    exponent = int(w.proposals[nb])
        tag = self._tag(m.slot, m.use)
        saturated = np.any(lanes[:-1] > N.INT32_MAX) or np.any(lanes[:-1] < N.INT32_MIN)
        np.clip(lanes, N.INT32_MIN, N.INT32_MAX, out=lanes)
        lanes[-1] = N.INT32_MAX if saturated else tag
        pkt = W.contribution(
            job=self.job, rank=self.rank, slot=m.slot, version=m.use & 1, offset=va,
            lanes=lanes.astype("<i4").tobytes(), psn=self._next_psn(),
            src=self.transport.local, dst=self.transport.switch, exponent=exponent)
        m.packet = pkt
        m.attempts = 0
        st.inflight = m
        self._transmit(m)

    def _next_psn(self) -> int:
        self.psn = (self.psn + 1) & 0xFFFFFF
        return self.psn

    def _transmit(self, m: Message):
        now = time.monotonic()
        if m.attempts:
            self.stats["retransmissions"] += 1
            m.rto = min(self.rto_max, m.rto * 2)
        else:
            m.sent_at = now
            m.rto = self.rto
        m.attempts += 1
        m.deadline = now + m.rto
        self.slots[m.slot].last_tx[m.use & 1] = now
        self.stats["packets_sent"] += 1
        self.stats["bytes_sent"] += len(m.packet.payload) + WIRE_OVERHEAD
        sp = self.sprayer
        if sp.paths == 1:
            self.transport.send(m.packet)
            return
        self._answered(m)
        m.path = sp.pick()
        sp.sent(m.path)
        self.stats[f"packets_sent_path{m.path}"] += 1
        self.transport.send(m.packet, m.path)

    def _answered(self, m: Message):
        if m.path is not None:
            self.sprayer.answered(m.path)
            m.path = None

    def _retransmit(self):
        now = time.monotonic()
        for st in self.slots:
            m = st.inflight
            if m is not None and m.deadline <= now:
                self._transmit(m)
        for c in list(self.control_pending.values()):
            if c[2] <= now:
                c[3] = min(self.rto_max, c[3] * 2)
                c[2] = now + c[3]
                self.stats["control_retransmissions"] += 1
                self.transport.send(c[0])

    # --- receiving ----------------------------------------------------------------------

    def _receive(self, pkt: W.Packet):
        self.stats["packets_received"] += 1
        self.stats["bytes_received"] += len(pkt.payload) + WIRE_OVERHEAD
        if pkt.opcode == W.OP_CONTROL and pkt.dqpn == W.CONTROL_QPN:
            c = self.control_pending.pop(pkt.psn, None)
            if c is None:
                self.stats["ignored_control"] += 1
                return
            try:
                records = W.unpack_records(pkt.payload)
            except ValueError:
                records = []
            c[1](records)
            return
        if pkt.opcode != W.OP_RESULT or pkt.imm is None or pkt.dqpn != self.qpn:
            self.stats["ignored"] += 1
            return
        r = W.unpack_imm(W.RESULT_IMM, pkt.imm)
        if r["job"] != self.job or r["slot"] >= self.nslots \
                or len(pkt.payload) != 4 * PAYLOAD_LANES:
            self.stats["ignored"] += 1
            return
        st = self.slots[r["slot"]]
        m = st.inflight
        if m is None or (m.use & 1) != r["version"]:
            self.stats["stale_results"] += 1
            return
        lanes = np.frombuffer(pkt.payload, "<i4")
        check = int(lanes[-1])
        expected = self.workers * self._tag(m.slot, m.use)
        overflow = bool(r["overflow"]) or check == N.INT32_MAX
        if check != expected and not overflow:
            if check in st.recent:
                self.stats["stale_results"] += 1
            else:
                self.stats["mixed_results"] += 1
                self._redo(st, m, bump=m.bump)
            return
        if m.attempts == 1:
            self._sample_rtt(time.monotonic() - m.sent_at)
        self.last_progress = time.monotonic()
        st.inflight = None
        self._answered(m)
        st.recent.append(expected)
        w = m.work
        if m.kind == "exp":
            w.exponents[m.index] = int(r["exponent"])
            return
        if m.index % w.block == 0 and w.fmt.kind == "fixed":
            nb = m.index // w.block + w.lookahead
            if nb < len(w.proposals) and r["exponent"] != N.EXP_NONE:
                w.exponents.setdefault(nb, int(r["exponent"]))
        if overflow:
            self.stats["overflows"] += 1
            if w.fmt.kind == "fixed" and m.bump < 64:
                self._redo(st, m, bump=m.bump + 1)
                return
            if w.error is None:
                w.error = OverflowError(
                    f"the int32 sum saturated in chunk {m.index} (values {m.index * N.LANES}.."
                    f"{min((m.index + 1) * N.LANES, w.n) - 1}): the exact sum does not fit")
        else:
            self._deliver(m, lanes[:-1])
        w.remaining -= 1
        if w.remaining == 0:
            w.done = True
            self.pending_works -= 1

    def _redo(self, st: SlotState, m: Message, bump: int):
        """The message again, in the slot's next use (every worker decides the same)."""
        st.inflight = None
        self._answered(m)
        self.stats["redone"] += 1
        st.queue.appendleft(Message(m.work, m.kind, m.index, bump=bump, slot=m.slot))

    def _deliver(self, m: Message, sums: np.ndarray):
        w = m.work
        lo = m.index * N.LANES
        hi = min(lo + N.LANES, w.n)
        part = sums[:hi - lo]
        self.stats["tensor_bytes"] += (hi - lo) * w.out.itemsize
        if w.fmt.kind == "int":
            w.out[lo:hi] = part
            return
        values = N.dequantize(part, m.exponent, w.frac)
        if w.mean:
            values = values / w.world_size
        w.out[lo:hi] = N.from_float64(values, w.fmt, w.out)

    def _sample_rtt(self, rtt: float):
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.rto = min(self.rto_max, max(self.rto_min, self.srtt + 4 * self.rttvar))

    # --- control ------------------------------------------------------------------------

    def control_async(self, records, callback):
        """Send a control request; `callback(records)` gets the switch's answer."""
        records = list(records)
        for i in range(0, len(records), W.MAX_CONTROL_RECORDS):
            part = records[i:i + W.MAX_CONTROL_RECORDS]
            psn = self._next_psn()
            pkt = W.control_request(part, psn, self.transport.local, self.transport.switch)
            rto = max(self.rto, 0.05)
            cb = callback if i + W.MAX_CONTROL_RECORDS >= len(records) else (lambda r: None)
            self.control_pending[psn] = [pkt, cb, time.monotonic() + rto, rto, 1]
            self.transport.send(pkt)

    def control(self, records, timeout: float | None = None) -> list[tuple[int, int]]:
        """Send control records and wait for the answer: (address, value after) pairs."""
        records = list(records)
        answers = []
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        for i in range(0, len(records), W.MAX_CONTROL_RECORDS):
            box = []
            self.control_async(records[i:i + W.MAX_CONTROL_RECORDS], box.append)
            while not box:
                if time.monotonic() > deadline:
                    for k in [k for k, c in self.control_pending.items() if c[1] == box.append]:
                        del self.control_pending[k]
                    raise NetaggTimeout(
                        f"the switch at {self.transport.switch.ip} (via "
                        f"{getattr(self.transport, 'url', 'in-process')}) did not answer a "
                        f"control request within {limit:.1f} s")
                self._wait_a_little(0.01)
            answers += box[0]
        return answers

    def _wait_a_little(self, timeout):
        driver = self.transport.driver
        if driver is not None:
            driver.drive()
            if self not in driver.engines:
                self.step(0.0)
            time.sleep(0)
        else:
            self.step(timeout)

    def _poll_join(self):
        now = time.monotonic()
        if self._join_pending or now < self._join_next or not self.pending_works:
            return
        records, accept = self.join_check
        self._join_pending = True

        def answer(values):
            self._join_pending = False
            self._join_next = time.monotonic() + 0.01
            slots = accept([v for _, v in values])
            if slots:
                self.joined = True
                self.last_progress = time.monotonic()
                self.set_slots(slots)
        self.control_async(records, answer)

    def _check_progress(self):
        if self.pending_works == 0:
            return
        idle = time.monotonic() - self.last_progress
        if idle < self.timeout:
            return
        if not self.joined:
            raise NetaggTimeout(
                f"job {self.job} was not configured for this run by its rank 0 within "
                f"{self.timeout:.1f} s (rank {self.rank} of {self.workers} waits for it)")
        stuck = [s.inflight for s in self.slots if s.inflight]
        what = (f"slot {stuck[0].slot} (use {stuck[0].use}) sent {stuck[0].attempts} times"
                if stuck else "no slot in flight")
        raise NetaggTimeout(
            f"no answer for {idle:.1f} s (timeout {self.timeout:.1f} s) in job {self.job} "
            f"(rank {self.rank} of {self.workers}): {what}; "
            f"{self._diagnose()}")

    def _diagnose(self) -> str:
        """Whether the switch still answers a control read (then a peer is missing)."""
        box = []
        try:
            self.failed = None
            saved, self.timeout = self.timeout, math.inf
            self.control_async([(W.job_counter(self.job, "contributions"), 0),
                                (W.job_counter(self.job, "duplicates"), 0)], box.append)
            deadline = time.monotonic() + 0.5
            while not box and time.monotonic() < deadline:
                for pkt in self.transport.recv(0.02):
                    if pkt.opcode == W.OP_CONTROL:
                        c = self.control_pending.pop(pkt.psn, None)
                        if c is not None:
                            c[1](W.unpack_records(pkt.payload))
        except Exception:
            pass
        finally:
            self.timeout = saved
            self.control_pending.clear()
        if not box:
            return "the switch does not answer control requests either: the switch (or the " \
                   "path to it) is down"
        vals = [v for _, v in box[0]]
        return (f"the switch answers (job {self.job}: {vals[0]} contributions, {vals[1]} "
                f"duplicates counted): a peer of this job stopped contributing")

    def counters(self) -> dict:
        return dict(self.stats)
