"""The receiving half of the protocol engine (`host.engine.Engine` is a `Taking`): the
datagrams of a step read, each result taken by the use it belongs to, and the sums of
completed chunks written into their tensors.

- **Reading.** The job's results are read as one batch (`host.wire_arrays.read_results`);
  control answers go to the control channel; anything else is counted (`ignored`, or
  `foreign_results` for another session's R_Key) and dropped.
- **The common case.** A result of a slot's current use whose version and check lane are
  those of every worker's data (`Message.expect`), not saturated and not older than the
  slot's last (its credit limit), completes its message at once.
- **The rest** is classified by its check lane (`host.checklane`: current, early, stale or
  unrecognised) and taken (`take`): an overflow redoes the chunk with a larger exponent
  (fixed point) or fails the tensor (int32); too few contributions start the rounds that
  fill the chunk in (`CheckLane.fill_in`) or redo it; a complete exponent message sets its
  block's shared exponent.
- **Non-finite blocks** (`host.nonfinite`): a chunk's KINDS round, complete, starts its
  FINITE round in the slot's next use, with the kinds and the finite values' exponent.
- **Writing the sums.** The chunks completed in a step are written into their tensors a
  tensor at a time (`host.messages.deliver`) at the end of the step, and only then count as
  done, so a work is done when its values are in place.

Cost: per step, one join and a few array operations for the results, one dequantisation
per tensor; per result a few attribute updates.
"""

from __future__ import annotations

import time

import numpy as np

from netagg.contract import wire as W
from netagg.host import numerics as N
from netagg.host.checklane import Match, Outcome
from netagg.host.messages import Message, MessageKind, Result, Send, SlotState, Work, deliver
from netagg.host.nonfinite import Phase
from netagg.host.wire_arrays import read_results


class Taking:
    """Results taken into an engine's slots, messages and works. The two halves call each
    other through public methods only: the engine's step calls `receive` and
    `deliver_sums`, its start of a use whose result came early `take`; this half calls the
    engine's `path_answered` and `answer_heard`; the window and the compiled step call
    `receive` and `finish_chunks`."""

    def receive(self, datagrams: list[bytes]):
        """Take a step's datagrams: the job's results as a batch (`read_results`), each
        that completes its use with every worker's data at once here (or by the window,
        while there is one), the rest one at a time (`_classify`)."""
        self.stats["packets_received"] += len(datagrams)
        self.stats["bytes_received"] += sum(map(len, datagrams))
        batch, rest = read_results(datagrams, lanes=self.lanes, qpn=self.qpn,
                                   rkey=self.session_tag, job=self.job, slots=self.nslots,
                                   near=self.limit)
        for datagram in rest:
            self._receive_one(datagram)
        if batch is None:
            return
        top = int(batch.limit.max())
        if top > self.limit:
            self.limit = top
        now = time.monotonic()
        if self.window is not None:
            others = self.window.take(batch, now)
            if not others:
                return
            self.window.leave()             # the engine takes the others, one at a time
            for i in others:
                self._classify(batch.result(i))
            return
        slots, workers, idle, delivering = self.slots, self.workers, self.idle, self.delivering
        everyone, others, sampled = self.check_lane.everyone, [], False
        lanes, limits, exponents = batch.lanes, batch.limit.tolist(), batch.exponent.tolist()
        versions, checks = batch.version.tolist(), batch.check.tolist()
        counts, overflows = batch.count.tolist(), batch.overflow.tolist()
        for i, s in enumerate(batch.slot.tolist()):
            st = slots[s]
            m = st.inflight
            if m is None or m.expect != (versions[i], checks[i]) \
                    or counts[i] != workers or overflows[i] \
                    or limits[i] < st.last_psn:
                others.append(i)
                continue
            # the use holds every worker's data (its check lane shows it, not saturated):
            # the message is complete (`take`'s common case, inline)
            if not sampled and m.timer.attempts == 1:     # a round trip sample a batch
                self.rtt.sample(now - m.timer.sent_at)
                sampled = True
            self.answer_heard(m.timer.last_at, now)
            st.inflight = None
            idle.append(st)
            st.last_psn = limits[i]
            if m.path is not None:
                self.path_answered(m)
            st.recent.append(m.tag)
            e = exponents[i]
            if e > m.exp_max:                   # (EXP_NONE is the smallest)
                m.exp_max = e
            m.members = everyone
            w = m.work
            if m.kind is MessageKind.EXPONENT:
                w.exponents[m.index] = m.exp_max
                continue
            m.acc = lanes[i, :-1]
            if m.carries >= 0 and m.exp_max != N.EXP_NONE:
                w.exponents.setdefault(m.carries, m.exp_max)
            delivering.append((m, workers))
        if len(others) < len(batch):
            self.last_progress = now
        for i in others:
            self._classify(batch.result(i))

    def _receive_one(self, datagram: bytes):
        if self.control.take_answer(datagram):
            return
        try:
            dqpn, psn, rkey, imm, payload = W.read_write_imm(datagram)
        except W.WireError:
            self.stats["ignored"] += 1
            return
        if dqpn != self.qpn:
            self.stats["ignored"] += 1
            return
        if rkey != self.session_tag:        # the R_Key the session wrote in the job table
            self.stats["foreign_results"] += 1
            return
        job, count, version, slot, exponent, overflow = W.unpack_result_imm(imm)
        if job != self.job or not self.nslots:
            self.stats["ignored"] += 1
            return
        limit = W.unwrap(psn, self.limit)
        if limit > self.limit:
            self.limit = limit
        if slot >= self.nslots or len(payload) != 4 * (self.lanes + 1):
            self.stats["ignored"] += 1
            return
        lanes = np.frombuffer(payload, "<i4")
        check = int(lanes[-1])
        if self.window is not None:
            self.window.leave()
        self._classify(Result(slot, version, count, exponent,
                              bool(overflow) or check == N.INT32_MAX, lanes, limit, check))

    def _classify(self, res: Result):
        """Take a result if it is its slot's current use's, keep it if it is a later one's,
        count it otherwise."""
        st = self.slots[res.slot]
        match, use = self.check_lane.classify(res, st)
        if match is Match.CURRENT:
            self.take(st, st.inflight, res)
        elif match is Match.EARLY:
            st.early[use] = res
            self.stats["early_results_kept"] += 1
        elif match is Match.STALE:
            self.stats["stale_results"] += 1
        else:
            self.stats["unrecognized_results"] += 1

    def take(self, st: SlotState, m: Message, res: Result):
        """Apply the result of the message's use (its check lane verified)."""
        members = res.members
        if members is None and not res.overflow:        # a result kept early
            members = self.check_lane.members(res.check, res.count, m.tag)
        now = time.monotonic()
        self.rtt.answered(m.timer, now)
        self.answer_heard(m.timer.last_at, now)
        st.inflight = None
        self.idle.append(st)
        st.last_psn = max(st.last_psn, res.limit)
        self.path_answered(m)
        st.recent.append(m.tag)
        w = m.work
        # progress: a round that adds data (a round of zeros only does not: a peer that
        # stopped must end in NetaggTimeout, not in fill rounds forever)
        if res.overflow or m.acc is None or (members or 0) & ~m.members:
            self.last_progress = now
        if res.exponent != N.EXP_NONE:
            m.exp_max = max(m.exp_max, res.exponent)
        if res.overflow and m.kind is MessageKind.DATA:
            self.stats["overflows"] += 1
            if w.fmt.kind == "fixed" and m.bump < 64:
                self._redo(st, m, bump=m.bump + 1)
                return
            if w.error is None:
                part = w.values(m.index)
                w.error = OverflowError(
                    f"the int32 sum saturated in chunk {m.index} (values {part.start}.."
                    f"{part.stop - 1}): the exact sum does not fit")
            self.finish_chunks(w)
            return
        if self.check_lane.membership and m.acc is not None:
            m.acc = m.acc + res.sums.astype(np.int64)
            m.members |= members or 0
            have = m.members.bit_count()
        else:
            m.acc = res.sums
            m.members = members or 0
            have = m.members.bit_count() if self.check_lane.membership else res.count
        # a KINDS round holds every worker's, whatever the loss budget (`host.nonfinite`)
        budget = 0.0 if m.phase is Phase.KINDS and self.check_lane.membership \
            else w.loss_budget
        outcome = self.check_lane.outcome(have, budget, m.kind)
        if outcome is Outcome.FILL_IN:
            self._fill(st, m)
            return
        if outcome is Outcome.REDO:
            self._redo(st, m, bump=m.bump)
            return
        if m.kind is MessageKind.EXPONENT:
            w.exponents[m.index] = m.exp_max
            return
        if m.phase is Phase.KINDS:          # the kinds known: the finite values next
            self.stats["nonfinite_chunks"] += 1
            self._next_round(st, m, phase=Phase.FINITE, finite=max(m.exp_max, N.EXP_MIN),
                             kinds=np.array(m.acc, np.int64), send=Send.DATA, acc=None,
                             members=0, bump=0, exp_max=N.EXP_NONE)
            return
        if m.carries >= 0 and m.exp_max != N.EXP_NONE:
            w.exponents.setdefault(m.carries, m.exp_max)
        self.delivering.append((m, have))

    def finish_chunks(self, w: Work, chunks: int = 1):
        """`chunks` of the work's chunks have their sums in place (or failed): the work is
        done with its last, and no longer pending."""
        w.remaining -= chunks
        if w.remaining == 0:
            w.done = True
            self.pending_works -= 1

    def _next_round(self, st: SlotState, m: Message, **changes):
        """The message again, in the slot's next use (every worker decides the same)."""
        st.inflight = None
        self.path_answered(m)
        st.queue.appendleft(m.again(**changes))

    def fill_send(self, members: int) -> Send:
        """What this worker sends in a fill-in round of a chunk whose sums hold `members`
        (`CheckLane.fill_in`, over every rank and the job's quorum)."""
        return self.check_lane.fill_in(members, self.rank, self.needed)

    def lacking(self, m: Message) -> str:
        """The ranks whose data a message being filled in still lacks, as text ("" when it
        is not filled in or its contributors are not known)."""
        if not (m.filled and self.check_lane.membership):
            return ""
        missing = [r for r in range(self.workers) if not m.members >> r & 1]
        return f", a fill-in round that lacks the data of {self.name_ranks(missing)}"

    def name_ranks(self, ranks: list[int]) -> str:
        return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, ranks))

    def _redo(self, st: SlotState, m: Message, bump: int):
        """The message again, whole: every rank sends its data."""
        self.stats["redone"] += 1
        self._next_round(st, m, bump=bump, send=Send.DATA, acc=None, members=0)

    def _fill(self, st: SlotState, m: Message):
        """Fill the chunk in (see `CheckLane.fill_in` for who sends what)."""
        send = self.fill_send(m.members)
        self.stats["fill_rounds"] += 1
        if m.kind is MessageKind.DATA and not m.filled:
            m.work.filled_chunks += 1
            self.stats["filled_chunks"] += 1
        self._next_round(st, m, send=send, filled=True)

    def deliver_sums(self):
        """Write the sums of the chunks completed since the last call into their tensors
        (`deliver`, a tensor at a time), then count the chunks done."""
        if not self.delivering:
            return
        done, self.delivering = self.delivering, []
        w = done[0][0].work
        if all(m.work is w for m, _ in done):      # (the common case: one tensor)
            groups = [done]
        else:
            by_work: dict[int, list[tuple[Message, int]]] = {}
            for m, have in done:
                by_work.setdefault(id(m.work), []).append((m, have))
            groups = list(by_work.values())
        for chunks in groups:
            w = chunks[0][0].work
            self.stats.update(deliver(w, chunks, self.workers))
            self.finish_chunks(w, len(chunks))

