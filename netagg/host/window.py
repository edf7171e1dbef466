"""The plain window: the engine's common case as arrays, one entry per slot.

While every packet is answered at once with every worker's data, the protocol is lockstep:
message g of the job (in dealing order, over the works submitted) goes to slot
(first + g) % slots with msn = dealt + g, each slot sends its messages one use at a time,
and a result completes its message when its version and check lane are its use's
(`host.checklane`), its count is every worker's, it did not saturate and its credit limit
is not below the slot's last. `PlainWindow` runs that case for whole steps: the state of
each slot (the message in flight, its use, tag, msn, timer, packet) is a numpy array, a
step's results are matched and taken in a handful of array operations, the messages that
may start (credits, a fixed-point chunk's shared exponent) are found and their packets
built as one batch (`host.wire_arrays`), and the sums are written into the tensors a batch
at a time (`host.messages.deliver_rows`), after the next packets are sent (`start`), so that
the writing overlaps the switch's turnaround. No `Message` object exists for a message of the
window.

A message whose result is late is sent again from the window (`resend`), its timeout doubled
as the engine's `_transmit` does, and a copy of an earlier use's result that comes after it
was taken (the switch answers a repeated contribution so) is counted (`stale_results`) and
dropped. Anything else leaves the window (`leave`): a result that does not complete its use
at once (fewer contributions, saturation, an early copy, a stray), a chunk about to start in
a block agreed non-finite (`host.nonfinite`: two rounds a chunk), or a work the window does
not take (a quorum, a loss budget, several paths). The window then writes its state into
the engine's `SlotState`s and `Message`s, as the engine would have left them, and the engine
goes on from there, one message at a time; the next work submitted to an idle engine enters
a window again.

Cost: per step about thirty array operations, and per packet one CRC-32 and a few list
items.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from netagg.contract import wire as W
from netagg.host import numerics as N
from netagg.host.compiled import CompiledStep, carries
from netagg.host.messages import (
    EXPONENT_CLASS,
    RECENT_USES,
    Work,
    carried_blocks,
    deliver_rows,
    exponent_messages,
    message_at,
)
from netagg.host.retransmit import RetransmitTimer

_NO_PSN = -(1 << 62)            # the credit limit of a slot that has taken no result
TAG_USES = 16                   # the check lane's tags computed ahead, per slot


@dataclasses.dataclass
class _Span:
    """A work's messages in the window: global indices first .. first + count - 1, the
    first `leading` of them exponent messages; per message i (from 0) what its packet
    carries, and per block its shared exponent once known."""

    work: Work
    first: int
    count: int
    leading: int
    known: np.ndarray           # per block, and True last: its shared exponent is known
    shared: np.ndarray          # per block: its shared exponent (fixed point)
    chunk: np.ndarray           # per message: its data chunk, -1 for an exponent message
    needs: np.ndarray           # per message: the block whose exponent it needs, -1 none
    carries: np.ndarray         # per message: the block whose proposal it carries, -1 none
    field: np.ndarray           # per message: its ImmDt exponent field
    offset: np.ndarray          # per message: its RETH offset
    dscp: np.ndarray            # per message: its DSCP

    @classmethod
    def of(cls, work: Work, first: int, leading: int) -> _Span:
        w, count = work, leading + work.chunks
        blocks = -(-w.chunks // w.block)
        chunk = np.arange(count) - leading
        data = chunk >= 0
        block = np.where(data, chunk // w.block, -1)
        carries = np.append(np.full(leading, -1), carried_blocks(w, np.arange(w.chunks)))
        field = np.full(count, N.EXP_NONE, np.int64)
        if leading:                 # fixed point: the proposals the messages carry
            field[:leading] = w.proposals[:leading]
            field[carries >= 0] = w.proposals[carries[carries >= 0]]
        return cls(work, first, count, leading, np.append(np.zeros(blocks, bool), True),
                   np.zeros(blocks, np.int64), np.where(data, chunk, -1),
                   block if leading else np.full(count, -1), carries, field,
                   np.where(data, chunk * 4 * w.lanes, 0),
                   np.where(data, W.priority_dscp(w.priority),
                            W.priority_dscp(EXPONENT_CLASS)))

    def know(self, block: int, exponent: int):
        """Block `block`'s shared exponent is `exponent`."""
        self.work.exponents[block] = exponent
        self.known[block], self.shared[block] = True, exponent


class PlainWindow:
    """The engine's slots while the job runs lockstep (see the module). `engine` is the
    `host.engine.Engine` whose slots, dealer, credit limit, counters and transport it uses."""

    def __init__(self, engine):
        e = self.engine = engine
        n = self.slots = e.nslots
        self.first_slot, self.dealt = e.dealer.next_slot, e.dealer.dealt
        self.total = 0                              # messages the window has been given
        self.spans: list[_Span] = []
        self.next = (np.arange(n) - self.first_slot) % n    # next message of each slot
        self.cur = np.full(n, -1, np.int64)         # message in flight, -1 for none
        self.use = np.array([st.use for st in e.slots], np.int64)    # next use
        self.entry_use = self.use.copy()
        self.cur_use = np.zeros(n, np.int64)
        self.tag = np.zeros(n, np.int64)
        self.whole = np.zeros(n, np.int64)          # the check lane of a complete result
        self.last_psn = np.array([_NO_PSN if st.last_psn == -float("inf") else st.last_psn
                                  for st in e.slots], np.int64)
        self.sent_at = np.zeros(n)
        self.deadline = np.full(n, np.inf)
        self.rto = np.zeros(n)
        self.attempts = np.zeros(n, np.int64)      # sendings of the message in flight
        self.packets: list = [None] * n
        self.tag_base = self.use - TAG_USES         # `_tags`' table: none yet
        self.tag_table = np.zeros((n, TAG_USES), np.int64)
        self.taken: list[tuple] = []                # sums taken, not yet in their tensors
        self.compiled = CompiledStep.of(self)       # its steady state in C++, where it can

    @staticmethod
    def takes(engine, work: Work) -> bool:
        """Whether a window can run `work` for `engine` (no state outside a window)."""
        e = engine
        return (e.joined and e.nslots > 0 and e.sprayer.paths == 1 and e.needed == e.workers
                and work.loss_budget == 0 and work.error is None)

    @staticmethod
    def clean(engine) -> bool:
        """Whether the engine holds nothing a window does not know of, and the next message
        of every slot is numbered by its dealing order."""
        return not engine.delivering and all(
            st.inflight is None and not st.queue and not st.early
            and st.last_msn < engine.dealer.dealt for st in engine.slots)

    def add(self, work: Work):
        span = _Span.of(work, self.total, exponent_messages(work, self.slots))
        self.spans.append(span)
        self.total += span.count

    def idle(self) -> bool:
        return self.total == 0 or (self.cur < 0).all() and (self.next >= self.total).all()

    # --- results ------------------------------------------------------------------------

    def take(self, batch, now: float) -> list[int]:
        """Take the results of `batch` (`host.wire_arrays.ResultBatch`) that complete their
        use at once; the indices of the others, which the window cannot take."""
        e = self.engine
        slot = batch.slot
        ok = ((self.cur[slot] >= 0) & (batch.version == self.cur_use[slot] & 1)
              & (batch.check == self.whole[slot]) & (batch.count == e.workers)
              & ~batch.overflow & (batch.limit >= self.last_psn[slot]))
        rows = np.flatnonzero(ok)
        if len(rows):
            if np.bincount(slot[rows]).max() > 1:   # a slot's second copy in a batch: later
                _, first = np.unique(slot[rows], return_index=True)
                ok[:] = False
                rows = rows[np.sort(first)]
                ok[rows] = True
            self._complete(batch, rows, now)
        others = np.flatnonzero(~ok)
        if not len(others):
            return []
        stale = self._stale(batch, others)
        e.stats["stale_results"] += int(stale.sum())
        return others[~stale].tolist()

    def _complete(self, batch, rows: np.ndarray, now: float):
        """The messages in flight whose uses the results `rows` of `batch` complete."""
        e = self.engine
        done = batch.slot[rows]
        once = done[self.attempts[done] == 1]       # (Karn's rule: a message sent once)
        if len(once):
            e.rtt.sample(now - self.sent_at[once[0]])
        e.answer_heard(float((self.deadline[done] - self.rto[done]).max()), now)
        e.last_progress = now
        g = self.cur[done]
        self.cur[done] = -1
        self.deadline[done] = np.inf
        self.last_psn[done] = batch.limit[rows]
        exponent = batch.exponent[rows]
        for span in self._spans_of(g):
            mine = (g >= span.first) & (g < span.first + span.count)
            self._taken(span, g[mine] - span.first, rows[mine], exponent[mine], batch.lanes)

    def _stale(self, batch, rows: np.ndarray) -> np.ndarray:
        """Which results `rows` of `batch` are copies of an earlier use's than their slot's
        current one: a credit limit below the slot's last (a later use completes after the
        earlier ones), or the version and complete check lane of one of the slot's last
        `RECENT_USES` completed uses (a copy the switch made for a contribution sent again,
        which may come a use or two late), as the engine's `CheckLane.classify` has it."""
        e, slot = self.engine, batch.slot[rows]
        older = batch.limit[rows] < self.last_psn[slot]
        last = self.use[slot] - 1 - (self.cur[slot] >= 0)
        version, check = batch.version[rows], batch.check[rows]
        stale = np.zeros(len(rows), bool)
        for back in range(RECENT_USES):
            use = last - back
            maybe = ~older & ~stale & (use >= 0)
            if not maybe.any():
                break
            tags = e.check_lane.tags(slot[maybe], use[maybe])
            stale[maybe] = ((version[maybe] == use[maybe] & 1)
                            & (check[maybe] == e.check_lane.whole(tags)))
        return stale | older

    def _taken(self, span: _Span, i: np.ndarray, rows: np.ndarray, exponent: np.ndarray,
               lanes: np.ndarray):
        """Messages `i` of a span completed, by results `rows`."""
        w = span.work
        leading = span.leading
        exps = i < leading
        for b, x in zip(i[exps].tolist(), exponent[exps].tolist()):
            span.know(b, x)
        data = ~exps
        if not data.any():
            return
        i, chunk = i[data], i[data] - leading
        if leading:                         # the proposals carried: later blocks' exponents
            x, carried = exponent[data], span.carries[i]
            carrying = (carried >= 0) & (x != N.EXP_NONE)
            for b, v in zip(carried[carrying].tolist(), x[carrying].tolist()):
                if b not in w.exponents:
                    span.know(b, v)
        self.taken.append((w, chunk, lanes, rows[data],
                           span.shared[span.needs[i]] if leading else None))

    def deliver(self):
        """Write the sums of the messages taken into their tensors (`start` does it after
        sending the next packets, so that the writing overlaps the switch's turnaround)."""
        e = self.engine
        for w, chunk, lanes, rows, shared in self.taken:
            e.stats.update(deliver_rows(w, chunk, lanes[rows, :-1], shared,
                                        [e.workers], e.workers))
            e.finish_chunks(w, len(chunk))
        self.taken.clear()
        self.spans = [span for span in self.spans if not span.work.done]

    def _spans_of(self, g: np.ndarray) -> list[_Span]:
        """The spans that hold one of the messages `g` (not those in a gap between them)."""
        return [s for s in self.spans if ((g >= s.first) & (g < s.first + s.count)).any()]

    # --- sending ------------------------------------------------------------------------

    def start(self, now: float):
        """Start every slot whose next message may start, send their packets, then write
        the sums taken into their tensors."""
        if self.compiled is not None:       # the steady state in C++, where it can
            if self.taken:
                self.deliver()
            self.compiled.run(now)
            if self.engine.window is not self:
                return
        sent = self.engine.stats["packets_sent"]
        try:
            self._start(time.monotonic())
        finally:
            if self.taken and self.engine.window is self:
                self.deliver()
        if self.compiled is not None and self.engine.window is self \
                and self.engine.stats["packets_sent"] != sent:
            self.compiled.run(time.monotonic())     # (after a tensor's exponent messages)

    def lead(self, now: float):
        """Send the exponent messages of a work just submitted to an idle window, now, from
        the caller's thread (the compiled step leaves a tensor's first messages to Python):
        they leave before the background thread wakes, whose first run is then compiled,
        on the span the caller's thread has set it up for (`CompiledStep.adopt`). Nothing
        else can start before their results (the data chunks need them)."""
        if self.compiled is None or self.taken or (self.cur >= 0).any() or not self.spans:
            return
        span = self.spans[-1]
        waiting = self.next[self.next < self.total]
        if span.leading and len(waiting) and waiting.min() >= span.first:
            self._start(now)
            fmt = carries(span.work)
            if fmt is not None:
                self.compiled.adopt(span, fmt)

    def _start(self, now: float):
        e = self.engine
        free = np.flatnonzero((self.cur < 0) & (self.next < self.total))
        if not len(free):
            return
        g = self.next[free]
        ready = np.ones(len(free), bool)
        for span in self._spans_of(g):
            mine = (g >= span.first) & (g < span.first + span.count)
            needs = span.needs[g[mine] - span.first]
            ready[mine] = span.known[needs]
            if (ready[mine] & (needs >= 0) & (span.shared[needs] == N.EXP_NONFINITE)).any():
                self.leave()            # a non-finite block: the engine's message path
                return
        if e.credits:
            short = ready & (self.dealt + g >= e.limit)
            e.stats["credit_waits"] += int(short.sum())
            ready &= ~short
        slots, g = free[ready], g[ready]
        if not len(slots):
            return
        use = self.use[slots]
        self.cur[slots], self.cur_use[slots] = g, use
        self.use[slots] = use + 1
        self.next[slots] = g + self.slots
        tag = self._tags(slots, use)
        self.tag[slots] = tag
        self.whole[slots] = e.check_lane.whole(tag)
        spans = self._spans_of(g)
        if len(spans) == 1:
            lanes, exponent, offset, dscp = self._payloads(spans[0], g - spans[0].first, tag)
        else:
            lanes = np.zeros((len(g), spans[0].work.lanes + 1), np.int32)
            exponent, offset, dscp = np.zeros_like(g), np.zeros_like(g), np.zeros_like(g)
            for span in spans:
                mine = (g >= span.first) & (g < span.first + span.count)
                lanes[mine], exponent[mine], offset[mine], dscp[mine] = self._payloads(
                    span, g[mine] - span.first, tag[mine])
        datagrams = e.writer.datagrams(
            lanes, paths=[0] * len(slots), slot=slots, version=use & 1, offset=offset,
            msn=self.dealt + g, psn=e.psns.take(len(slots)), exponent=exponent,
            droppable=np.zeros(len(slots), bool))
        for s, datagram in zip(slots.tolist(), datagrams):
            self.packets[s] = datagram
        e.transport.send_batch(datagrams, [0] * len(slots), dscp.tolist())
        rto = e.rtt.rto
        self.sent_at[slots], self.rto[slots], self.deadline[slots] = now, rto, now + rto
        self.attempts[slots] = 1
        e.earliest = min(e.earliest, now + rto, e.recent.probe_at(e.rtt, now))
        e.stats["packets_sent"] += len(slots)
        e.stats["bytes_sent"] += len(slots) * len(datagrams[0])
        inflight = int((self.cur >= 0).sum())
        if inflight > e.stats["max_inflight"]:
            e.stats["max_inflight"] = inflight

    def _tags(self, slots: np.ndarray, use: np.ndarray) -> np.ndarray:
        """The check lane's tags of `use` of `slots`, from a table of each slot's next
        `TAG_USES` uses (computed again when a slot runs past it)."""
        ahead = use - self.tag_base[slots]
        if (ahead >= TAG_USES).any():
            self.tag_base = self.use.copy()
            self.tag_base[slots] = use
            uses = self.tag_base[:, None] + np.arange(TAG_USES)
            self.tag_table = self.engine.check_lane.tags(
                np.repeat(np.arange(self.slots), TAG_USES), uses.ravel()).reshape(-1, TAG_USES)
            ahead = use - self.tag_base[slots]
        return self.tag_table[slots, ahead]

    def _payloads(self, span: _Span, i: np.ndarray, tag: np.ndarray):
        """The lanes (check lane sealed), ImmDt exponent fields, RETH offsets and DSCPs of a
        span's messages `i` starting with tags `tag`."""
        w, e = span.work, self.engine
        chunk = span.chunk[i]
        if i.min() >= span.leading:             # (a step's usual batch: data chunks only)
            lanes, saturated = w.lanes_of(chunk)
        else:
            data = chunk >= 0
            lanes = np.zeros((len(i), w.lanes + 1), np.int32)
            saturated = np.zeros(len(i), bool)
            if data.any():
                lanes[data], saturated[data] = w.lanes_of(chunk[data])
        lanes[:, -1] = np.where(saturated, N.INT32_MAX, e.check_lane.seal(tag, e.rank))
        return lanes, span.field[i], span.offset[i], span.dscp[i]

    # --- leaving ------------------------------------------------------------------------

    def resend(self, now: float):
        """Send the packets of the messages in flight that are due again, each with its
        timeout twice the last (at most the estimator's `rto_max`), and those a later
        sending's answer shows lost (`host.retransmit.RecentAnswer`) with the same timeout,
        as the engine's `_transmit` does."""
        e = self.engine
        flight, late = self.cur >= 0, self.deadline <= now
        last = self.deadline - self.rto
        lost = ~late & flight & (last < e.recent.horizon(e.rtt))
        if lost.any():
            e.recent.found(now)
        if flight.any() and now >= e.recent.probe_at(e.rtt, float(last[flight].max())):
            lost |= ~late & flight          # a probe: every message in flight, once
            e.recent.probed = True
            e.stats["probes"] += 1
        due = np.flatnonzero(late | lost)
        if not len(due):
            return
        rto = np.where(late[due], np.minimum(e.rtt.rto_max, 2 * self.rto[due]), self.rto[due])
        self.rto[due], self.deadline[due] = rto, now + rto
        self.attempts[due] += 1
        e.stats["early_retransmissions"] += int(lost.sum())
        dscp = np.zeros(len(due), np.int64)
        g = self.cur[due]
        for span in self._spans_of(g):
            mine = (g >= span.first) & (g < span.first + span.count)
            dscp[mine] = span.dscp[g[mine] - span.first]
        packets = [self.packets[s] for s in due.tolist()]
        e.transport.send_batch(packets, [0] * len(due), dscp.tolist())
        e.stats["retransmissions"] += len(due)
        e.stats["packets_sent"] += len(due)
        e.stats["bytes_sent"] += sum(map(len, packets))
        e.earliest = min(e.earliest, self.due_at())

    def due_at(self) -> float:
        """When a message in flight is next due again: its timeout, a loss a later
        sending's answer shows (now), or a probe of the tail (`host.retransmit`)."""
        e, flight = self.engine, self.cur >= 0
        if not flight.any():
            return np.inf
        last = (self.deadline - self.rto)[flight]
        if last.min() < e.recent.horizon(e.rtt):
            return -np.inf
        return min(float(self.deadline.min()), e.recent.probe_at(e.rtt, float(last.max())))

    def leave(self):
        """Write the window's state into the engine's slots and messages, as the engine
        would have it, and the dealer's position."""
        e = self.engine
        self.deliver()
        if not self.idle():
            e.stats["window_fallbacks"] += 1
        spans = self.spans
        starts = np.array([s.first for s in spans])
        # the tags of each slot's last (up to RECENT_USES) completed uses, which `recent` holds
        done = self.use - (self.cur >= 0)
        first = np.maximum(self.entry_use, done - RECENT_USES)
        ahead = np.arange(RECENT_USES)
        held = first[:, None] + ahead < done[:, None]
        slot_of = np.broadcast_to(np.arange(self.slots)[:, None], held.shape)[held]
        tags = e.check_lane.tags(slot_of, (first[:, None] + ahead)[held]).tolist() \
            if held.any() else []
        held_count = held.sum(axis=1).tolist()
        at = 0
        for s, st in enumerate(e.slots):
            st.use = int(self.use[s])
            if self.last_psn[s] != _NO_PSN:
                st.last_psn = int(self.last_psn[s])
            inflight = [int(self.cur[s])] if self.cur[s] >= 0 else []
            st.recent.extend(tags[at:at + held_count[s]])
            at += held_count[s]
            if self.next[s] >= self.slots:      # the msn of the last message begun
                st.last_msn = self.dealt + int(self.next[s]) - self.slots
            for g in inflight + list(range(int(self.next[s]), self.total, self.slots)):
                span = spans[int(np.searchsorted(starts, g, side="right")) - 1]
                m = message_at(span.work, g - span.first, span.leading,
                               int(span.carries[g - span.first]))
                m.slot, m.seq = s, self.dealt + g
                if g != self.cur[s]:
                    st.queue.append(m)
                    continue
                m.use, m.msn, m.tag = int(self.cur_use[s]), m.seq, int(self.tag[s])
                if m.needs >= 0:
                    m.exponent = span.work.exponents[m.needs]
                m.expect = (m.use & 1, int(self.whole[s]))
                m.timer = RetransmitTimer(float(self.sent_at[s]), float(self.deadline[s]),
                                          float(self.rto[s]), int(self.attempts[s]),
                                          float(self.deadline[s] - self.rto[s]))
                m.packet = self.packets[s]
                st.inflight = m
        e.dealer.next_slot = (self.first_slot + self.total) % self.slots
        e.dealer.dealt = self.dealt + self.total
        e.idle = [st for st in e.slots if st.inflight is None and st.queue]
        e.earliest = -np.inf            # (the engine's `_retransmit` finds what is due)
        e.window = None

