"""Liveness: which ranks of a job are gone, told from their heartbeats in the switch (the BEAT
registers, `netagg.contract.regmap`), so that the ranks waiting on them learn it within 2 s, by
rank; and whether the switch itself still answers, so that a switch that is gone is named as fast.

- **Beating.** Every worker's engine writes its rank's heartbeat every `BEAT_PERIOD` seconds
  while the worker is open, whether it has work or not (its background progress does, or,
  in process, whoever drives the engines): the run's mark and a running count (8 bits,
  1..255 again and again), in one control request of one record, through the engine's
  control channel (its PSNs, its retransmission). A beat still unanswered when the next is
  due is forgotten: the next one stands for it. The mark is 24 bits of the run's tag
  (`host.session`: a keyed hash of the session, the job and the epoch rank 0 drew for this
  run), known to rank 0 when it configures the job and to the others when they join it
  (`start`, which beats at once); until then a worker beats with the mark 0.
- **Watching.** A worker with works pending reads the beats of every rank of its job (one
  request) every `READ_PERIOD` seconds, one read at a time. For each rank it keeps the value
  and since when it has read it (`Seen`, on its own clock: when the answer came).
- **Judging.** A rank whose beat has not moved for `DEAD_AFTER` seconds while another rank's
  (this worker's own included) moved meanwhile is gone (`Gone`): its process stopped, not
  merely its contributions. A rank that is only slow (a long backward pass, rank 0 writing a
  checkpoint while the others wait for minutes) keeps beating and is never gone. A beat
  without this run's mark (0 after a reset, a rank that has not joined yet, or one an
  earlier run left, of the same session string or not) is a rank that has not beaten in
  this run: it is still starting, and the bounded wait (`timeout`) covers it. Only time
  this worker watched counts: the watch starts again when a read is sent more than
  `READ_GAP` seconds after the previous answer (no works waited meanwhile), or when this
  worker's engine did not step for that long (it was stalled, or nobody drove it: the
  others may have been too, and beat again only now). A switch slow to answer does not
  restart it: it delays every rank's beats alike.
- **Closing.** A worker that closes says so: its last beat has the run's mark and the count
  0 (`closing`, retransmitted until answered, for at most `CLOSING_WAIT` seconds). A rank
  that finished its allreduces and closed may still be needed by one that waits for a
  result the switch holds (a lost result comes back as a replay when the waiting rank
  retransmits, which can take longer than `DEAD_AFTER` under loss), so a closed rank is
  gone only after `CLOSED_AFTER` seconds: a rank that closed before contributing is named
  within seconds, a finished one leaves the others to their replays.
- **The switch** (`SwitchWatch`). A worker with works waiting asks the switch something
  every `BEAT_PERIOD` at least (its beat, and its reads), and the switch answers each request
  and each contribution. When it has answered nothing (no control answer, no result) for
  `SILENT_AFTER` seconds while this worker was asking (a request has waited at least
  `SILENT_AFTER / 2` of them), the switch, or the path to it, is down (`NetaggSwitchGone`,
  naming its address, this rank and job, the silence and the last answer: "the last answer
  was to a beat read 2.0 s ago"). A switch slow under load answers late, but answers, and
  every answer starts the silence again. The watch starts again as the ranks' does: when
  works begin to wait, and when this worker's engine did not step for `READ_GAP` seconds (a
  stalled process hears nothing and asks nothing meanwhile).
- **A job taken over.** The read of the beats reads the job's epoch and owner too. An epoch
  other than this run's means another run configured the job (a new session on the same job
  after a crash, say), and every contribution of this run now counts as a bad key: the
  waiting works fail at once with `NetaggJobTakenOver`, naming the job, the new owner's
  address and this rank, within a read of the new configuration.
- **Who never came.** A rank whose last-read beat lacks this run's mark has not joined the
  run (`absent`): the bounded wait's error names it ("rank 2 has not joined this run"),
  and names the ranks whose last beat says their worker closed.

`watch`, a step of the engine's, fails its waiting works with `NetaggRankGone` once a rank
is gone and its own works have made no progress for `STUCK_AFTER` seconds (with a quorum,
works that complete without the rank go on). The first read shows a rank's beat as new, so
the verdict comes between `DEAD_AFTER` and `DEAD_AFTER + 2 READ_PERIOD` seconds after the
rank's last beat. The engine's `SwitchWatch.watch` fails them with `NetaggSwitchGone`
`SILENT_AFTER` seconds after the switch's last answer.

Cost: per worker, one control request of one record every `BEAT_PERIOD`, and while works
are pending one of `workers` records every `READ_PERIOD`; nothing per packet or per step
beyond a comparison of a few times.
"""

from __future__ import annotations

import dataclasses
import math
import time

from netagg.contract import regmap as R
from netagg.host.control import ip_str
from netagg.host.errors import NetaggError, NetaggJobTakenOver, NetaggRankGone, NetaggSwitchGone

BEAT_PERIOD = 0.25      # seconds between a worker's heartbeats
READ_PERIOD = 0.25      # seconds between reads of the job's heartbeats while works wait
DEAD_AFTER = 1.5        # seconds a beat stands still, while others move, for its rank to be gone
CLOSED_AFTER = 5.0      # the same for a rank whose last beat says it closed
CLOSING_WAIT = 0.5      # seconds a closing worker waits for its last beat's answer
READ_GAP = 1.0          # a read sent this long after the last answer starts the watch again
COUNT_BITS = 8          # a beat: the run's mark above, the running count in these bits
MARK = (1 << (32 - COUNT_BITS)) - 1
STUCK_AFTER = 0.5       # seconds without progress before a gone rank fails the works
SILENT_AFTER = 1.5      # seconds without an answer, while asking, for the switch to be gone


@dataclasses.dataclass
class Seen:
    """A rank's heartbeat as this worker last read it, and since when (its clock) it reads so."""

    value: int
    since: float


@dataclasses.dataclass(frozen=True)
class Gone:
    """A rank whose heartbeat stood still for `silent` seconds while others' moved (`closed`:
    its last beat said its worker closed)."""

    rank: int
    silent: float
    closed: bool = False


def take_beats(seen: dict[int, Seen], beats: list[int], answered: float):
    """Note each rank's beat (by rank) in `seen`, read at `answered`: a changed value is
    seen from then on."""
    for rank, value in enumerate(beats):
        s = seen.get(rank)
        if s is None or s.value != value:
            seen[rank] = Seen(value, answered)


def gone_ranks(seen: dict[int, Seen], sent: float, mark: int, newest: float, first: int = 0,
               me: int = -1) -> list[Gone]:
    """The ranks among `seen` (by rank, world rank `first + rank`) gone at a read sent at
    `sent`: this run's `mark`, still for `DEAD_AFTER` (`CLOSED_AFTER` after a closing beat)
    while a beat moved at `newest`; `me` is not judged."""
    out = []
    for rank, s in seen.items():
        if first + rank == me or s.value >> COUNT_BITS != mark or newest <= s.since:
            continue
        closed = s.value & ((1 << COUNT_BITS) - 1) == 0
        if sent - s.since >= (CLOSED_AFTER if closed else DEAD_AFTER):
            out.append(Gone(first + rank, sent - s.since, closed))
    return out


def absent_ranks(seen: dict[int, Seen], mark: int, first: int = 0,
                 me: int = -1) -> tuple[list[int], list[int]]:
    """The ranks among `seen` (world rank `first + rank`; `me` left out) whose beat is not
    of this run's `mark` (they have not joined it), and those whose beat says their worker
    closed."""
    unjoined = sorted(first + r for r, s in seen.items()
                      if first + r != me and s.value >> COUNT_BITS != mark)
    closed = sorted(first + r for r, s in seen.items()
                    if first + r != me and s.value >> COUNT_BITS == mark
                    and not s.value & ((1 << COUNT_BITS) - 1))
    return unjoined, closed


class Liveness:
    """One worker's heartbeat and its watch over the other ranks of its switch job."""

    def __init__(self, control, *, job: int, rank: int, workers: int, session_tag: int,
                 stats):
        self.control, self.stats = control, stats
        self.job, self.rank, self.workers = job, rank, workers
        self.mark = session_tag & MARK or 1     # on this run's beats (`start`); 0: no run's
        self.count = 0                  # the last beat's running count
        # the first beat is due once this rank's entry is in the job (`start`): the switch
        # takes a rank's beat from the address its entry holds alone
        self.next_beat = math.inf
        self.beat_psn: int | None = None    # the beat awaiting its answer
        self.next_read = 0.0
        self.reading = False            # a read awaits its answer
        self.last_answer = -math.inf    # when the last read was answered
        self.last_step = math.inf       # when the engine last stepped (`watch`)
        self.seen: dict[int, Seen] = {}
        self.gone: list[Gone] = []
        self.epoch: int | None = None   # this run's configuration's (`start`)
        self.taken: tuple[int, int] | None = None   # (epoch, owner) of another run's

    @property
    def next_due(self) -> float:
        """When `step` next has something to do (a beat; a read, while watching and no read
        awaits its answer: the control channel's own deadlines see to that one)."""
        return self.next_beat if self.reading else min(self.next_beat, self.next_read)

    def beat_due(self, now: float) -> bool:
        return now >= self.next_beat

    def watch(self, engine, now: float):
        """The engine's step: beat and read when it is time; raise `NetaggRankGone` when a
        rank is gone and the engine's works have made no progress for `STUCK_AFTER`."""
        if now - self.last_step > READ_GAP:
            self.seen.clear()           # this worker stalled: not a watch
            self.gone = []
        self.last_step = now
        waiting = engine.pending_works > 0
        if now >= self.next_beat or (waiting and now >= self.next_read):
            self.step(now, engine.joined and waiting)
        if self.taken and waiting:
            epoch, owner = self.taken
            by = f"enabled by {ip_str(owner)}" if owner else "now disabled"
            raise NetaggJobTakenOver(
                f"job {self.job} was configured again by another run (epoch {epoch:#010x}, "
                f"{by}) while rank {self.rank} of {self.workers} of this run used it: this "
                f"run's contributions no longer count", self.job, epoch, owner)
        if self.gone and waiting and now - engine.last_progress >= STUCK_AFTER:
            raise NetaggRankGone(f"{self.describe()}; rank {self.rank} of {self.workers} "
                                 f"waits: {engine.stuck()}", self.job,
                                 tuple(g.rank for g in self.gone))

    def step(self, now: float, watching: bool):
        """Beat if it is time; with `watching` (works wait), read the job's beats if it is
        time and no read is awaiting its answer."""
        if now >= self.next_beat:
            self._beat(now)
        if watching and not self.reading and now >= self.next_read:
            self._read(now)

    def start(self, tag: int, epoch: int | None = None):
        """This run's tag is known (rank 0 configured the job, or this rank joined it), and
        its configuration's `epoch` (None: not watched): the beats carry its mark from now
        on, the first at once (before any contribution), and the watch starts afresh."""
        self.mark = tag & MARK or 1
        self.epoch, self.taken = epoch, None
        self.seen.clear()
        self.gone = []
        self._beat(time.monotonic())

    def keep_beating(self):
        """The heartbeat of a worker whose engine failed (the worker is open, its process
        there): beat when it is time, and take the control answers that arrived (anything
        else is dropped). A beat that cannot be sent (the switch unreachable) is skipped:
        the engine's error says so already."""
        now = time.monotonic()
        try:
            if now >= self.next_beat:
                self._beat(now)
            for datagram in self.control.transport.recv(0.0):
                self.control.take_answer(datagram)
            self.control.retransmit(now)
        except NetaggError:
            self.next_beat = now + BEAT_PERIOD

    def _beat(self, now: float):
        self.count = self.count % ((1 << COUNT_BITS) - 1) + 1
        self._write_beat(self.mark << COUNT_BITS | self.count)
        self.next_beat = now + BEAT_PERIOD
        self.stats["beats"] += 1

    def _write_beat(self, value: int):
        if self.beat_psn is not None:
            self.control.forget(self.beat_psn)
        self.beat_psn = self.control.request_async(
            [(R.WRITE | R.beat_reg(self.job, self.rank), value)], self._beaten, "a beat write")

    def closing(self):
        """The worker closes: a last beat with the count 0, retransmitted until the switch
        answers or for `CLOSING_WAIT` seconds (a worker that never beat says nothing; a
        switch that does not answer leaves the others the 1.5 s verdict)."""
        if not self.count:
            return
        if self.beat_psn is not None:
            self.control.forget(self.beat_psn)
            self.beat_psn = None
        answered, deadline = [], time.monotonic() + CLOSING_WAIT
        try:                            # (only this channel's answers: no engine steps)
            self.control.request_async([(R.WRITE | R.beat_reg(self.job, self.rank),
                                         self.mark << COUNT_BITS)], answered.append,
                                       "a closing beat")
            while not answered and time.monotonic() < deadline:
                for datagram in self.control.transport.recv(0.01):
                    self.control.take_answer(datagram)
                self.control.retransmit(time.monotonic())
        except Exception:               # (closing never fails: the switch may be gone)
            pass

    def _beaten(self, records):
        self.beat_psn = None

    def _read(self, now: float):
        self.reading = True
        self.next_read = now + READ_PERIOD
        self.stats["beat_reads"] += 1

        def answer(records):
            self.reading = False
            values = [v for _, v in records]
            if self.epoch is not None and len(values) == self.workers + 2:
                epoch, owner = values[-2:]
                if epoch != self.epoch:
                    self.taken = (epoch, owner)
                values = values[:-2]
            self.judge(now, time.monotonic(), values)
        config = [] if self.epoch is None else [(R.job_reg(self.job, R.JOB_EPOCH), 0),
                                                (R.job_reg(self.job, R.JOB_OWNER), 0)]
        self.control.request_async(
            [(R.beat_reg(self.job, r), 0) for r in range(self.workers)] + config, answer,
            "a beat read")

    def judge(self, sent: float, answered: float, beats: list[int]):
        """Take the job's `beats` (by rank) from a read sent at `sent` and answered at
        `answered` (this worker's clock), and name the ranks gone (`gone`)."""
        if len(beats) != self.workers:
            return                      # not an answer to the read (counted as ignored)
        if sent - self.last_answer > READ_GAP:
            self.seen.clear()
        self.last_answer = answered
        take_beats(self.seen, beats, answered)
        newest = max(s.since for s in self.seen.values())
        self.gone = gone_ranks(self.seen, sent, self.mark, newest, me=self.rank)
        if self.gone:
            self.stats["ranks_gone"] = len(self.gone)

    def absent(self) -> tuple[list[int], list[int]]:
        """From the last read: the ranks that have not joined this run, and those whose
        worker closed (`absent_ranks`)."""
        return absent_ranks(self.seen, self.mark, me=self.rank)

    def describe(self) -> str:
        """The gone ranks, for an error: which, and how long their beats stood still."""
        ranks = ", ".join(str(g.rank) + (" (its worker closed)" if g.closed else "")
                          for g in self.gone)
        silent = ", ".join(f"{g.silent:.1f} s" for g in self.gone)
        if len(self.gone) == 1:
            return (f"rank {ranks} of job {self.job} is gone: its heartbeat in the switch has "
                    f"not moved for {silent} while the other ranks' did")
        return (f"ranks {ranks} of job {self.job} are gone: their heartbeats in the switch "
                f"have not moved for {silent} while the other ranks' did")


class SwitchWatch:
    """Whether the switch still answers one worker's engine (see the module): `watch`, a
    step of the engine's, raises `NetaggSwitchGone` once it has answered nothing for
    `SILENT_AFTER` seconds of watching while the engine was asking."""

    def __init__(self):
        self.since = math.inf           # when the watch began
        self.last_step = -math.inf      # when the engine last stepped

    def due(self, engine) -> float:
        """When the switch, silent since, would be named gone (the engine steps then, not
        at its next retransmission, which may be a second away)."""
        if engine.pending_works == 0 or engine.control.asking is None:
            return math.inf
        answered, _ = engine.last_answer()
        return max(answered, self.since, engine.control.asking - SILENT_AFTER / 2) \
            + SILENT_AFTER

    def watch(self, engine, now: float):
        waiting = engine.pending_works > 0
        if not waiting or now - self.last_step > READ_GAP:
            self.since = now            # nothing waits, or this worker stalled: not a watch
        self.last_step = now
        if not waiting:
            return
        answered, what = engine.last_answer()
        silent = now - max(answered, self.since)
        asking = engine.control.asking
        if silent < SILENT_AFTER or asking is None or now - asking < SILENT_AFTER / 2:
            return
        switch = engine.transport.switch
        address = f"{switch.ip}:{switch.port}"
        last = (f"the last answer was to {what} {now - answered:.1f} s ago"
                if answered > -math.inf else "it never answered")
        raise NetaggSwitchGone(
            f"the switch at {address} is gone: {engine.me()} has had no answer from it for "
            f"{silent:.1f} s while asking ({last}); the switch, or the path to it, is down",
            address, engine.job, engine.rank, silent)
