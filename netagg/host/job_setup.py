"""How the workers of a run set up their switch job under the switch's write rules
(`netagg.contract.regmap`): an enabled job's registers take writes only from its owner (the address
whose request enabled it) and the switch's manager, its worker entries also from the address each
holds (or anyone's while it holds none), an enabled job's slot range is fixed, and no two
enabled jobs share a slot.

1. Rank 0 configures the job (`claim`, while its `Worker` is made) with 17 + 2 x ranks
   records (a leaf's 2 more; a spine's 7 more per leaf but the first), in requests of
   MAX_CONTROL_RECORDS (64), in order. It disables the job, writes its slot range,
   credits, quorum, deadline and PARENT (0 but for a fabric's leaf: a CONFIG write does not
   clear it, and a job left with a parent would send its uses up; a switch without uplinks
   ignores the write), clears every other rank's entry's address, writes its own entry,
   enables the job (whose owner its address becomes), and writes the epoch it drew, the
   job's key; then, once no copy of those requests can reach the switch again (a copy sent
   again after a lost answer would clear the other ranks' entries and the slots after they
   began: `ControlChannel.request`'s `settle`), every rank's R_Key (the tag:
   `host.session`), which the other ranks wait for. Another owner refuses every
   record: `NetaggError` naming the job and the owner's address, at once; so does a slot
   range that overlaps an enabled job's (read first, and refused by the switch if another
   job took it meanwhile) or runs past the switch's slots.
2. Each other rank, once it reads an epoch whose tag is its entry's R_Key on the enabled job
   and its entry holding no address (cleared by that configuration), writes its entry (the
   switch takes it: the entry holds no address, then this rank's) and joins with the keys of
   that epoch (`JoinCheck`s of `host.engine`, polled while it has work). An entry that holds
   an address it did not write this run is an earlier run's: the rank waits for its rank 0's
   configuration to clear it, so that it does not join a job an earlier run of the same
   session left enabled. A refused write is a `NetaggError` naming the owner.

In a leaf and spine fabric (`host.fabric_setup`) the same steps set up each switch's job: a
spine's by the world's rank 0 (its "ranks" are the leaves, whose entries it writes itself,
`partials` set, their R_Keys the job's KEY, which a leaf checks on the spine's frames), a
leaf's by the leaf's first rank, with its parent (`parent`: JOB_PARENT; `extra`:
JOB_PARENT_KEY, JOB_SPRAY) and the epoch the spines were configured with (`epoch`: one
epoch, so one key and one tag, for the whole fabric's job). Errors name the switch
(`switch`).

A job stays its owner's until the owner (or the manager) writes its CONFIG: the next run's
rank 0 from the same address configures it again, one from another address is refused. A
rank that finds its job enabled by someone else waits (its rank 0 may still come) and its
timeout names the owner.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from netagg.contract import regmap as R
from netagg.host.control import ControlChannel, ip_str
from netagg.host.errors import NetaggError
from netagg.host.session import JobKeys, fresh_epoch

Pairs = list[tuple[int, int]]


@dataclasses.dataclass
class JoinCheck:
    """How a rank learns that its job is set up for this run (`host.engine` polls it while
    the rank has work): the control `records` to send, and `accept(values)` of their
    answers: None to send them again, the next `JoinCheck` (a write, say), or the
    `Engine.set_job` arguments (or it raises `NetaggError`); `waiting` says what it waits
    for (the timeout's message)."""

    records: Pairs
    accept: Callable[[list[int]], JoinCheck | dict | None] | None
    waiting: str = "its job to be set up"


@dataclasses.dataclass
class JobView:
    """What a read of a job's registers shows of its use of the switch."""

    job: int
    enabled: bool
    base: int
    count: int
    owner: int

    def overlaps(self, base: int, count: int) -> bool:
        return bool(self.count and count and self.base < base + count
                    and base < self.base + self.count)

    def text(self) -> str:
        return (f"job {self.job}'s slots {self.base}..{self.base + self.count - 1} (enabled by "
                f"{ip_str(self.owner)})")


VIEW_FIELDS = (R.JOB_CONFIG, R.JOB_SLOT_BASE, R.JOB_SLOT_COUNT, R.JOB_OWNER)


def slot_range(params: dict, job: int, slots: int | None, slot_base: int | None,
               local_rank: int = 0) -> tuple[int, int]:
    """A job's slot range (base, count) on a switch of `params` (`control.read_params`):
    `slots` from `slot_base` as asked, else the switch's slots dealt evenly over its jobs.
    Hierarchical, local worker `local_rank`'s switch job (the run's job + `local_rank`) takes
    the range after its node's lower local workers' (`slot_base` + `local_rank` counts), so
    that a node's jobs never share a slot."""
    per_job = params["slots"] // params["jobs"]
    count = per_job if slots is None else slots
    return (job * per_job if slot_base is None else slot_base + local_rank * count, count)


def view_records(jobs) -> Pairs:
    return [(R.job_reg(j, f), 0) for j in jobs for f in VIEW_FIELDS]


def views(jobs, values) -> list[JobView]:
    """The `JobView`s of `jobs` from the values of their `view_records`."""
    n = len(VIEW_FIELDS)
    return [JobView(j, bool(values[n * i] >> 31), values[n * i + 1], values[n * i + 2],
                    values[n * i + 3]) for i, j in enumerate(jobs)]


def refused(pairs: Pairs, values) -> list[int]:
    """The addresses of the writes (address, value) whose answer (`values`, in order) is not
    the value written."""
    return [a for (a, v), back in zip(pairs, values) if back != v & 0xFFFFFFFF]


@dataclasses.dataclass
class JobSetup:
    """One rank's side of setting up switch job `job` of `workers` ranks (see the module's
    docstring): the run's `session` (its keys: `host.session`), the rank's own entry
    (`entry`, its R_Key excluded: rank 0 writes every rank's), and for rank 0 the job's slot
    range, credits, quorum and deadline (ticks)."""

    control: ControlChannel
    job: int
    rank: int
    workers: int
    session: str
    entry: Pairs
    switch_jobs: int
    switch_slots: int
    base: int = 0
    count: int = 0
    credits: int = 0
    quorum: int = 0
    deadline: int = 0
    epoch: int | None = None        # the epoch to configure with (None: a fresh one)
    parent: int = 0                 # JOB_PARENT (a leaf's job in a fabric; 0: none)
    extra: Pairs = dataclasses.field(default_factory=list)  # written before CONFIG enables
    partials: bool = False          # a spine's job: its contributions are leaves' partials
    switch: str = ""                # the switch's name in errors ("" for a lone switch)

    @property
    def config(self) -> int:
        return self._config(enable=1)

    def _config(self, enable: int) -> int:
        if self.partials:
            return R.CONFIG.pack(enable=enable, workers=self.workers, partials=1)
        return R.CONFIG.pack(enable=enable, workers=self.workers)

    @property
    def at(self) -> str:
        """Where the job is, for errors: " at NAME" in a fabric."""
        return f" at {self.switch}" if self.switch else ""

    def _rkey(self, rank: int) -> int:
        return R.worker_reg(self.job, rank, R.WORKER_RKEY)

    def _reg(self, offset: int) -> int:
        return R.job_reg(self.job, offset)

    # --- rank 0 -------------------------------------------------------------------------

    def claim(self) -> JobKeys:
        """Rank 0: the job set up and enabled for this run, its address the owner; the keys
        of the epoch it drew. Or NetaggError."""
        j, base, count, at = self.job, self.base, self.count, self.at
        if count < 1 or base + count > self.switch_slots:
            raise NetaggError(f"job {j}{at}: slots {base}..{base + count - 1} are not inside "
                              f"the switch's {self.switch_slots}")
        others = [k for k in range(self.switch_jobs) if k != j]
        clash = self._clash(views(others, self._read(view_records(others))))
        if clash:
            raise NetaggError(f"job {j}{at}: its slots {base}..{base + count - 1} overlap "
                              f"{clash}: pass slot_base= and slots= of a free range, or another "
                              f"job")
        keys = JobKeys.derive(self.session, j, self.epoch or fresh_epoch())
        setup = ([(self._reg(R.JOB_CONFIG), self._config(enable=0)),
                  (self._reg(R.JOB_SLOT_BASE), base), (self._reg(R.JOB_SLOT_COUNT), count),
                  (self._reg(R.JOB_CREDITS), self.credits),
                  (self._reg(R.JOB_QUORUM), self.quorum),
                  (self._reg(R.JOB_DEADLINE), self.deadline),
                  (self._reg(R.JOB_PARENT), self.parent)]
                 + [(R.worker_reg(j, r, R.WORKER_IP), 0) for r in range(1, self.workers)]
                 + self.entry + self.extra
                 + [(self._reg(R.JOB_CONFIG), self.config),   # clears slots and COMPLETED
                    (self._reg(R.JOB_EPOCH), keys.epoch), (self._reg(R.JOB_KEY), keys.key)])
        go = [(self._rkey(r), keys.key if self.partials else keys.tag)
              for r in range(self.workers)]
        pairs = setup + go
        # 17 + 2 x workers records and the extra ones (a spine's entries: 7 a leaf), in
        # requests of MAX_CONTROL_RECORDS, in order. The R_Keys, which the other ranks wait
        # for before they write their entries and contribute, go only once no copy of the
        # set-up can reach the switch again (`settle`: a copy applied after them would clear
        # their entries and slots); the KEY reads back 0.
        answers = (self._read([(a | R.WRITE, v) for a, v in setup], settle=True)
                   + self._read([(a | R.WRITE, v) for a, v in go]
                                + [(self._reg(R.JOB_OWNER), 0)]))
        if refused(pairs[:1], answers):
            raise NetaggError(
                f"job {j}{at} is enabled by {ip_str(answers[-1])}: the switch refused rank 0's "
                f"configuration of it (its CONFIG, slot range and worker entries); its owner "
                f"or the switch's manager may disable it (CONFIG 0)")
        write_only = {self._reg(R.JOB_KEY), self._reg(R.JOB_PARENT_KEY)}
        if refused([pair for pair in pairs if pair[0] not in write_only],
                   [v for (a, _), v in zip(pairs, answers) if a not in write_only]):
            clash = self._clash(views(others, self._read(view_records(others))))
            raise NetaggError(f"the switch{at} refused to enable job {j}: its slots {base}.."
                              f"{base + count - 1} overlap {clash or 'another job'}")
        return keys

    def _clash(self, others: list[JobView]) -> str:
        """The enabled jobs among `others` whose range overlaps this job's, as text."""
        return ", ".join(v.text() for v in others
                         if v.enabled and v.overlaps(self.base, self.count))

    # --- the other ranks ----------------------------------------------------------------

    def rank_check(self, expected_credits: int | None, expected_quorum: int,
                   expected_deadline: int = 0) -> JoinCheck:
        """A rank other than 0: its wait for rank 0's configuration (an epoch whose tag its
        entry's R_Key is), its entry's write, and `accept` returning `Engine.set_job`'s
        arguments, the keys derived from the epoch among them. A credit count, quorum or
        deadline (ticks) this rank asks for (not None, not 0) must be rank 0's."""
        j, r, at = self.job, self.rank, self.at
        reads = [(self._reg(R.JOB_CONFIG), 0), (self._reg(R.JOB_SLOT_COUNT), 0),
                 (self._reg(R.JOB_CREDITS), 0), (self._reg(R.JOB_QUORUM), 0),
                 (self._reg(R.JOB_COMPLETED), 0), (self._reg(R.JOB_EPOCH), 0),
                 (self._rkey(r), 0), (R.worker_reg(j, r, R.WORKER_IP), 0),
                 (self._reg(R.JOB_OWNER), 0), (self._reg(R.JOB_DEADLINE), 0)]
        check = JoinCheck(reads, None, f"job {j}{at} was not configured for this run by its rank 0")
        ip = next(v for a, v in self.entry if a == R.worker_reg(j, r, R.WORKER_IP))
        written = []                    # this rank wrote its entry into this run's job

        def look(values):
            cfg, n, cred, quo, completed, epoch, rkey, held, owner, deadline = values
            keys = JobKeys.derive(self.session, j, epoch)
            enabled = bool(cfg >> 31)
            if rkey != keys.tag or not enabled:     # not (yet) configured by this session
                check.waiting = (f"job {j}{at} was not configured for this run by its rank 0"
                                 + (f" (it is enabled by {ip_str(owner)})" if enabled else ""))
                return None
            if not (written and held == ip):
                if held == 0:           # the entry, then the reads again: one round trip
                    return JoinCheck([(a | R.WRITE, v) for a, v in self.entry] + reads, wrote,
                                     check.waiting)
                check.waiting = (f"job {j}{at} was not configured for this run by its rank 0 "
                                 f"(rank {r}'s entry holds {ip_str(held)}, an earlier run's)")
                return None
            if cfg != self.config:
                raise NetaggError(f"job {j}{at} was configured as {cfg:#x} by rank 0 of this "
                                  f"session, this worker expects {self.config:#x}")
            if (expected_credits is not None and cred != expected_credits) or \
                    (expected_quorum and quo != expected_quorum) or \
                    (expected_deadline and deadline != expected_deadline):
                raise NetaggError(f"job {j}{at} was configured with credits={cred}, "
                                  f"quorum={quo}, deadline={deadline} ticks by rank 0 of this "
                                  f"session, rank {r} expects credits={expected_credits}, "
                                  f"quorum={expected_quorum}, deadline={expected_deadline}")
            return {"slots": n, "credits": cred, "quorum": quo, "completed": completed,
                    "keys": keys}

        def wrote(answers):
            if refused(self.entry, answers):
                raise NetaggError(f"job {j}{at} is enabled by {ip_str(answers[-1])}: the switch "
                                  f"refused rank {r}'s worker entry")
            written.append(True)
            return look(answers[len(self.entry):]) or check
        check.accept = look
        return check

    def _read(self, pairs: Pairs, settle: bool = False) -> list[int]:
        return [v for _, v in self.control.request(pairs, settle=settle)]
