"""The check lane: which contributions a result holds, and the rounds that fill in a chunk
whose result holds too few.

- **Check lane.** The last lane of every packet holds `tag(slot, use)`, a hash of (session,
  job, slot, use of the slot), plus `1 << rank` when the job has at most 16 workers. A
  result of c contributions with data (its ImmDt count: a null adds zeros) holds
  `c * tag + bitmap`, where bitmap has c bits set: the ranks whose data the sums hold. A
  result holding another value is a late copy of an earlier result or mixes a stray
  contribution: ignored either way (the worker retransmits and gets its use's result
  again). With more than 16 workers the lane holds `c * tag` and the contributors are not
  known. A worker whose sums saturate int32 puts INT32_MAX there instead (the saturation
  marker: the result overflows).
- **Which use a result is.** A result is the current use's when its version and check lane
  are (or it overflowed, with the current use's version). Results for a slot's other
  version, earlier uses (by the check lane, or a credit limit not above the slot's last
  result's: a later use completes later) or unknown slots are ignored and counted. A result
  for a use this worker has not begun (others closed it with a quorum) is kept for that
  use, up to `EARLY_USES` uses ahead.
- **Results with fewer contributions** (nulls, or a quorum's early close). The check lane
  must hold c * tag (+ the bitmap of c ranks). The per-chunk allowance is
  A = ceil(loss_budget * workers) if loss_budget > 0 else 0 (the same for the tensor's
  exponent messages: a proposal missing from the maximum can only make a chunk saturate,
  which redoes it with a larger exponent). When the contributions with data so far number
  c_total < workers - A, or c_total == 0, the chunk is filled in, in the slot's next use
  (every worker decides the same, from the same result): the ranks whose data is missing
  send it, not droppable, and, when they are fewer than the contributions that close a use
  (the quorum, else all workers), the lowest ranks whose data is in send zeros to make up
  the quorum; the other ranks send nothing and wait for the result (after max(16 RTOs,
  `rto_max`) they send zeros, which only asks for the result: zeros that arrive while the
  round still waits for a slow rank's data close it without that data, and let the slot
  move on past that rank). In a fabric the rule holds per leaf, with the leaf's ranks and
  its local quorum (`host.fabric_quorum`), so that the round completes at every leaf. The
  sums of the rounds add up, each rank's data once. Without the bitmap (more than 16
  workers) the chunk is redone whole instead, which cannot help against a quorum, so then
  a quorum needs a loss budget that allows it. Then the sums of
  c_total < workers contributions are scaled by workers / c_total (the missing ones
  estimated by the mean of those present, as LTP does) before they are dequantised; a mean
  then divides by the world size as usual. With loss_budget 0 every chunk is exact, quorum
  or not. The kinds round of a non-finite block (`host.nonfinite`) has no allowance: with
  membership it is filled in to every worker's, whatever the loss budget. Per tensor:
  `Work.droppable_sent`, `lost_contributions` (workers - c_total, summed over its chunks),
  `rescaled_chunks`, `filled_chunks`; the engine's `stats` sum them.

Cost: the tags of a step's packets in one array operation (`tags`), and per result that
is not its use's at once, one tag per use it is checked against (the current use, then up
to `EARLY_USES` later ones).
"""

from __future__ import annotations

import enum
import math

import numpy as np

from netagg.host.messages import MessageKind, Result, Send, SlotState
from netagg.host.retransmit import RttEstimator

MEMBERSHIP_MAX_WORKERS = 16     # up to this, the check lane also carries the contributors
POKE_RTOS = 16                  # a waiting rank asks for its result after this many RTOs
EARLY_USES = 32                 # results kept for a slot's uses this worker has not begun yet


class Match(enum.Enum):
    """Which use of its slot a result is, as its check lane and credit limit show."""

    CURRENT = "current"         # the use in flight
    EARLY = "early"             # a use this worker has not begun (others closed it)
    STALE = "stale"             # an earlier use's (a late copy)
    UNRECOGNIZED = "unrecognized"


class Outcome(enum.Enum):
    """What a round's result leaves of its message."""

    COMPLETE = "complete"       # the sums hold enough contributions
    FILL_IN = "fill in"         # too few: the missing ranks send theirs in the next use
    REDO = "redo"               # too few, contributors unknown: every rank sends again


class CheckLane:
    """The check lane of one job's packets, for a worker of `workers`: the tags, the
    contributors a result shows, and the decisions that follow."""

    def __init__(self, session_tag: int, job: int, workers: int):
        self.session_tag, self.job, self.workers = session_tag, job, workers
        self.membership = workers <= MEMBERSHIP_MAX_WORKERS
        self.tag_bits = 30 - (workers - 1).bit_length() if self.membership else 22

    @property
    def everyone(self) -> int:
        """The bitmap of every rank (0 without membership)."""
        return (1 << self.workers) - 1 if self.membership else 0

    def whole(self, tag: int) -> int:
        """The check lane of a result that holds every worker's data, for `tag`."""
        return self.workers * tag + self.everyone

    def tags(self, slots, uses) -> np.ndarray:
        """`tag` of each (slot, use): a 64-bit mix (splitmix64's finaliser) of the session,
        the job, the slot and the use, cut to `tag_bits`, as int64 (every worker computes
        the same)."""
        with np.errstate(over="ignore"):
            x = (np.asarray(slots, np.uint64) << np.uint64(32)) \
                | np.asarray(uses, np.uint64) & np.uint64(0xFFFFFFFF)
            x ^= np.uint64(self.session_tag << 8 | self.job)
            x *= np.uint64(0x9E3779B97F4A7C15)
            x ^= x >> np.uint64(30)
            x *= np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(27)
            x *= np.uint64(0x94D049BB133111EB)
            x ^= x >> np.uint64(31)
        return (x & np.uint64((1 << self.tag_bits) - 1)).astype(np.int64)

    def tag(self, slot: int, use: int) -> int:
        """The check lane's hash of (session, job, slot, use) (`tags`)."""
        return int(self.tags([slot], [use])[0])

    def members(self, check: int, count: int, tag: int) -> int | None:
        """The bitmap of contributors a check lane shows for `count` contributions with data
        and `tag` (0 without membership), or None if it does not hold them."""
        rem = check - count * tag
        if not self.membership:
            return 0 if rem == 0 else None
        if 0 <= rem < (1 << self.workers) and rem.bit_count() == count:
            return rem
        return None

    def holds(self, check: int, count: int, tag: int) -> bool:
        return self.members(check, count, tag) is not None

    def shows(self, res: Result, use: int) -> bool:
        """Whether the result's check lane is that of its slot's `use`."""
        return self.holds(res.check, res.count, self.tag(res.slot, use))

    def classify(self, res: Result, st: SlotState) -> tuple[Match, int | None]:
        """Which use of the slot `st` the result is, and that use's number."""
        # a later use of a slot completes after the earlier ones, so its result's credit
        # limit is at least the last one's (equal: a replay made before anything completed)
        if res.limit < st.last_psn:
            return Match.STALE, None
        m = st.inflight
        if m is not None and (m.use & 1) == res.version:
            if res.overflow:
                return Match.CURRENT, m.use
            res.members = self.members(res.check, res.count, m.tag)
            if res.members is not None:
                return Match.CURRENT, m.use
        # not this use's: a use this worker has not begun (others closed it with a quorum),
        # an earlier use's (a late copy), or a mix
        if not res.overflow and res.count > 0:
            for use in range(st.use, st.use + EARLY_USES):
                if use & 1 == res.version and use not in st.early and self.shows(res, use):
                    return Match.EARLY, use
        if res.overflow or any(self.holds(res.check, res.count, t) for t in st.recent):
            return Match.STALE, None
        # neither: an earlier use's beyond those remembered, a later one beyond EARLY_USES,
        # or a sum that mixes a stray contribution (which the MSN check now prevents): taken
        # for none of them (the worker retransmits and gets its use's result again)
        return Match.UNRECOGNIZED, None

    def seal(self, tag, rank: int):
        """A contribution's check lane for its use's tag (or an array of them): the tag, plus
        the rank bit with membership. (A worker whose lanes saturated sends the saturation
        marker instead.)"""
        return tag + (1 << rank) if self.membership else tag

    def allowance(self, loss_budget: float) -> int:
        """Contributions a data chunk may lose: ceil(loss_budget * workers), 0 for 0."""
        return math.ceil(loss_budget * self.workers - 1e-9) if loss_budget > 0 else 0

    def quorum_refused(self, needed: int, loss_budget: float) -> bool:
        """Whether a quorum of `needed` cannot work: without membership a chunk short of
        contributions is redone whole, which a quorum closes short again."""
        return not self.membership and needed < self.workers \
            and self.workers - needed > self.allowance(loss_budget)

    def outcome(self, have: int, loss_budget: float, kind: MessageKind) -> Outcome:
        """Whether `have` contributions with data complete a message."""
        if have == 0 or self.workers - have > self.allowance(loss_budget):
            if self.membership:
                return Outcome.FILL_IN
            if kind is MessageKind.DATA:    # (a quorum allows it: `quorum_refused`)
                return Outcome.REDO
            # an exponent short of a quorum's late proposals: a chunk that then saturates
            # is redone with a larger exponent
        return Outcome.COMPLETE

    def fill_in(self, members: int, rank: int, needed: int, ranks: range | None = None) -> Send:
        """What `rank` sends to fill in a chunk whose sums hold the ranks of `members`: its
        data if missing; zeros if it is among the lowest present ranks that make up the
        `needed` contributions that close a use; else nothing. `ranks`: the ranks whose
        contributions close a use together, `rank` among them (default every rank; in a
        fabric, its leaf's: `host.fabric_quorum`)."""
        ranks = range(self.workers) if ranks is None else ranks
        missing = [r for r in ranks if not members >> r & 1]
        present = [r for r in ranks if members >> r & 1]
        senders = set(missing) | set(present[:max(0, needed - len(missing))])
        if rank in missing:
            return Send.DATA
        return Send.ZEROS if rank in senders else Send.NOTHING


def poke_delay(rtt: RttEstimator) -> float:
    """How long a rank that sends nothing in a round waits before it asks for the result."""
    return max(POKE_RTOS * rtt.rto, rtt.rto_max)
