"""Messages: how a tensor becomes packets, and how they are dealt over the job's slots.

- **Messages.** Every tensor submitted (a `Work`) becomes messages, each one packet of
  `Work.lanes + 1` int32 lanes (the switch's largest payload, at most 1024 bytes, the same
  for every message of the job: every use of a slot has the same length, so a stray packet
  can never make a slot refuse the others as `drop_bad_length`). A fixed-point tensor starts
  with `D = ceil(slots / block)` exponent messages (the proposals for its first D blocks);
  each data chunk of block b carries the proposal for block b + D in its exponent field, and
  the switch's maximum comes back in the result just as block b + D needs it (SwitchML's
  piggybacking). int32 tensors are data chunks only.
- **Slots.** Messages are dealt round robin over the job's `slots` slots, in submission
  order, which is the same on every worker (collective semantics, as in torch.distributed).
  Each slot sends its messages one at a time: the next use of a slot, with the other version
  (shadow copy), starts only after the result of the current one. The window is the job's
  slot range.
- **Message sequence numbers (MSN, RETH.va's top half).** Message i of the job (in dealing order)
  carries msn = i, i.e. use * slots + slot while no message was redone; a redone message
  takes the next number of its slot, msn = max(i, the slot's previous msn + 1). Every worker
  numbers the same, each slot's numbers grow (the switch drops a contribution whose msn is
  older than its slot copy's use: `drop_stale`), and a message never needs more than the
  uses the job has completed (msn <= completed uses of the messages before it + its own
  completed uses), so no message waits for credits that only later messages could free.
- **Loss budget and priority** (`Work.loss_budget`, `Work.priority`). Per tensor, this
  worker marks droppable the floor(loss_budget * data chunks) data chunks of its own with
  the smallest L2 norm (of the values it contributes); exponent messages, int32 tensors and
  redone messages are never droppable. Priority class (DSCP = `wire.priority_dscp(class)`)
  with p the tensor's priority (0..7): droppable chunks get the classes below p, by norm: the
  i-th smallest of k droppable chunks has class (i * p) // k (0 when p is 0), so a switch's
  drop thresholds rising with the class drop the smallest first; non-droppable data chunks
  and redone messages have class p, exponent messages class 7 (every chunk of their block
  waits for them). A switch may turn a droppable contribution into a null (it counts,
  without data). A droppable contribution is never sent again: its data is given up, and
  zeros go in its place (`Send.GIVEN_UP`: its check lane sealed and its exponent proposal
  carried as the data's), in class 7 (`GIVE_UP_CLASS`), not droppable. So a use whose
  droppable data a congested queue dropped or holds completes at once, every worker counted,
  the chunk's sum without this worker's values (taken as zero, as a dropped gradient is),
  rather than waiting for the data to get through. If the data arrives first the zeros are
  a duplicate and the sum is whole.

- **Non-finite blocks** (`host.nonfinite`): a chunk of a block whose shared exponent is
  `EXP_NONFINITE` goes in two rounds (`Message.phase`): the kinds of its elements, then
  its finite values; never droppable.

Cost: per worker, one message of state per chunk and per exponent message, and per tensor
one exponent per block.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math

import numpy as np

from netagg.contract import regmap as R
from netagg.host import nonfinite as NF
from netagg.host import numerics as N
from netagg.host.nonfinite import Phase
from netagg.host.retransmit import RetransmitTimer

DEFAULT_PRIORITY = 4
EXPONENT_CLASS = R.PRIORITY_CLASSES - 1
GIVE_UP_CLASS = R.PRIORITY_CLASSES - 1     # a droppable contribution sent again


class MessageKind(enum.Enum):
    EXPONENT = "exp"        # a block's exponent proposal, no data
    DATA = "data"           # a chunk of `Work.lanes` values


class Send(enum.Enum):
    """What a worker contributes to a round of a message."""

    DATA = "data"           # its values
    ZEROS = "zeros"         # zeros: counts towards the quorum, or asks for the result
    GIVEN_UP = "given_up"   # zeros in place of its droppable data, with its exponent proposal
    NOTHING = "none"        # nothing: it waits for the result


@dataclasses.dataclass
class Work:
    """One tensor (or shard) in flight: `sources` are the arrays whose sum this worker
    contributes (one for a flat allreduce, the node's local arrays for a hierarchical one)."""

    fmt: N.Format
    sources: list[np.ndarray]
    out: np.ndarray
    n: int
    world_size: int                 # workers whose values the sum holds (for F and mean)
    mean: bool = False
    frac: int = 0
    block: int = N.DEFAULT_BLOCK
    lanes: int = N.LANES            # data lanes per packet (the check lane not included)
    proposals: np.ndarray | None = None      # this worker's proposal per block
    exponents: dict[int, int] = dataclasses.field(default_factory=dict)   # block -> shared E
    remaining: int = 0
    error: BaseException | None = None
    done: bool = False
    lookahead: int = 1
    loss_budget: float = 0.0        # fraction of its data chunks a worker may have dropped
    priority: int = DEFAULT_PRIORITY
    droppable: dict[int, int] = dataclasses.field(default_factory=dict)  # chunk -> class
    droppable_sent: int = 0
    lost_contributions: int = 0     # over its chunks: workers - contributions in the sum
    rescaled_chunks: int = 0
    filled_chunks: int = 0
    quantised: np.ndarray | None = None     # (chunks, lanes + 1) int32, by `lanes_of`
    saturated: np.ndarray | None = None     # per chunk: its lanes saturated
    blocks_done: set[int] | None = None     # blocks quantised into `quantised`

    @property
    def chunks(self) -> int:
        return max(1, -(-self.n // self.lanes))

    def values(self, chunk: int) -> slice:
        """The values of a data chunk."""
        lo = chunk * self.lanes
        return slice(lo, min(lo + self.lanes, self.n))

    def lanes_of(self, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This worker's lanes of data chunks at their block's shared exponent (fixed point)
        or as they are (int32): int32 rows, the check lane last (0 until sealed), and per
        row whether a sum over the sources saturated it. A block is quantised once, all its
        chunks at once, the first time one of them is asked for; the tensor's lanes are
        kept while it is in flight."""
        if self.quantised is None:
            self.quantised = np.zeros((self.chunks, self.lanes + 1), np.int32)
            self.saturated = np.zeros(self.chunks, bool)
            self.blocks_done = set()
        for b in set((chunks // self.block).tolist()) - self.blocks_done:
            c0, c1 = b * self.block, min((b + 1) * self.block, self.chunks)
            _, self.saturated[c0:c1] = self._quantize(c0, c1, self.exponents.get(b),
                                                      self.quantised[c0:c1])
            self.blocks_done.add(b)
        return self.quantised[chunks], self.saturated[chunks]

    def chunk_lanes(self, chunk: int, exponent: int | None) -> tuple[np.ndarray, bool]:
        """One data chunk's lanes (as `lanes_of`) at `exponent`: its block's shared one, or
        another (a chunk redone after an overflow, quantised alone)."""
        if self.fmt.kind == "fixed" and exponent != self.exponents[chunk // self.block]:
            rows, saturated = self._quantize(chunk, chunk + 1, exponent)
        else:
            rows, saturated = self.lanes_of(np.array([chunk]))
        return rows[0], bool(saturated[0])

    def _quantize(self, c0: int, c1: int, exponent: int, rows: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
        """Chunks c0..c1-1 as int32 rows of lanes + 1 (the check lane 0; written into
        `rows`, zeros, if given), and per row whether a sum over the sources saturated (then
        its lanes are clipped). Fixed point: each source's values times 2**(frac - exponent)
        (exact: a power of two), rounded to the nearest integer (`numerics.quantize`'s),
        summed exactly in float64."""
        k, lanes = c1 - c0, self.lanes
        lo, hi = c0 * lanes, min(c1 * lanes, self.n)
        fixed = self.fmt.kind == "fixed"
        blocks = slice(c0 // self.block, (c1 - 1) // self.block + 1)
        clean = fixed and self.proposals is not None \
            and bool((self.proposals[blocks] == N.EXP_NONFINITE).any())
        if len(self.sources) == 1 and hi - lo == k * lanes:
            acc = self._scaled(self.sources[0][lo:hi], exponent, clean) if fixed \
                else self.sources[0][lo:hi]
        else:
            acc = np.zeros(k * lanes, np.float64 if fixed else np.int64)
            for src in self.sources:
                acc[:hi - lo] += self._scaled(src[lo:hi], exponent, clean) if fixed \
                    else src[lo:hi]
        acc = acc.reshape(k, lanes)
        if rows is None:
            rows = np.zeros((k, lanes + 1), np.int32)
        if acc.dtype == np.int32 or float(acc.max(initial=0)) <= N.INT32_MAX \
                and float(acc.min(initial=0)) >= N.INT32_MIN:
            rows[:, :-1] = acc
            return rows, np.zeros(k, bool)
        acc = acc.astype(np.float64) if fixed else acc
        saturated = (acc.max(axis=1) > N.INT32_MAX) | (acc.min(axis=1) < N.INT32_MIN)
        rows[:, :-1] = np.clip(acc, N.INT32_MIN, N.INT32_MAX)
        return rows, saturated

    def _scaled(self, values: np.ndarray, exponent: int, clean: bool = False) -> np.ndarray:
        """round(values * 2**(frac - exponent)), exact integers: in float32 for float32
        values (a power of two in float32's range scales them exactly, and a product too
        small for a normal float32 rounds to 0 either way), else in float64. `clean`: NaN
        and infinities become 0 (a block that holds them, `host.nonfinite`)."""
        shift = self.frac - exponent
        if values.dtype == np.float32 and -126 <= shift <= 127:
            v = np.multiply(values, np.float32(2.0 ** shift))
        else:
            v = N.to_float64(values, self.fmt)
            v *= 2.0 ** shift
        np.rint(v, out=v)
        if clean:
            v[~NF.finite_mask(values, self.fmt)] = 0
        return v

    def stats(self) -> dict:
        return {"values": self.n, "chunks": self.chunks, "droppable": len(self.droppable),
                "droppable_sent": self.droppable_sent,
                "lost_contributions": self.lost_contributions,
                "rescaled_chunks": self.rescaled_chunks, "filled_chunks": self.filled_chunks}


@dataclasses.dataclass(slots=True)
class Message:
    """An exponent message (a block's proposal) or a data chunk of a tensor, through the
    rounds of its slot's uses: the round's numbers (slot, use, msn), what this worker sends
    in it, the sums of the earlier rounds, and the packet in flight with its timer."""

    work: Work
    kind: MessageKind
    index: int                      # block (exponent) or chunk (data)
    seq: int = 0                    # dealing order in the job: the msn unless redone
    needs: int = -1                 # the block whose shared exponent it waits for (fixed
    #                                 point data), -1 for none
    carries: int = -1               # the block whose proposal it carries (the first chunk of
    #                                 block b: b + lookahead, if there is one), -1 for none
    exponent: int | None = None     # scale of a data chunk once known (fixed point)
    bump: int = 0                   # overflow retries: exponent + bump
    phase: Phase = Phase.VALUES     # which round of its chunk (`host.nonfinite`)
    finite: int = 0                 # the agreed exponent of its finite values (FINITE)
    kinds: np.ndarray | None = None     # the KINDS round's sums: the kinds per element
    slot: int = 0
    use: int = 0
    msn: int = 0
    droppable: bool = False
    pclass: int = DEFAULT_PRIORITY  # priority class
    send: Send = Send.DATA          # this round's contribution
    acc: np.ndarray | None = None   # sums of the earlier rounds (fill-in)
    members: int = 0                # ranks whose data `acc` holds
    exp_max: int = N.EXP_NONE       # the largest exponent field of its results
    filled: bool = False            # filled in at least once
    tag: int = 0                    # the check lane's tag of its use (`CheckLane.tag`)
    expect: tuple[int, int] | None = None   # (version, check lane) of a result that holds
    #                                         every worker's data (first rounds only)
    packet: bytes | None = None     # the datagram in flight (None: none yet, or waiting)
    timer: RetransmitTimer | None = None     # from the start of its round
    path: int | None = None         # the path of the copy in flight (spraying)

    def again(self, **changes) -> Message:
        """The message for another round of its chunk (or block), never droppable."""
        nm = Message(self.work, self.kind, self.index, seq=self.seq, needs=self.needs,
                     carries=self.carries, bump=self.bump, phase=self.phase,
                     finite=self.finite, kinds=self.kinds,
                     slot=self.slot,
                     pclass=self.work.priority if self.kind is MessageKind.DATA else self.pclass,
                     send=self.send, acc=self.acc, members=self.members, exp_max=self.exp_max,
                     filled=self.filled)
        return dataclasses.replace(nm, **changes)

    @property
    def block(self) -> int:
        """The exponent block of a data chunk."""
        return self.index // self.work.block

    @property
    def sends_droppable(self) -> bool:
        return self.droppable and self.send is Send.DATA

    def ready(self) -> bool:
        """Whether it can be sent: a fixed-point chunk needs its block's shared exponent."""
        return self.needs < 0 or self.needs in self.work.exponents

    @property
    def plain(self) -> bool:
        """Whether this round sends the chunk's data at its block's shared exponent (the
        common case, whose lanes `Work.lanes_of` gives for many chunks at once)."""
        return self.kind is MessageKind.DATA and self.send is Send.DATA and self.bump == 0 \
            and self.phase is Phase.VALUES

    def fields(self) -> tuple[int, int]:
        """This round's ImmDt exponent field and RETH offset: a data chunk carries the
        proposal of the block it `carries`, an exponent message its block's proposal."""
        w = self.work
        if self.kind is MessageKind.EXPONENT:
            return (int(w.proposals[self.index]) if self.send is Send.DATA else N.EXP_NONE), 0
        exponent = N.EXP_NONE
        if self.send is Send.DATA and self.phase is Phase.KINDS:
            exponent = NF.chunk_proposal(w, self.index)
        elif self.send in (Send.DATA, Send.GIVEN_UP) and self.carries >= 0:
            exponent = int(w.proposals[self.carries])
        return exponent, w.lanes * 4 * self.index

    def payload(self) -> tuple[np.ndarray, bool]:
        """This round's lanes (int32, the check lane last: the caller seals it) and whether
        they saturated."""
        if self.send is not Send.DATA or self.kind is MessageKind.EXPONENT:
            return np.zeros(self.work.lanes + 1, np.int32), False
        if self.phase is Phase.KINDS:
            return NF.chunk_kinds(self.work, self.index), False
        return self.work.chunk_lanes(self.index, self.exponent)


@dataclasses.dataclass(slots=True)
class Result:
    """A result packet of a slot's use: the sums and the check lane (`lanes`), the
    contributions with data (`count`, ImmDt), the largest exponent field, whether it
    saturated (the overflow flag or a worker's marker in the check lane), and the job's
    credit limit it carries (BTH.psn, unwrapped)."""

    slot: int
    version: int
    count: int
    exponent: int
    overflow: bool
    lanes: np.ndarray
    limit: int
    check: int                      # the check lane
    members: int | None = None      # the ranks its sums hold, once the check lane showed it

    @property
    def sums(self) -> np.ndarray:
        return self.lanes[:-1]


RECENT_USES = 4         # a slot's completed uses whose results' copies are known stale


class SlotState:
    """One slot of the job as this worker sees it: the messages dealt to it, the one in
    flight, and what it knows of the slot's uses."""

    __slots__ = ("queue", "inflight", "use", "recent", "last_msn", "last_psn", "early")

    def __init__(self):
        self.queue: collections.deque[Message] = collections.deque()
        self.inflight: Message | None = None
        self.use = 0
        self.early: dict[int, Result] = {}      # use -> result before this worker began it
        self.last_msn = -1
        self.last_psn = -math.inf       # credit limit of the last result taken
        self.recent = collections.deque(maxlen=RECENT_USES)     # tags of completed uses

    def next_msn(self) -> int:
        """The msn of the next message: its dealing order, unless an earlier one was
        redone."""
        return max(self.queue[0].seq, self.last_msn + 1)

    def begin(self, m: Message, msn: int):
        """`m` is the slot's next use, numbered `msn`."""
        m.use = self.use
        m.timer = RetransmitTimer()
        self.use += 1
        m.msn = self.last_msn = msn
        self.inflight = m

    def take_early(self, use: int) -> Result | None:
        """The result kept for `use` if others closed it before this worker began it
        (forgetting those of earlier uses)."""
        early = self.early.pop(use, None)
        for u in [u for u in self.early if u < use]:
            del self.early[u]
        return early


class Dealer:
    """Deals messages round robin over the slots, numbering them in dealing order."""

    def __init__(self):
        self.next_slot = 0
        self.dealt = 0                  # messages dealt: the next message's sequence number

    def deal(self, msgs: list[Message], slots: list[SlotState]):
        for m in msgs:
            m.slot = self.next_slot
            m.seq = self.dealt
            self.dealt += 1
            slots[m.slot].queue.append(m)
            self.next_slot = (self.next_slot + 1) % len(slots)


def deliver(work: Work, chunks: list[tuple[Message, int]], workers: int) -> dict:
    """Write the sums of completed data chunks into the tensor (`deliver_rows`): (message,
    contributions with data in its sums) pairs, the sums in `Message.acc`."""
    fixed = work.fmt.kind == "fixed"
    kinds = None
    if any(m.kinds is not None for m, _ in chunks):
        kinds = np.stack([np.zeros(work.lanes, np.int64) if m.kinds is None else m.kinds
                          for m, _ in chunks])
    return deliver_rows(work, np.array([m.index for m, _ in chunks]),
                        np.stack([m.acc for m, _ in chunks]),
                        np.array([m.exponent for m, _ in chunks]) if fixed else None,
                        [h for _, h in chunks], workers, kinds)


def deliver_rows(work: Work, index: np.ndarray, sums: np.ndarray, exponent: np.ndarray | None,
                 have: list[int], workers: int, kinds: np.ndarray | None = None) -> dict:
    """Write the sums of completed data chunks into the tensor, all at once: chunk `index`
    holds `sums` (int rows) of `have` contributions with data. Fixed point: dequantised at
    each chunk's `exponent`, scaled by workers / contributions where some are missing,
    divided by the world size for a mean, set to NaN or an infinity where `kinds` (the
    KINDS rounds' sums, if any) show one, rounded to the tensor's dtype; int32: as they
    are, or `OverflowError` on the tensor where a sum over rounds left int32. The counters
    it adds to the engine's."""
    w, lanes = work, work.lanes
    counts = {}
    lost = np.zeros(len(index), np.int64) if min(have) == workers \
        else workers - np.array(have)
    if lost.any():
        w.lost_contributions += int(lost.sum())
        counts["lost_contributions"] = int(lost.sum())
    if w.fmt.kind == "int":
        bad = (sums > N.INT32_MAX).any(axis=1) | (sums < N.INT32_MIN).any(axis=1)
        if bad.any():
            c = int(index[bad][0])
            part = w.values(c)
            if w.error is None:
                w.error = OverflowError(f"the int32 sum of chunk {c} (values {part.start}.."
                                        f"{part.stop - 1}) does not fit in int32")
            index, sums = index[~bad], sums[~bad]
        values = sums
    elif not lost.any() and not w.mean and kinds is None and w.fmt is not N.BFLOAT16 \
            and w.out.dtype in (np.float32, np.float64):
        # each sum times its scale in float64 (exact), rounded once into the tensor's dtype
        values = np.empty((len(index), lanes), w.out.dtype)
        np.multiply(sums, np.ldexp(1.0, exponent - w.frac)[:, None], out=values,
                    casting="unsafe")
    else:
        scale = np.ldexp(1.0, exponent - w.frac)
        values = sums * scale[:, None]
        if lost.any():
            short = lost > 0
            values[short] *= (workers / (workers - lost[short]))[:, None]
            w.rescaled_chunks += int(short.sum())
            counts["rescaled_chunks"] = int(short.sum())
        if w.mean:
            values = values / w.world_size
        if kinds is not None:
            values = NF.overlay(values, kinds)
        values = N.from_float64(values, w.fmt, w.out)
    full = w.n // lanes                 # chunks of `lanes` values; the last may be shorter
    whole = index < full
    if whole.all():
        w.out[:full * lanes].reshape(full, lanes)[index] = values
    else:
        w.out[:full * lanes].reshape(full, lanes)[index[whole]] = values[whole]
    for row in np.flatnonzero(~whole):
        w.out[full * lanes:] = values[row][:w.n - full * lanes]
    counts["tensor_bytes"] = (int(whole.sum()) * lanes + int((~whole).sum()) * (
        w.n - full * lanes)) * w.out.itemsize
    return counts


def messages_of(work: Work, nslots: int) -> list[Message]:
    """A tensor's messages in dealing order (its exponent messages, then its chunks), with
    the chunks this worker may have dropped marked."""
    if work.loss_budget > 0 and work.fmt.kind == "fixed":
        work.droppable = plan_droppable(chunk_norms(work), work.loss_budget, work.priority)
    leading = exponent_messages(work, nslots)
    carries = [-1] * leading + carried_blocks(work, np.arange(work.chunks)).tolist()
    return [message_at(work, i, leading, carries[i]) for i in range(leading + work.chunks)]


def exponent_messages(work: Work, nslots: int) -> int:
    """How many exponent messages lead a tensor's messages (its `lookahead`, set here, or
    its blocks if fewer; none for int32)."""
    if work.fmt.kind != "fixed":
        return 0
    work.lookahead = max(1, -(-nslots // work.block))
    return min(work.lookahead, -(-work.chunks // work.block))


def carried_blocks(work: Work, chunks: np.ndarray) -> np.ndarray:
    """Per data chunk, the block whose exponent proposal it carries (a block b's first chunk
    carries block b + lookahead, if the tensor has it; fixed point only), -1 for none."""
    carried = chunks // work.block + work.lookahead
    carries = (work.fmt.kind == "fixed") & (chunks % work.block == 0) \
        & (carried * work.block < work.chunks)
    return np.where(carries, carried, -1)


def message_at(work: Work, i: int, leading: int, carries: int) -> Message:
    """A tensor's message `i` in dealing order, after `leading` exponent messages, carrying
    the proposal of block `carries` (`carried_blocks`; -1 for none)."""
    if i < leading:
        return Message(work, MessageKind.EXPONENT, i, pclass=EXPONENT_CLASS)
    c = i - leading
    cls = work.droppable.get(c) if work.droppable else None
    return Message(work, MessageKind.DATA, c,
                   needs=c // work.block if work.fmt.kind == "fixed" else -1, carries=carries,
                   droppable=cls is not None, pclass=work.priority if cls is None else cls)


def chunk_norms(work: Work) -> np.ndarray:
    """The L2 norm of each data chunk of the values this worker contributes."""
    total = np.zeros(work.n)
    for src in work.sources:
        total += N.to_float64(src, work.fmt)
    padded = np.zeros(work.chunks * work.lanes)
    padded[:work.n] = total
    return np.sqrt(np.square(padded.reshape(work.chunks, work.lanes)).sum(axis=1))


def plan_droppable(norms: np.ndarray, loss_budget: float, priority: int) -> dict[int, int]:
    """Chunk -> priority class of the chunks this worker may have dropped: the
    floor(loss_budget * chunks) smallest by norm, the i-th smallest of k in class
    (i * priority) // k."""
    k = int(math.floor(loss_budget * len(norms) + 1e-9))
    if k <= 0:
        return {}
    order = np.argsort(norms, kind="stable")[:k]
    return {int(c): (i * priority) // k for i, c in enumerate(order)}
