"""The protocol engine: one piece of code between tensors and any transport.

What it does, for one worker of one switch job (`job`, `rank`, `workers`):

- **Messages.** Every tensor submitted becomes messages, each one packet of `Work.lanes + 1`
  int32 lanes (the switch's largest payload, at most 1024 bytes, the same for every message
  of the job: every use of a slot has the same length, so a stray packet can never make a
  slot refuse the others as `drop_bad_length`).
  A fixed-point tensor starts with `D = ceil(slots / block)` exponent messages (the proposals
  for its first D blocks); each data chunk of block b carries the proposal for block b + D in
  its exponent field, and the switch's maximum comes back in the result just as block b + D
  needs it (SwitchML's piggybacking). int32 tensors are data chunks only.
- **Slots.** Messages are dealt round robin over the job's `slots` slots, in submission order,
  which is the same on every worker (collective semantics, as in torch.distributed). Each slot
  sends its messages one at a time: the next use of a slot, with the other version (shadow
  copy), starts only after the result of the current one. The window is the job's slot range.
- **Message sequence numbers (MSN, RETH.rkey).** Message i of the job (in dealing order)
  carries msn = i, i.e. use * slots + slot while no message was redone; a redone message
  takes the next number of its slot, msn = max(i, the slot's previous msn + 1). Every worker
  numbers the same, each slot's numbers grow (the switch drops a contribution whose msn is
  older than its slot copy's use: `drop_stale`), and a message never needs more than the
  uses the job has completed (msn <= completed uses of the messages before it + its own
  completed uses), so no message waits for credits that only later messages could free.
- **Credits.** The engine keeps the job's credit limit L (a running total: the job's
  CREDITS, then, from every result of the job, max(L, the result's BTH.psn unwrapped near
  L)) and starts a message only if msn < L (CREDITS 0: no limit). The switch drops anything
  beyond it (`drop_credit`); the engine never sends it.
- **Check lane.** The last lane of every packet holds `tag(slot, use)`, a hash of (session,
  job, slot, use of the slot), plus `1 << rank` when the job has at most 16 workers. A result
  of c contributions with data (its ImmDt count: a null adds zeros) holds `c * tag + bitmap`,
  where bitmap has c bits set: the ranks whose data the sums hold. A result holding another
  value is a late copy of an earlier result (ignored) or mixes a stray contribution (the
  round is redone). With more than 16 workers the lane holds `c * tag` and the contributors
  are not known.
- **Loss budget and priority** (`Work.loss_budget`, `Work.priority`). Per tensor, this worker
  marks droppable the floor(loss_budget * data chunks) data chunks of its own with the
  smallest L2 norm (of the values it contributes); exponent messages, int32 tensors and
  redone messages are never droppable. Priority class (DSCP = `wire.priority_dscp(class)`)
  with p the tensor's priority (0..7): droppable chunks get the classes below p, by norm:
  the i-th smallest of k droppable chunks has class (i * p) // k (0 when p is 0), so a
  switch's drop thresholds rising with the class drop the smallest first; non-droppable data
  chunks and redone messages have class p, exponent messages class 7 (every chunk of their
  block waits for them). A switch may turn a droppable contribution into a null (it counts,
  without data).
- **Results with fewer contributions** (nulls, or a quorum's early close). The check lane
  must hold c * tag (+ the bitmap of c ranks). The per-chunk allowance is
  A = ceil(loss_budget * workers) if loss_budget > 0 else 0 (the same for the tensor's
  exponent messages: a proposal missing from the maximum can only make a chunk saturate,
  which redoes it with a larger exponent). When
  the contributions with data so far number c_total < workers - A, or c_total == 0, the chunk
  is filled in, in the slot's next use (every worker decides the same, from the same
  result): the ranks whose data is missing send it, not droppable, and, when they are fewer
  than the contributions that close a use (the quorum, else all workers), the lowest ranks
  whose data is in send zeros to make up the quorum; the other ranks send nothing and wait
  for the result (after 4 RTOs they send zeros, which only asks for the result). The sums of
  the rounds add up, each rank's data once. Without the bitmap (more than 16 workers) the
  chunk is redone whole instead, which cannot help against a quorum, so then a quorum needs
  a loss budget that allows it. Then the sums of c_total < workers contributions are scaled
  by workers / c_total (the missing ones estimated by the mean of those present, as LTP
  does) before they are dequantised; a mean then divides by the world size as usual. With
  loss_budget 0 every chunk is exact, quorum or not. Per tensor: `Work.droppable_sent`,
  `lost_contributions` (workers - c_total, summed over its chunks), `rescaled_chunks`,
  `filled_chunks`; the engine's `stats` sum them.
- **Retransmission.** A message without its result after the retransmission timeout (adaptive,
  from measured round trips, doubling per retry) is sent again: the switch counts a duplicate,
  or, if the use is complete, sends the result again to this worker alone. Results for a
  slot's other version, earlier uses (by the check lane, or a credit limit not above the
  slot's last result's: a later use completes later) or unknown slots are ignored and counted.
- **Spraying.** With a transport of several paths (source UDP ports), each contribution,
  first sending or retransmission, leaves by the path the `Sprayer` picks (round robin, or the
  path with the fewest contributions awaiting their result). Every packet names its job, slot,
  version and offset, and slots are independent, so the order in which the switch sees them
  does not matter: reordering across paths costs neither correctness nor a retransmission.
  Control requests leave by path 0, where the answers come back.
- **Overflow.** A result with the overflow flag (or a worker's saturation marker in the check
  lane) is redone whole with the exponent plus one for fixed point, and is an
  `OverflowError` for int32 (so is an int32 sum filled in over rounds beyond int32).
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

WIRE_OVERHEAD = W.BTH_LEN + W.RETH_LEN + W.IMM_LEN + W.ICRC_LEN    # UDP payload beyond lanes
DEFAULT_PRIORITY = 4
EXPONENT_CLASS = W.PRIORITY_CLASSES - 1
# A rank that waits out a round asks for its result (zeros, in case its copy was lost) only
# after max(POKE_RTOS RTOs, rto_max): zeros that arrive while the round still waits for a
# slow rank's data close it without that data, and let the slot move on past that rank.
POKE_RTOS = 16
EARLY_USES = 32         # results kept for a slot's uses this worker has not begun yet
MEMBERSHIP_MAX_WORKERS = 16     # up to this, the check lane also carries the contributors


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
    lanes: int = N.LANES            # data lanes per packet (the check lane not included)
    proposals: np.ndarray | None = None      # this worker's proposal per block
    exponents: dict = dataclasses.field(default_factory=dict)   # block -> shared E
    remaining: int = 0
    error: BaseException | None = None
    done: bool = False
    lookahead: int = 1
    loss_budget: float = 0.0        # fraction of its data chunks a worker may have dropped
    priority: int = DEFAULT_PRIORITY
    droppable: dict = dataclasses.field(default_factory=dict)   # chunk -> priority class
    droppable_sent: int = 0
    lost_contributions: int = 0     # over its chunks: workers - contributions in the sum
    rescaled_chunks: int = 0
    filled_chunks: int = 0

    @property
    def chunks(self) -> int:
        return max(1, -(-self.n // self.lanes))

    def stats(self) -> dict:
        return {"values": self.n, "chunks": self.chunks, "droppable": len(self.droppable),
                "droppable_sent": self.droppable_sent,
                "lost_contributions": self.lost_contributions,
                "rescaled_chunks": self.rescaled_chunks, "filled_chunks": self.filled_chunks}


@dataclasses.dataclass
class Message:
    work: Work
    kind: str                       # "exp" or "data"
    index: int                      # block (exp) or chunk (data)
    seq: int = 0                    # dealing order in the job: the msn unless redone
    exponent: int | None = None     # scale of a data chunk once known (fixed point)
    bump: int = 0                   # overflow retries: exponent + bump
    slot: int = 0
    use: int = 0
    msn: int = 0
    droppable: bool = False
    pclass: int = DEFAULT_PRIORITY  # priority class
    send: str = "data"              # this round: "data", "zeros", or "none" (wait)
    acc: np.ndarray | None = None   # sums of the earlier rounds (fill-in)
    members: int = 0                # ranks whose data `acc` holds
    exp_max: int = N.EXP_NONE       # the largest exponent field of its results
    filled: bool = False            # filled in at least once
    packet: W.Packet | None = None
    sent_at: float = 0.0
    deadline: float = 0.0
    rto: float = 0.0
    attempts: int = 0
    path: int | None = None         # the path of the copy in flight (spraying)


class SlotState:
    __slots__ = ("queue", "inflight", "use", "recent", "last_tx", "last_msn", "last_psn",
                 "early")

    def __init__(self):
        self.queue = collections.deque()
        self.inflight: Message | None = None
        self.use = 0
        self.early = {}                 # use -> result that came before this worker began it
        self.last_msn = -1
        self.last_psn = -math.inf       # credit limit of the last result taken
        self.last_tx = [-math.inf, -math.inf]     # last transmission with each version
        self.recent = collections.deque(maxlen=4)   # tags of completed uses


def chunk_norms(work: Work) -> np.ndarray:
    """The L2 norm of each data chunk of the values this worker contributes."""
    total = np.zeros(work.n)
    for src in work.sources:
        total += N.to_float64(src, work.fmt)
    padded = np.zeros(work.chunks * work.lanes)
    padded[:work.n] = total
    return np.sqrt(np.square(padded.reshape(work.chunks, work.lanes)).sum(axis=1))


def plan_droppable(norms: np.ndarray, loss_budget: float, priority: int) -> dict:
    """Chunk -> priority class of the chunks this worker may have dropped: the
    floor(loss_budget * chunks) smallest by norm, the i-th smallest of k in class
    (i * priority) // k."""
    k = int(math.floor(loss_budget * len(norms) + 1e-9))
    if k <= 0:
        return {}
    order = np.argsort(norms, kind="stable")[:k]
    return {int(c): (i * priority) // k for i, c in enumerate(order)}


class Engine:
    def __init__(self, transport, *, job: int, rank: int, workers: int, slots: int | None,
                 qpn: int = 0x100, session_tag: int = 0, timeout: float = 20.0,
                 lanes: int = N.LANES,
                 fraction_bits: int | None = None, block: int = N.DEFAULT_BLOCK,
                 rto_initial: float = 0.2, rto_min: float = 0.05, rto_max: float = 1.0,
                 spray: str = "round_robin", stale_guard: float = 0.0, credits: int = 0,
                 quorum: int = 0):
        self.transport = transport
        # Optionally, a slot's version is used again only `stale_guard` seconds after its
        # last transmission. The switch now drops a contribution of an earlier use by its
        # MSN, so no wait is needed.
        self.stale_guard = stale_guard
        self.sprayer = T.Sprayer(getattr(transport, "paths", 1), spray)
        self.job, self.rank, self.workers, self.nslots = job, rank, workers, slots
        self.qpn, self.session_tag, self.timeout = qpn, session_tag, timeout
        self.lanes = lanes              # data lanes of every packet of the job
        self.fraction_bits, self.block = fraction_bits, block
        self.rto_min, self.rto_max = rto_min, rto_max
        self.srtt, self.rttvar, self.rto = None, 0.0, rto_initial
        self.slots, self.nslots, self.prejoin = [], 0, []
        self.next_slot = 0
        self.dealt = 0                  # messages dealt: the next message's sequence number
        self.psn = 0
        self.membership = workers <= MEMBERSHIP_MAX_WORKERS
        self.tag_bits = 30 - (workers - 1).bit_length() if self.membership else 22
        self.credits, self.quorum, self.limit = 0, 0, 0
        self.needed = workers
        self.joined = True              # False until rank 0 has configured the job
        self.join_check = None          # (records, accept): accept(values) -> None, or the
        #                                 set_job arguments once rank 0 configured the job
        self._join_pending = False
        self._join_next = 0.0
        self.control_pending = {}       # psn -> [packet, callback, deadline, rto, attempts]
        self.last_progress = time.monotonic()
        self.failed: BaseException | None = None
        self.pending_works = 0
        self.stats = collections.Counter()
        if slots is not None:
            self.set_job(slots, credits, quorum)

    def set_job(self, slots: int, credits: int = 0, quorum: int = 0, completed: int = 0):
        """The job's slot count, credits, quorum and completed uses (as the switch holds
        them); works submitted before they were known are dealt now."""
        if slots < 1:
            raise NetaggError(f"job {self.job} has no slots")
        self.slots = [SlotState() for _ in range(slots)]
        self.nslots = slots
        self.credits, self.quorum = credits, quorum
        self.needed = quorum if 0 < quorum < self.workers else self.workers
        self.limit = completed + credits        # also the reference to unwrap result PSNs
        prejoin, self.prejoin = self.prejoin, []
        for work in prejoin:
            self._deal(work)

    def allowance(self, loss_budget: float) -> int:
        """Contributions a data chunk may lose: ceil(loss_budget * workers), 0 for 0."""
        return math.ceil(loss_budget * self.workers - 1e-9) if loss_budget > 0 else 0

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
        if not self.membership and self.needed < self.workers \
                and self.workers - self.needed > self.allowance(work.loss_budget):
            work.error = ValueError(
                f"job {self.job} closes a use at {self.needed} of {self.workers} contributions"
                f"; with more than {MEMBERSHIP_MAX_WORKERS} workers the missing ones cannot be "
                f"filled in, so loss_budget must allow {self.workers - self.needed} of "
                f"{self.workers} (it allows {self.allowance(work.loss_budget)})")
            work.done = True
            self.pending_works -= 1
            return
        n_chunks = work.chunks
        if work.loss_budget > 0 and work.fmt.kind == "fixed":
            work.droppable = plan_droppable(chunk_norms(work), work.loss_budget,
                                            work.priority)
        msgs = []
        if work.fmt.kind == "fixed":
            blocks = -(-n_chunks // work.block)
            work.lookahead = max(1, -(-self.nslots // work.block))
            msgs += [Message(work, "exp", b, pclass=EXPONENT_CLASS)
                     for b in range(min(work.lookahead, blocks))]
        for c in range(n_chunks):
            cls = work.droppable.get(c)
            msgs.append(Message(work, "data", c, droppable=cls is not None,
                                pclass=work.priority if cls is None else cls))
        for m in msgs:
            m.slot = self.next_slot
            m.seq = self.dealt
            self.dealt += 1
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
        if self.stale_guard:
            times += [s.last_tx[s.use & 1] + self.stale_guard for s in self.slots
                      if s.inflight is None and s.queue]
        times += [c[2] for c in self.control_pending.values()]
        if not self.joined:
            times.append(self._join_next)
        return min(times) if times else now + 0.05

    # --- sending ------------------------------------------------------------------------

    def _tag(self, slot: int, use: int) -> int:
        h = zlib.crc32(struct.pack("<IIII", self.session_tag, self.job, slot, use))
        return h & ((1 << self.tag_bits) - 1)

    def _members(self, check: int, count: int, tag: int) -> int | None:
        """The bitmap of contributors a check lane shows for `count` contributions with data
        and `tag` (0 without membership), or None if it does not hold them."""
        rem = check - count * tag
        if not self.membership:
            return 0 if rem == 0 else None
        if 0 <= rem < (1 << self.workers) and rem.bit_count() == count:
            return rem
        return None

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
            if st.inflight is None and st.queue and self._ready(st.queue[0]):
                if self.stale_guard and now - st.last_tx[st.use & 1] < self.stale_guard:
                    continue
                msn = max(st.queue[0].seq, st.last_msn + 1)
                if self.credits and msn >= self.limit:
                    self.stats["credit_waits"] += 1
                    continue
                self._start(st, st.queue.popleft(), msn)

    def _start(self, st: SlotState, m: Message, msn: int):
        m.use = st.use
        st.use += 1
        m.msn = st.last_msn = msn
        w = m.work
        if m.kind == "data" and w.fmt.kind == "fixed":
            m.exponent = w.exponents[m.index // w.block] + m.bump
        st.inflight = m
        m.attempts = 0
        early = st.early.pop(m.use, None)
        for u in [u for u in st.early if u < m.use]:
            del st.early[u]
        if early is not None:
            # the use closed (a quorum) before this worker began it: what it would send now
            # could not count any more, and the result is here
            m.packet = None
            self.stats["early_results"] += 1
            self._take(st, m, *early)
            return
        if m.send == "none":
            # this round needs other ranks' data only: wait for the result (and after 4
            # RTOs send zeros, which only asks for it)
            m.packet = None
            m.deadline = time.monotonic() + max(POKE_RTOS * self.rto, self.rto_max)
            self.stats["waited_uses"] += 1
            return
        m.packet = self._packet(m)
        sent = sum(1 for s in self.slots if s.inflight is not None and s.inflight.packet)
        self.stats["max_inflight"] = max(self.stats["max_inflight"], sent)
        self._transmit(m)

    def _packet(self, m: Message) -> W.Packet:
        w = m.work
        lanes = np.zeros(w.lanes + 1, np.int64)
        exponent = N.EXP_NONE
        va = 0
        if m.kind == "data":
            lo = m.index * w.lanes
            hi = min(lo + w.lanes, w.n)
            va = lo * 4
        if m.send == "data":
            if m.kind == "exp":
                exponent = int(w.proposals[m.index])
            elif w.fmt.kind == "int":
                for src in w.sources:
                    lanes[:hi - lo] += src[lo:hi]
            else:
                for src in w.sources:
                    lanes[:hi - lo] += N.quantize(N.to_float64(src[lo:hi], w.fmt), m.exponent,
                                                  w.frac)
                nb = m.index // w.block + w.lookahead
                if m.index % w.block == 0 and nb < len(w.proposals):
                    exponent = int(w.proposals[nb])
        tag = self._tag(m.slot, m.use)
        if self.membership:
            tag += 1 << self.rank
        saturated = np.any(lanes[:-1] > N.INT32_MAX) or np.any(lanes[:-1] < N.INT32_MIN)
        np.clip(lanes, N.INT32_MIN, N.INT32_MAX, out=lanes)
        lanes[-1] = N.INT32_MAX if saturated else tag
        droppable = m.droppable and m.send == "data"
        return W.contribution(
            job=self.job, rank=self.rank, slot=m.slot, version=m.use & 1, offset=va,
            lanes=lanes.astype("<i4").tobytes(), psn=self._next_psn(),
            src=self.transport.local, dst=self.transport.switch, exponent=exponent,
            msn=m.msn, droppable=droppable, dscp=W.priority_dscp(m.pclass))

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
        if m.kind == "data" and m.droppable and m.send == "data":
            m.work.droppable_sent += 1
            self.stats["droppable_sent"] += 1
            self.stats[f"droppable_sent_class{m.pclass}"] += 1
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
                if m.packet is None:            # a round this rank waits out: ask
                    m.send = "zeros"
                    m.packet = self._packet(m)
                    self.stats["pokes"] += 1
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
        if pkt.rkey != self.session_tag:    # the R_Key the session wrote in the job table
            self.stats["foreign_results"] += 1
            return
        r = W.unpack_imm(W.RESULT_IMM, pkt.imm)
        if r["job"] != self.job or not self.nslots:
            self.stats["ignored"] += 1
            return
        limit = W.unwrap(pkt.psn, self.limit)
        self.limit = max(self.limit, limit)
        if r["slot"] >= self.nslots or len(pkt.payload) != 4 * (self.lanes + 1):
            self.stats["ignored"] += 1
            return
        st = self.slots[r["slot"]]
        m = st.inflight
        lanes = np.frombuffer(pkt.payload, "<i4")
        check, count = int(lanes[-1]), r["count"]
        overflow = bool(r["overflow"]) or check == N.INT32_MAX
        # a later use of a slot completes after the earlier ones, so its result's credit
        # limit is at least the last one's (equal: a replay made before anything completed)
        if limit < st.last_psn:
            self.stats["stale_results"] += 1
            return
        if m is not None and (m.use & 1) == r["version"] and (
                overflow or self._members(check, count, self._tag(m.slot, m.use)) is not None):
            self._take(st, m, r, lanes, limit)
            return
        # not this use's: a use this worker has not begun (others closed it with a quorum),
        # an earlier use's (a late copy), or a mix
        if not overflow and count > 0:
            for use in range(st.use, st.use + EARLY_USES):
                if use & 1 == r["version"] and use not in st.early and \
                        self._members(check, count, self._tag(r["slot"], use)) is not None:
                    st.early[use] = (r, lanes, limit)
                    self.stats["early_results_kept"] += 1
                    return
        if overflow or any(self._members(check, count, t) is not None for t in st.recent):
            self.stats["stale_results"] += 1
            return
        # neither: an earlier use's beyond those remembered, a later one beyond EARLY_USES,
        # or a sum that mixes a stray contribution (which the MSN check now prevents): taken
        # for none of them (the worker retransmits and gets its use's result again)
        self.stats["unrecognized_results"] += 1

    def _take(self, st: SlotState, m: Message, r: dict, lanes: np.ndarray, limit: int):
        """Apply the result of the message's use (its check lane verified)."""
        check, count = int(lanes[-1]), r["count"]
        overflow = bool(r["overflow"]) or check == N.INT32_MAX
        tag = self._tag(m.slot, m.use)
        members = None if overflow else self._members(check, count, tag)
        if m.attempts == 1:
            self._sample_rtt(time.monotonic() - m.sent_at)
        st.inflight = None
        st.last_psn = max(st.last_psn, limit)
        self._answered(m)
        st.recent.append(tag)
        w = m.work
        # progress: a round that adds data (a round of zeros only does not: a peer that
        # stopped must end in NetaggTimeout, not in fill rounds forever)
        if overflow or m.acc is None or (members or 0) & ~m.members:
            self.last_progress = time.monotonic()
        if r["exponent"] != N.EXP_NONE:
            m.exp_max = max(m.exp_max, int(r["exponent"]))
        if overflow and m.kind == "data":
            self.stats["overflows"] += 1
            if w.fmt.kind == "fixed" and m.bump < 64:
                self._redo(st, m, bump=m.bump + 1)
                return
            if w.error is None:
                w.error = OverflowError(
                    f"the int32 sum saturated in chunk {m.index} (values {m.index * w.lanes}.."
                    f"{min((m.index + 1) * w.lanes, w.n) - 1}): the exact sum does not fit")
            self._finish_chunk(w)
            return
        sums = lanes[:-1].astype(np.int64)
        if self.membership and m.acc is not None:
            m.acc += sums
            m.members |= members or 0
            have = m.members.bit_count()
        else:
            m.acc = sums
            m.members = members or 0
            have = m.members.bit_count() if self.membership else count
        allowance = self.allowance(w.loss_budget)
        if have == 0 or self.workers - have > allowance:
            if self.membership:
                self._fill(st, m)
                return
            if m.kind == "data":        # (`_deal` made sure that a quorum allows it)
                self._redo(st, m, bump=m.bump)
                return
            # an exponent short of a quorum's late proposals: a chunk that then saturates
            # is redone with a larger exponent
        if m.kind == "exp":
            w.exponents[m.index] = m.exp_max
            return
        if m.index % w.block == 0 and w.fmt.kind == "fixed":
            nb = m.index // w.block + w.lookahead
            if nb < len(w.proposals) and m.exp_max != N.EXP_NONE:
                w.exponents.setdefault(nb, m.exp_max)
        self._deliver(m, have)
        self._finish_chunk(w)

    def _finish_chunk(self, w: Work):
        w.remaining -= 1
        if w.remaining == 0:
            w.done = True
            self.pending_works -= 1

    def _next_round(self, st: SlotState, m: Message, **changes) -> Message:
        """The message again, in the slot's next use (every worker decides the same), never
        droppable."""
        st.inflight = None
        self._answered(m)
        nm = Message(m.work, m.kind, m.index, seq=m.seq, bump=m.bump, slot=m.slot,
                     pclass=m.work.priority if m.kind == "data" else m.pclass, send=m.send,
                     acc=m.acc, members=m.members, exp_max=m.exp_max, filled=m.filled)
        for k, v in changes.items():
            setattr(nm, k, v)
        st.queue.appendleft(nm)
        return nm

    def _redo(self, st: SlotState, m: Message, bump: int):
        """The message again, whole: every rank sends its data."""
        self.stats["redone"] += 1
        self._next_round(st, m, bump=bump, send="data", acc=None, members=0)

    def _fill(self, st: SlotState, m: Message):
        """Fill the chunk in: the ranks whose data is missing send it; if they are fewer than
        close a use, the lowest ranks whose data is in send zeros to make up the number."""
        missing = [r for r in range(self.workers) if not m.members >> r & 1]
        present = [r for r in range(self.workers) if m.members >> r & 1]
        senders = set(missing) | set(present[:max(0, self.needed - len(missing))])
        send = "data" if self.rank in missing else "zeros" if self.rank in senders else "none"
        self.stats["fill_rounds"] += 1
        if m.kind == "data" and not m.filled:
            m.work.filled_chunks += 1
            self.stats["filled_chunks"] += 1
        self._next_round(st, m, send=send, filled=True)

    def _deliver(self, m: Message, have: int):
        w = m.work
        lo = m.index * w.lanes
        hi = min(lo + w.lanes, w.n)
        part = m.acc[:hi - lo]
        lost = self.workers - have
        w.lost_contributions += lost
        self.stats["lost_contributions"] += lost
        self.stats["tensor_bytes"] += (hi - lo) * w.out.itemsize
        if w.fmt.kind == "int":
            if np.any(part > N.INT32_MAX) or np.any(part < N.INT32_MIN):
                if w.error is None:
                    w.error = OverflowError(
                        f"the int32 sum of chunk {m.index} (values {lo}..{hi - 1}) does not "
                        f"fit in int32")
                return
            w.out[lo:hi] = part
            return
        values = N.dequantize(part, m.exponent, w.frac)
        if lost:
            values = values * (self.workers / have)
            w.rescaled_chunks += 1
            self.stats["rescaled_chunks"] += 1
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
            job = accept([v for _, v in values])
            if job:
                self.joined = True
                self.last_progress = time.monotonic()
                self.set_job(**job)
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
                                (W.job_counter(self.job, "duplicates"), 0),
                                (W.job_counter(self.job, "drop_stale"), 0)], box.append)
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
        stale = ""
        if vals[2] and self.needed < self.workers:
            stale = (f"; {vals[2]} contributions were stale: with a quorum, a worker that "
                     f"lost a result after the others moved on cannot get it back")
        return (f"the switch answers (job {self.job}: {vals[0]} contributions, {vals[1]} "
                f"duplicates counted): a peer of this job stopped contributing{stale}")

    def counters(self) -> dict:
        return dict(self.stats)
