"""Liveness across a leaf and spine fabric: every worker watches the heartbeats of every rank
of the world, so that a rank gone on any leaf is named by every rank within the one-switch
bound (`host.liveness`: between `DEAD_AFTER` and `DEAD_AFTER + 2 READ_PERIOD` seconds after
its last beat).

A rank beats in its own leaf (the BEAT register of its rank at the leaf, through its engine's
control channel, as on one switch). A worker reads the beats of its own leaf through that
channel and those of every other leaf through a control channel of its own to that leaf (its
URL in the fabric's description; reads are open to anyone): one request of the leaf's ranks
per leaf every `READ_PERIOD` while works wait, so O(leaves) control requests a period, and
one beat. Every leaf's job carries the fabric's one epoch, so every rank's beats carry the
same mark.

The rules are the one-switch rules (`host.liveness`), with the world for the job: a rank
whose beat (with this run's mark) has not moved for `DEAD_AFTER` seconds while another
rank's, on any leaf, moved meanwhile is gone; a read sent more than `READ_GAP` seconds after
its leaf's previous answer, or a stall of this worker's engine, starts the watch of that
leaf (or of every leaf) again. The error (`NetaggRankGone`, its `ranks` the ranks of the
fabric's job: the world ranks, or hierarchical the nodes) names each gone rank by its world
rank (and node), its rank at its leaf, the leaf and the job (the switch job: a node's local
worker i watches, and is watched, in the job's job + i).
"""

from __future__ import annotations

import dataclasses
import math
import time

from netagg.contract import regmap as R
from netagg.host.control import ControlChannel
from netagg.host.errors import NetaggRankGone
from netagg.host.liveness import (
    READ_GAP,
    READ_PERIOD,
    STUCK_AFTER,
    Gone,
    Liveness,
    Seen,
    absent_ranks,
    gone_ranks,
    take_beats,
)


@dataclasses.dataclass
class LeafWatch:
    """The heartbeats of one leaf's ranks as this worker reads them: the leaf's index and
    name, its first world rank, its ranks, the channel that reads it, and what was seen (by
    rank at the leaf)."""

    leaf: int
    name: str
    first: int
    workers: int
    control: ControlChannel
    own: bool = False               # this worker's leaf (its engine's channel)
    reading: bool = False
    last_answer: float = -math.inf
    seen: dict[int, Seen] = dataclasses.field(default_factory=dict)
    gone: list[Gone] = dataclasses.field(default_factory=list)     # world ranks


class FabricLiveness(Liveness):
    """One worker's heartbeat in its leaf and its watch over every rank of the world (see
    the module's docstring). `placement`: the worker's (`host.fabric.Placement`); `leaf`:
    its leaf's name; `watches`: one `LeafWatch` per leaf (`add_leaf`)."""

    def __init__(self, control, *, placement, leaf: str, **kw):
        super().__init__(control, rank=placement.leaf_rank, workers=placement.leaf_workers,
                         **kw)
        self.placement, self.leaf = placement, leaf
        self.watches: list[LeafWatch] = [
            LeafWatch(placement.leaf, leaf, placement.first, placement.leaf_workers, control,
                      own=True)]

    def add_leaf(self, leaf: int, name: str, first: int, workers: int,
                 control: ControlChannel):
        """Watch another leaf's ranks through `control`, a channel of this worker's to it."""
        self.watches.append(LeafWatch(leaf, name, first, workers, control))
        self.watches.sort(key=lambda w: w.leaf)

    @property
    def remote(self) -> list[LeafWatch]:
        return [w for w in self.watches if not w.own]

    def close(self):
        """Close the channels to the other leaves."""
        for w in self.remote:
            w.control.transport.close()

    # --- the engine's step ------------------------------------------------------------------

    def watch(self, engine, now: float):
        self._take_remote(now)
        if now - self.last_step > READ_GAP:
            self._restart()             # this worker stalled: not a watch
        self.last_step = now
        waiting = engine.pending_works > 0
        if now >= self.next_beat or (waiting and now >= self.next_read):
            self.step(now, engine.joined and waiting)
        if self.gone and waiting and now - engine.last_progress >= STUCK_AFTER:
            p = self.placement
            raise NetaggRankGone(
                f"{self.describe()}; {p.me(self.leaf)} of "
                f"{p.world} waits: {engine.stuck()}", self.job,
                tuple(g.rank for g in self.gone))

    def _take_remote(self, now: float):
        """The answers the other leaves' channels have (without waiting), and their late
        requests sent again."""
        for w in self.remote:
            for datagram in w.control.transport.recv(0.0):
                w.control.take_answer(datagram)
            w.control.retransmit(now)

    def step(self, now: float, watching: bool):
        if now >= self.next_beat:
            self._beat(now)
        if watching and now >= self.next_read:
            self.next_read = now + READ_PERIOD
            for w in self.watches:
                if not w.reading:
                    self._read_leaf(w, now)
            self.reading = all(w.reading for w in self.watches)

    def _read_leaf(self, w: LeafWatch, now: float):
        w.reading = True
        self.stats["beat_reads"] += 1

        def answer(records):
            w.reading = False
            self.reading = False
            self.judge_leaf(w, now, time.monotonic(), [v for _, v in records])
        w.control.request_async([(R.beat_reg(self.job, r), 0) for r in range(w.workers)],
                                answer)

    def start(self, tag: int, epoch: int | None = None):
        super().start(tag)
        self._restart()

    def _restart(self):
        self.seen.clear()
        for w in self.watches:
            w.seen.clear()
            w.gone = []
        self.gone = []

    # --- judging ----------------------------------------------------------------------------

    def judge(self, sent: float, answered: float, beats: list[int]):
        """The beats of this worker's own leaf (as `Liveness.judge` takes them)."""
        self.judge_leaf(self.watches[[w.own for w in self.watches].index(True)], sent,
                        answered, beats)

    def judge_leaf(self, w: LeafWatch, sent: float, answered: float, beats: list[int]):
        """Take leaf `w`'s `beats` (by rank at the leaf) from a read sent at `sent` and
        answered at `answered`, and name the world's ranks gone (`gone`)."""
        if len(beats) != w.workers:
            return                      # not an answer to the read
        if sent - w.last_answer > READ_GAP:
            w.seen.clear()
        w.last_answer = answered
        take_beats(w.seen, beats, answered)
        newest = max(s.since for v in self.watches for s in v.seen.values())   # any leaf's
        w.gone = gone_ranks(w.seen, sent, self.mark, newest, w.first, self.placement.rank)
        self.gone = [g for v in self.watches for g in v.gone]
        if self.gone:
            self.stats["ranks_gone"] = len(self.gone)

    def absent(self) -> tuple[list[int], list[int]]:
        """From each leaf's last read: the world's ranks that have not joined this run, and
        those whose worker closed."""
        unjoined, closed = [], []
        for w in self.watches:
            u, c = absent_ranks(w.seen, self.mark, w.first, self.placement.rank)
            unjoined += u
            closed += c
        return sorted(unjoined), sorted(closed)

    def describe(self) -> str:
        """The gone ranks: world rank (and node, hierarchical), rank at its leaf, the leaf,
        and how long their beats stood still."""
        where = {w.first + r: (r, w.name) for w in self.watches for r in range(w.workers)}
        p = self.placement
        names = ", ".join(p.who(g.rank, *where[g.rank], ", its worker closed" if g.closed else "")
                          for g in self.gone)
        leaves = sorted({where[g.rank][1] for g in self.gone})
        silent = ", ".join(f"{g.silent:.1f} s" for g in self.gone)
        return (f"rank{'s' if len(self.gone) > 1 else ''} {names} of job {self.job} gone: "
                f"heartbeats in {', '.join(leaves)} still for {silent} while the other ranks' "
                f"moved")

