"""The protocol engine: one piece of code between tensors and any transport, for one worker
of one switch job (`job`, `rank`, `workers`).

It deals every submitted tensor's messages over the job's slots (`host.messages`: messages,
slots, message sequence numbers, loss budget and priority), starts a slot's next use when
the credits allow, sends each contribution with its check lane (`host.checklane`: the check
lane, and the rounds that fill in a chunk short of contributions) by the path the sprayer
picks, sends again what is late (`host.retransmit`: timeouts from measured round trips),
takes each result the check lane shows to be its use's, and delivers the sums into the
tensor (`host.taking`: the receiving half). Control requests share its transport, PSNs and
round-trip estimate (`host.control`).

- **A step.** Each `step` receives what arrived, starts every slot that may start, sends
  their contributions as one batch (`host.wire_arrays.ContributionWriter`: headers as
  arrays, a block's chunks quantised at once), sends again what is late, and writes the
  sums of the chunks completed into their tensors; the costs that do not depend on the
  packet count are paid once a step, not once a packet.

- **Credits.** The engine keeps the job's credit limit L (a running total: the job's
  CREDITS, then, from every result of the job, max(L, the result's BTH.psn unwrapped near
  L)) and starts a message only if msn < L (CREDITS 0: no limit). The switch drops anything
  beyond it (`drop_credit`); the engine never sends it.
- **Joining.** A rank other than 0 sends nothing until rank 0 has configured the job for
  this session: with works pending, it reads the job's configuration by control requests
  and writes its entry (`host.job_setup.JoinCheck`) until it is; works submitted before are
  dealt then. The configuration
  gives the engine its `JobKeys` (`host.session`): the key its contributions carry and the
  tag its results must.
- **Retransmission.** A message without its result after the retransmission timeout is
  sent again: the switch counts a duplicate, or, if the use is complete, sends the result
  again to this worker alone. Which use of its slot a result is, the check lane tells
  (`host.checklane`). A message is sent again before its timeout when a message sent after
  it got its result, or when nothing in flight is answered for a probe timeout
  (`host.retransmit.RecentAnswer`; off with `Recovery.TIMERS`).
- **Spraying.** With a transport of several paths (source UDP ports), each contribution,
  first sending or retransmission, leaves by the path the `Sprayer` picks (round robin, or
  the path with the fewest contributions awaiting their result). Every packet names its
  job, slot, version and offset, and slots are independent, so the order in which the switch
  sees them does not matter: reordering across paths costs neither correctness nor a
  retransmission. Control requests leave by path 0, where the answers come back.
- **Overflow.** A result with the overflow flag (or a worker's saturation marker in the
  check lane) is redone whole with the exponent plus one for fixed point, and is an
  `OverflowError` for int32 (so is an int32 sum filled in over rounds beyond int32).
- **NaN and infinities.** A chunk of a block agreed non-finite goes in two rounds, its kinds
  then its finite values, never droppable (`host.nonfinite`).
- **Liveness.** The engine beats its rank's heartbeat in the switch and, while works wait,
  watches the others' (`host.liveness`): a rank whose process is gone fails the waiting
  works within 2 s with `NetaggRankGone`, naming it. It also watches the switch: a switch
  that has answered nothing (no result, no control answer) for 2 s while the engine kept
  asking fails them with `NetaggSwitchGone`, naming its address and its last answer.
- **Unreachable.** A send the OS refuses because the way to the switch is gone (no route,
  the link down: `host.transport`) fails the engine at once with `NetaggUnreachable`,
  naming this rank, its job, the switch and the OS's reason.
- **Bounded waiting.** When no result and no control answer arrives for `timeout` seconds
  while work is pending, `step` raises `NetaggTimeout`, saying whether the switch still
  answers control requests (then a peer is missing, and the ranks whose heartbeat shows
  they have not joined this run are named) or not.

Cost: per worker, one packet of state per slot in flight, and per tensor one exponent per
block and its quantised lanes while it is in flight. `step` is non-blocking beyond its
`timeout` argument.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import numerics as N
from netagg.host import transport as T
from netagg.host.checklane import MEMBERSHIP_MAX_WORKERS, CheckLane, poke_delay
from netagg.host.control import ControlChannel, PsnCounter
from netagg.host.errors import NetaggError, NetaggTimeout, NetaggUnreachable
from netagg.host.job_setup import JoinCheck
from netagg.host.liveness import Liveness, SwitchWatch
from netagg.host.messages import (
    DEFAULT_PRIORITY,
    GIVE_UP_CLASS,
    Dealer,
    Message,
    MessageKind,
    Send,
    SlotState,
    Work,
    messages_of,
    plan_droppable,
)
from netagg.host.nonfinite import Phase
from netagg.host.retransmit import RecentAnswer, Recovery, RttEstimator
from netagg.host.session import JobKeys
from netagg.host.taking import Taking
from netagg.host.window import PlainWindow
from netagg.host.wire_arrays import ContributionWriter

__all__ = ["Engine", "JoinCheck", "Work", "NetaggError", "NetaggTimeout", "DEFAULT_PRIORITY",
           "plan_droppable"]

_DSCP = [W.priority_dscp(c) for c in range(R.PRIORITY_CLASSES)]   # by priority class


def _shared(part: str, name: str) -> property:
    """An attribute of one of the engine's parts, read and set through the engine."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value))


class Engine(Taking):
    """One worker's side of one switch job: `submit` works, `step` until they are done;
    `control` is its control channel, `stats` its counters."""

    def __init__(self, transport, *, job: int, rank: int, workers: int, slots: int | None,
                 qpn: int = 0x100, session_tag: int = 0, timeout: float = 20.0,
                 lanes: int = N.LANES, rto_initial: float = 0.2, rto_min: float = 0.05,
                 rto_max: float = 1.0, spray: str = "round_robin", credits: int = 0,
                 quorum: int = 0, recovery: Recovery = Recovery.EARLY):
        self.transport = transport
        self.sprayer = T.Sprayer(getattr(transport, "paths", 1), spray)
        self.job, self.rank, self.workers = job, rank, workers
        self.qpn, self.session_tag = qpn, session_tag
        self.key = 0                    # the R_Key of its contributions (`set_job`)
        self.lanes = lanes              # data lanes of every packet of the job
        self.rtt = RttEstimator(rto_initial, rto_min, rto_max)
        # packets lost before their timeout (`_retransmit`)
        self.recent = RecentAnswer(sprayed=self.sprayer.paths > 1,
                                   off=Recovery(recovery) is Recovery.TIMERS)
        self.stats = collections.Counter()
        self.psns = PsnCounter()
        self.control = ControlChannel(transport, timeout=timeout, psns=self.psns,
                                      rtt=self.rtt, stats=self.stats, owner=self)
        self.check_lane = CheckLane(session_tag, job, workers)
        self.liveness = Liveness(self.control, job=job, rank=rank, workers=workers,
                                 session_tag=session_tag, stats=self.stats)
        self.switch_watch = SwitchWatch()
        self.heard = -float("inf")      # when a datagram from the switch last arrived
        self.slots: list[SlotState] = []
        self.nslots = 0
        self.prejoin: list[Work] = []   # works submitted before the slots were known
        self.dealer = Dealer()
        self.credits, self.quorum, self.limit = 0, 0, 0
        self.needed = workers
        self.joined = True              # False until rank 0 has configured the job
        self.join_check: JoinCheck | None = None
        self._join_pending = False
        self._join_next = 0.0
        self.last_progress = time.monotonic()
        self.failed: BaseException | None = None
        self.pending_works = 0
        self.writer: ContributionWriter | None = None
        self.idle: list[SlotState] = []     # slots with messages dealt and none in flight
        self.earliest = float("inf")        # no retransmission is due before this
        self.delivering: list[tuple[Message, int]] = []     # completed, sums not yet out
        self.window: PlainWindow | None = None      # the slots as arrays, while lockstep
        if slots is not None:
            self.set_job(slots, credits, quorum)

    timeout = _shared("control", "timeout")     # bounded waiting, as for a control request
    rto = _shared("rtt", "rto")
    rto_min = _shared("rtt", "rto_min")
    rto_max = _shared("rtt", "rto_max")

    def set_job(self, slots: int, credits: int = 0, quorum: int = 0, completed: int = 0,
                keys: JobKeys | None = None):
        """The job's slot count, credits, quorum and completed uses (as the switch holds
        them) and the keys of its configuration; works submitted before they were known are
        dealt now."""
        if slots < 1:
            raise NetaggError(f"job {self.job} has no slots")
        if keys is not None:
            self.session_tag, self.key = keys.tag, keys.key
            self.check_lane = CheckLane(keys.tag, self.job, self.workers)
        self.slots = [SlotState() for _ in range(slots)]
        self.nslots = slots
        self.writer = ContributionWriter(self.job, self.rank, self.transport.path_endpoints(),
                                         self.transport.switch, key=self.key)
        self.credits, self.quorum = credits, quorum
        self.needed = quorum if 0 < quorum < self.workers else self.workers
        self.limit = completed + credits        # also the reference to unwrap result PSNs
        # its beats carry this run's mark; its reads watch the configuration's epoch
        self.liveness.start(self.session_tag, None if keys is None else keys.epoch)
        prejoin, self.prejoin = self.prejoin, []
        for work in prejoin:
            self._deal(work)

    # --- submission ---------------------------------------------------------------------

    def submit(self, work: Work):
        if self.failed:
            raise self.failed
        work.remaining = work.chunks
        if self.pending_works == 0:
            self.last_progress = time.monotonic()
        self.pending_works += 1
        if not self.nslots:
            self.prejoin.append(work)
        else:
            self._deal(work)

    def _deal(self, work: Work):
        if self.check_lane.quorum_refused(self.needed, work.loss_budget):
            allows = self.check_lane.allowance(work.loss_budget)
            work.error = ValueError(
                f"job {self.job} closes a use at {self.needed} of {self.workers} contributions"
                f"; with more than {MEMBERSHIP_MAX_WORKERS} workers the missing ones cannot be "
                f"filled in, so loss_budget must allow {self.workers - self.needed} of "
                f"{self.workers} (it allows {allows})")
            work.done = True
            self.pending_works -= 1
            return
        if self.window is not None:
            if PlainWindow.takes(self, work):
                self.window.add(work)
                return
            self.window.leave()
        elif PlainWindow.takes(self, work) and PlainWindow.clean(self):
            self.window = PlainWindow(self)
            self.window.add(work)
            return
        self.dealer.deal(messages_of(work, self.nslots), self.slots)
        self.idle = [st for st in self.slots if st.inflight is None and st.queue]

    # --- one step -----------------------------------------------------------------------

    def busy(self) -> bool:
        return self.pending_works > 0 or self.control.busy()

    def step(self, timeout: float = 0.0):
        """Receive, send what is ready, retransmit what is late; wait up to `timeout`."""
        if self.failed:
            raise self.failed
        try:
            self._send_ready()
            # (with nothing left to answer, e.g. a run of the compiled step just finished
            # the last work, the step does not wait at the socket: its waiters are told now)
            wait = min(timeout, max(0.0, self._next_deadline() - time.monotonic())) \
                if self.busy() else 0.0
            datagrams = self.transport.recv(wait)
            if datagrams:
                self.heard = time.monotonic()
                self.receive(datagrams)
            self._send_ready()
            self._retransmit()
            self.deliver_sums()
            if self.window is not None and self.window.idle():
                self.window.leave()
            self._check_progress()
        except NetaggUnreachable as e:
            raise self.unreachable(e) from e.__cause__
        except NetaggError as e:
            self.failed = e
            raise

    def unreachable(self, e: NetaggUnreachable) -> NetaggUnreachable:
        """`e` naming this worker, kept as the engine's failure (its waits raise it)."""
        self.failed = e.named(self.me())
        return self.failed

    def me(self) -> str:
        """This worker, for errors: "rank 1 of job 0"."""
        return f"rank {self.rank} of job {self.job}"

    def last_answer(self) -> tuple[float, str]:
        """When the switch last answered this engine, and to what ("a beat read", "a
        contribution")."""
        at, what = self.control.answered
        return (at, what) if at >= self.heard else (self.heard, "a contribution")

    def _next_deadline(self) -> float:
        times = [self.earliest, *self.control.deadlines(), self.switch_watch.due(self)]
        if not self.joined:
            times.append(self._join_next)
        deadline = min(times)
        return deadline if deadline < float("inf") else time.monotonic() + 0.05

    # --- sending ------------------------------------------------------------------------

    def _send_ready(self):
        if not self.joined:
            self._poll_join()
            return
        if self.window is not None:
            self.window.start(time.monotonic())
            if self.window is not None:     # (it leaves before a non-finite block)
                return
        if not self.idle:
            return
        idle, self.idle = dict.fromkeys(self.idle), []
        started = []
        credits, limit = self.credits, self.limit
        for st in idle:
            queue = st.queue
            if st.inflight is not None or not queue:
                continue
            m = queue[0]
            msn = max(m.seq, st.last_msn + 1)
            if not m.ready() or (credits and msn >= limit):
                if credits and msn >= limit:
                    self.stats["credit_waits"] += 1
                self.idle.append(st)
                continue
            queue.popleft()
            st.begin(m, msn)
            started.append(m)
        if not started:
            return
        tags = self.check_lane.tags([m.slot for m in started], [m.use for m in started])
        sending = [m for m, tag in zip(started, tags.tolist()) if self._start(m, tag)]
        if sending:
            self._send(sending)
            # the most packets in flight at once (only sending adds to them)
            sent = sum(1 for s in self.slots if s.inflight is not None and s.inflight.packet)
            if sent > self.stats["max_inflight"]:
                self.stats["max_inflight"] = sent

    def _start(self, m: Message, tag: int) -> bool:
        """The message's round has begun in its slot's next use, with check-lane tag `tag`:
        whether to send it now."""
        m.tag = tag
        w = m.work
        if m.needs >= 0:
            shared = w.exponents[m.needs]
            if shared == N.EXP_NONFINITE and m.phase is Phase.VALUES:     # `host.nonfinite`
                m.phase, m.droppable, m.pclass = Phase.KINDS, False, w.priority
            m.exponent = (m.finite if m.phase is Phase.FINITE else shared) + m.bump
        st = self.slots[m.slot]
        if st.early:
            early = st.take_early(m.use)
            if early is not None:
                # the use closed (a quorum) before this worker began it: what it would send
                # now could not count any more, and the result is here
                m.packet = None
                self.stats["early_results"] += 1
                self.take(st, m, early)
                return False
        m.expect = (m.use & 1, self.check_lane.whole(tag)) \
            if m.acc is None and m.phase is Phase.VALUES else None
        if m.send is Send.NOTHING:
            # this round needs other ranks' data only: wait for the result (and, if it does
            # not come, send zeros, which only asks for it)
            m.packet = None
            m.timer.deadline = time.monotonic() + poke_delay(self.rtt)
            self.earliest = min(self.earliest, m.timer.deadline)
            self.stats["waited_uses"] += 1
            return False
        return True

    def _send(self, msgs: list[Message]):
        """Send the rounds of messages just started: their lanes, check lanes sealed, and
        their packets built as one batch (the lanes of a tensor's plain rounds gathered at
        once, `Work.lanes_of`)."""
        w = msgs[0].work
        if all(m.work is w and m.plain for m in msgs):
            index = np.array([m.index for m in msgs])
            lanes, saturated = w.lanes_of(index)
            carries = np.array([m.carries for m in msgs])
            exponent = np.full(len(msgs), N.EXP_NONE, np.int64)
            if w.proposals is not None:
                exponent = np.where(carries >= 0, w.proposals[np.maximum(carries, 0)],
                                    exponent)
            offset = index * (4 * w.lanes)
        else:
            rows, saturated, fields = [], [], []
            for m in msgs:
                row, sat = m.payload()
                rows.append(row)
                saturated.append(sat)
                fields.append(m.fields())
            lanes = np.stack(rows)
            exponent, offset = zip(*fields)
        lanes[:, -1] = np.where(saturated, N.INT32_MAX,
                                self.check_lane.seal(np.array([m.tag for m in msgs]),
                                                     self.rank))
        paths = [self._pick(m) for m in msgs] if self.sprayer.paths > 1 else [0] * len(msgs)
        now = time.monotonic()
        rtt, counted = self.rtt, self.sprayer.paths > 1
        datagrams = self._datagrams(msgs, lanes, paths, exponent, offset)
        for m, datagram, path in zip(msgs, datagrams, paths):
            m.packet = datagram
            m.timer.sent(now, rtt)
            if counted or m.droppable:
                self._count_sending(m, path)
        self.transport.send_batch(datagrams, paths, [_DSCP[m.pclass] for m in msgs])
        self.stats["packets_sent"] += len(msgs)
        self.stats["bytes_sent"] += len(msgs) * len(datagram)
        self.earliest = min(self.earliest, now + rtt.rto, self.recent.probe_at(rtt, now))

    def _datagrams(self, msgs: list[Message], lanes: np.ndarray, paths: list[int],
                   exponent, offset):
        return self.writer.datagrams(
            lanes, paths=paths, slot=[m.slot for m in msgs], version=[m.use & 1 for m in msgs],
            offset=offset, msn=[m.msn for m in msgs], psn=self.psns.take(len(msgs)),
            exponent=exponent, droppable=[m.sends_droppable for m in msgs])

    def _pick(self, m: Message) -> int:
        """The path of the message's next packet (the sprayer's choice)."""
        sp = self.sprayer
        if sp.paths == 1:
            return 0
        self.path_answered(m)
        path = sp.pick()
        sp.sent(path)
        self.stats[f"packets_sent_path{path}"] += 1
        return path

    def _transmit(self, m: Message, path: int, lost: bool = False):
        """Send the message's packet in flight again, from `path` (`lost`: before its
        timeout, `RecentAnswer`'s)."""
        now = time.monotonic()
        if m.timer.sent(now, self.rtt, lost=lost):
            self.stats["retransmissions"] += 1
            self.stats["early_retransmissions"] += lost
        self.earliest = min(self.earliest, m.timer.deadline)
        self._count_sending(m, path)
        self.stats["packets_sent"] += 1
        self.stats["bytes_sent"] += len(m.packet)
        self.transport.send(m.packet, path, _DSCP[m.pclass])

    def _count_sending(self, m: Message, path: int):
        """The path and the droppable counts of a sending (packets and bytes are the
        caller's)."""
        if self.sprayer.paths > 1:
            m.path = path
        if m.sends_droppable and m.kind is MessageKind.DATA:
            m.work.droppable_sent += 1
            self.stats["droppable_sent"] += 1
            self.stats[f"droppable_sent_class{m.pclass}"] += 1

    def path_answered(self, m: Message):
        """The message's last sending was answered: its path has one packet fewer awaiting
        its result (the sprayer's count)."""
        if m.path is not None:
            self.sprayer.answered(m.path)
            m.path = None

    def _retransmit(self):
        now = time.monotonic()
        if self.window is not None and now >= self.earliest:
            self.window.resend(now)
            self.earliest = self.window.due_at()
        if self.window is None and now >= self.earliest:
            self.earliest = float("inf")
            flight = [st.inflight for st in self.slots if st.inflight is not None]
            sent = [m for m in flight if m.packet is not None]
            recent, rtt = self.recent, self.rtt
            horizon = recent.horizon(rtt)
            probe = bool(sent) and now >= recent.probe_at(rtt, max(m.timer.last_at
                                                                   for m in sent))
            if probe:           # every message in flight, once
                recent.probed = True
                self.stats["probes"] += 1
            for m in flight:
                if m.timer.due(now):
                    if m.packet is None:            # a round this rank waits out: ask
                        m.send = Send.ZEROS
                        self.stats["pokes"] += 1
                        self._send([m])
                    else:
                        self._resend(m)
                elif m.packet is not None:
                    lost = m.timer.last_at < horizon    # (a later sending's answer shows it)
                    if lost:
                        recent.found(now)
                    if lost or probe:
                        self._resend(m, lost=True)
                self.earliest = min(self.earliest, m.timer.deadline)
            if sent:
                self.earliest = min(self.earliest,
                                    recent.probe_at(rtt, max(m.timer.last_at for m in sent)))
        self.control.retransmit(now)

    def answer_heard(self, last_sent: float, now: float):
        """A packet last sent at `last_sent` got its answer at `now`: if that is the latest
        sending answered, the next step looks for the packets it shows lost."""
        if self.recent.answered(last_sent, now):
            self.earliest = -float("inf")

    def _resend(self, m: Message, lost: bool = False):
        """The message's packet in flight again (rebuilt if it leaves by another path); a
        droppable contribution's data given up: zeros in the give-up class
        (`host.messages`)."""
        if m.sends_droppable:
            m.send, m.droppable, m.pclass = Send.GIVEN_UP, False, GIVE_UP_CLASS
            self.stats["given_up"] += 1
            self._send([m])
            return
        last = m.path or 0
        path = self._pick(m)
        if path != last:
            lanes = np.frombuffer(m.packet, "<i4", self.lanes + 1, W.WRITE_IMM_HEAD_LEN)
            exponent, offset = m.fields()
            [m.packet] = self._datagrams([m], lanes[None, :], [path], [exponent], [offset])
        self._transmit(m, path, lost)

    # --- joining and bounded waiting ----------------------------------------------------

    def _poll_join(self):
        now = time.monotonic()
        if self._join_pending or now < self._join_next or not self.pending_works:
            return
        self._join_pending = True

        def answer(values):
            self._join_pending = False
            self._join_next = time.monotonic() + 0.01
            job = self.join_check.accept([v for _, v in values])
            if isinstance(job, JoinCheck):        # the next step (a write): at once
                self.join_check, self._join_next = job, time.monotonic()
            elif job:
                self.joined = True
                self.last_progress = time.monotonic()
                self.set_job(**job)
        self.control.request_async(self.join_check.records, answer, "a join check")

    def _check_progress(self):
        now = time.monotonic()
        self.liveness.watch(self, now)      # beats; raises NetaggRankGone
        self.switch_watch.watch(self, now)  # raises NetaggSwitchGone
        if self.pending_works == 0:
            return
        idle = now - self.last_progress
        if idle < self.timeout:
            return
        if not self.joined:
            raise NetaggTimeout(
                f"job {self.job} was not set up for this run within {self.timeout:.1f} s "
                f"(rank {self.rank} of {self.workers}): {self.join_check.waiting}")
        raise NetaggTimeout(
            f"no answer for {idle:.1f} s (timeout {self.timeout:.1f} s) in job {self.job} "
            f"(rank {self.rank} of {self.workers}): {self.stuck()}; "
            f"{self._diagnose()}")

    def stuck(self) -> str:
        """Which slot's use waits, and how often it was sent."""
        if self.window is not None:
            self.window.leave()             # its slots, to name what is stuck
        stuck = [s.inflight for s in self.slots if s.inflight]
        if not stuck:
            return "no slot in flight"
        m = stuck[0]
        return (f"slot {m.slot} (use {m.use}, {m.kind.value}, {m.send.value}) sent "
                f"{m.timer.attempts} times{self.lacking(m)}")

    def _diagnose(self) -> str:
        """Whether the switch still answers a control read (then a peer is missing, and
        which ranks have not joined this run, as far as their heartbeats tell)."""
        answer = self.control.probe([(R.job_counter(self.job, "contributions"), 0),
                                     (R.job_counter(self.job, "duplicates"), 0),
                                     (R.job_counter(self.job, "drop_stale"), 0)])
        if answer is None:
            return "the switch does not answer control requests either: the switch (or the " \
                   "path to it) is down"
        vals = [v for _, v in answer]
        stale = ""
        if vals[2] and self.needed < self.workers:
            stale = (f"; {vals[2]} contributions were stale: with a quorum, a worker that "
                     f"lost a result after the others moved on cannot get it back")
        return (f"the switch answers (job {self.job}: {vals[0]} contributions, {vals[1]} "
                f"duplicates counted): a peer of this job stopped contributing"
                f"{self._absent()}{stale}")

    def _absent(self) -> str:
        """Which ranks have not joined this run and which closed, from the heartbeats last
        read (`Liveness.absent`), as text ("" before any read)."""
        unjoined, closed = self.liveness.absent()
        said = []
        if unjoined:
            said.append(f"{self.name_ranks(unjoined)} "
                        f"{'has' if len(unjoined) == 1 else 'have'} not joined this run (no "
                        f"heartbeat of this run in the switch)")
        if closed:
            said.append(f"{self.name_ranks(closed)} closed "
                        f"{'its worker' if len(closed) == 1 else 'their workers'}")
        if not said:
            return ""
        return ": " + "; ".join(said)

    def counters(self) -> dict:
        return dict(self.stats)
