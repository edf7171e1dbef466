"""The good traffic of the switch's fuzzer (`sim.fuzz`): frames as the host sends them.

`Traffic.epoch` releases the jobs of the epochs before (those that configured one disable
it, or the operator, which makes itself the manager in the first epoch or a later one; or
no one, for an epoch), configures one or two jobs through the control path as the host does
(`host.job_setup`: rank 0 disables the job, writes its slot range, credits and quorum,
clears the other ranks' addresses, writes its own row, enables the job and writes its
EPOCH, KEY and every rank's R_Key, then each other rank writes its row; the first epoch also
the switch's own addresses; a second job's range sometimes overlaps the first's), then
sends several uses of each of their slots by every worker, with the job's key (versions
alternating, MSN use * slots + slot, random int32 lanes below 2**24 so that sums do not
saturate, workers in random order, some droppable with a random priority, some on another
port than their own, a few sent again: duplicates, replays, stale messages), with now and
then a worker's heartbeat (a running count written to its BEAT register), a worker's read
of its job's heartbeats, and writes to the jobs' registers and rows from addresses that own
neither them nor the switch (`FOREIGN`, or another job's worker) among them, and ends with
`reads`: control requests that read every register and counter of `register_names`. Every
frame is a `Frame`, tagged with the `Kind` that made it. A frame sent again may be one of an
earlier epoch of its job, whose key is no longer the job's. `Traffic.keys` holds each job's
(key, tag) of the epoch, for the mutations.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Iterator

import numpy as np

from netagg.contract import regmap as R
from netagg.contract import wire as W

SWITCH = W.Endpoint("10.0.0.1", W.ROCEV2_PORT, 0x02AA00000001)
HOST = W.Endpoint("10.0.255.254", 0xD000, 0x02BB000000FE)     # where register reads come from
FOREIGN = W.Endpoint("10.66.0.9", 0xD100, 0x02CC00000009)      # a host that owns no job
OPERATOR = W.Endpoint("10.0.255.250", 0xD200, 0x02BB000000FA)  # the manager, once it is one


# How far a job's msns jump ahead at a use, with `Traffic.jumps`: past a 16-bit copy's
# window (2^15 .. 2^16 and beyond) and near a 32-bit one's (2^31).
MSN_JUMPS = (0x8000, 0xC000, 0x10000, 0x1C000, 0x7FFF_FF00, 0x8000_0000)


class Kind(enum.Enum):
    """What made a frame of the stream."""

    CONTROL = "control"              # good: configuration, as the host writes it
    CONTRIBUTION = "contribution"    # good
    RESEND = "resend"                # good, sent again: a duplicate, a replay or stale
    READ = "read"                    # good: a read of the registers and counters
    TICK = "tick"                    # a tick of the deadlines' clock (no frame: `data` empty)
    LINK = "link"                    # a leaf's port's link lost or back (no frame: `data` is
                                     # one byte, 1 up, 0 lost)
    FOREIGN = "foreign"              # good: writes to a job from neither its owner nor manager
    MANAGE = "manage"                # good: the operator makes itself the manager (not mutated:
                                     # a changed address would lock it out for the whole stream)
    BYTES = "bytes"                  # the mutations (`sim.fuzz_mutations`)
    BITS = "bits"
    FIELD = "field"
    PAYLOAD = "payload"
    TRUNCATE = "truncate"
    EXTEND = "extend"
    RECORDS = "records"

    @property
    def mutated(self) -> bool:
        return self not in (Kind.CONTROL, Kind.CONTRIBUTION, Kind.RESEND, Kind.READ,
                            Kind.TICK, Kind.LINK, Kind.FOREIGN, Kind.MANAGE)

    @property
    def mutable(self) -> bool:
        """Whether the stream mutates frames of this kind (reads, ticks, links and the
        manager's are left alone)."""
        return self not in (Kind.READ, Kind.TICK, Kind.LINK, Kind.MANAGE)


@dataclasses.dataclass(frozen=True)
class Frame:
    """One frame of the stream: where it goes in, its bytes, and what made it."""

    port: int
    data: bytes
    kind: Kind
    note: str = ""            # the field and value a mutation set

    @property
    def control(self) -> bool:
        """Whether the switch may take it as a control request (sent alone)."""
        return len(self.data) > W.BTH_OFFSET and self.data[W.BTH_OFFSET] == W.OP_CONTROL

    @property
    def alone(self) -> bool:
        """Whether it goes into the switches on its own: a control request, a tick or a
        link's change."""
        return self.control or self.kind in (Kind.TICK, Kind.LINK)


TICK = Frame(0, b"", Kind.TICK)


@dataclasses.dataclass
class Member:
    """A worker of a job in one epoch."""

    job: int
    rank: int
    port: int
    endpoint: W.Endpoint
    qpn: int
    rkey: int                 # the R_Key of its results (the tag), rank 0 writes it
    va: int
    key: int = 0              # the job's KEY: every contribution's RETH.rkey
    psn: int = 0
    beat: int = 0             # its heartbeat's running count

    def next_beat(self) -> int:
        self.beat = (self.beat + 1) & 0xFFFFFFFF
        return self.beat

    def next_psn(self) -> int:
        self.psn = (self.psn + 1) & 0xFFFFFF
        return self.psn


def register_names(ports: int, jobs: int, max_workers: int) -> dict[int, str]:
    """Every register a checkpoint reads, by address: the global ones, each job's and its
    ranks' heartbeats, and the port and job counters."""
    names = {a: f"global {a:#06x}" for a in range(R.REG_UPLINK_LOST + 1)}
    names |= {R.drop_threshold(c): f"drop threshold {c}" for c in range(R.PRIORITY_CLASSES)}
    names |= {R.uplink_reg(i, f): f"uplink {i} field {f}" for i in range(R.MAX_UPLINKS)
              for f in range(R.UPLINK_FIELDS)}
    for j in range(jobs):
        for field in ("CONFIG", "SLOT_BASE", "SLOT_COUNT", "CREDITS", "QUORUM", "COMPLETED",
                      "EPOCH", "KEY", "OWNER", "PARENT", "PARENT_KEY", "SPRAY"):
            names[R.job_reg(j, getattr(R, f"JOB_{field}"))] = f"job {j} {field}"
        names |= {R.job_counter(j, n): f"job {j} {n}"
                  for n in (*R.JOB_COUNTERS, *R.FABRIC_COUNTERS)}
        names |= {R.beat_reg(j, r): f"job {j} beat {r}" for r in range(max_workers)}
    for p in range(ports):
        names |= {R.port_counter(p, n): f"port {p} {n}" for n in R.PORT_COUNTERS}
    return names


def reads(ports: int, jobs: int, max_workers: int, rng: random.Random,
          psn: int = 0) -> list[Frame]:
    """Control requests that read every register of `register_names`, from the host on a
    random port."""
    addresses = list(register_names(ports, jobs, max_workers))
    port = rng.randrange(ports)
    return [Frame(port, W.control_request([(a, 0) for a in addresses[i:i + 64]], psn + i,
                                          HOST, SWITCH).frame(), Kind.READ)
            for i in range(0, len(addresses), W.MAX_CONTROL_RECORDS)]


class Traffic:
    """Good traffic, an epoch at a time (see the module's docstring). A subclass may set
    `config` (more CONFIG fields its jobs are enabled with), `qpn` (its members' QPN, else
    random) and `skip` (the chance that a member's contribution to a use is left out, so
    that the use stays in progress), and make contributions of its own (`_contribution`)."""

    config: dict = {}
    qpn: int | None = None
    skip = 0.0
    jumps = 0.0               # the chance that a job's msns jump ahead at a use (`_msn`)

    def __init__(self, rng: random.Random, ports: int, jobs: int, max_workers: int,
                 slots: int, max_payload: int):
        self.rng, self.np_rng = rng, np.random.default_rng(rng.getrandbits(64))
        self.ports, self.jobs, self.max_workers, self.slots = ports, jobs, max_workers, slots
        self.lanes = max_payload // 4
        self.epochs = 0
        self.keys: dict[int, tuple[int, int]] = {}      # job -> (key, tag) of the epoch
        self.owned: dict[int, list[W.Endpoint]] = {}  # job: who wrote its CONFIG
        # the epoch from which the operator makes itself the manager (if no one is)
        self.manager_epoch = 0 if rng.random() < 0.75 else rng.randint(1, 3)
        self.msn_jump: dict[int, tuple[int, int]] = {}     # job -> (its use, msns skipped)

    def _member(self, job: int, rank: int, key: int, tag: int) -> Member:
        rng = self.rng
        endpoint = W.Endpoint(f"10.{job + 1}.{self.epochs % 200}.{rank + 10}",
                              0xC100 + 16 * job + rank, 0x020000000000 | (job << 8) | rank)
        port, qpn = rng.randrange(self.ports), rng.randrange(1, 1 << 24)
        return Member(job, rank, port, endpoint, qpn if self.qpn is None else self.qpn, tag,
                      rng.getrandbits(64), key)

    def _control(self, m: Member, records) -> Frame:
        records = [(a | R.WRITE, v) for a, v in records]
        return Frame(m.port, W.control_request(records, m.next_psn(), m.endpoint,
                                               SWITCH).frame(), Kind.CONTROL)

    @staticmethod
    def _row(job: int, m: Member) -> list[tuple[int, int]]:
        """A worker's job-table row (its R_Key is rank 0's to write)."""
        return W.entry_records(job, m.rank, m.port, m.endpoint, m.qpn, va=m.va)

    def _configure(self, job: int, members: list[Member], base: int, count: int, credits: int,
                   quorum: int) -> Iterator[Frame]:
        """The control requests the host sends to set up a job (`host.job_setup`): rank 0
        disables it, writes its range, credits, quorum and deadline, clears the other ranks'
        addresses, writes its own row, enables it and writes its EPOCH, KEY and every rank's
        R_Key; then each other rank writes its row."""
        n = len(members)
        yield self._control(members[0], [
            (R.job_reg(job, R.JOB_CONFIG), R.CONFIG.pack(enable=0, workers=n)),
            (R.job_reg(job, R.JOB_SLOT_BASE), base), (R.job_reg(job, R.JOB_SLOT_COUNT), count),
            (R.job_reg(job, R.JOB_CREDITS), credits), (R.job_reg(job, R.JOB_QUORUM), quorum),
            (R.job_reg(job, R.JOB_DEADLINE), self.rng.choice((0, 0, 1, 2, 3)))]
            + [(R.worker_reg(job, m.rank, R.WORKER_IP), 0) for m in members[1:]]
            + self._row(job, members[0])
            + [(R.job_reg(job, R.JOB_CONFIG), R.CONFIG.pack(enable=1, workers=n, **self.config)),
               (R.job_reg(job, R.JOB_EPOCH), self.rng.getrandbits(32)),
               (R.job_reg(job, R.JOB_KEY), members[0].key)]
            + [(R.worker_reg(job, m.rank, R.WORKER_RKEY), m.rkey) for m in members])
        for m in members[1:]:
            yield self._control(m, self._row(job, m))

    def _release(self) -> Iterator[Frame]:
        """The jobs of the epochs before: disabled by those that wrote their CONFIG since
        they were last disabled (rank 0s, workers of other jobs that wrote it as foreigners:
        one is the owner, unless a mutated request enabled the job) or by the operator (the
        manager, once it made itself one), or left enabled for an epoch (then a new rank 0's
        writes are denied); and the operator disables a job at random now and then (one a
        mutation's replay of an old request enabled, say)."""
        rng = self.rng
        if self.epochs == self.manager_epoch:
            yield dataclasses.replace(self._from(OPERATOR, [(R.REG_MANAGER,
                                                             W.ip_to_int(OPERATOR.ip))]),
                                      kind=Kind.MANAGE)
        for job, writers in list(self.owned.items()):
            if rng.random() < 0.1:
                continue
            for source in writers if rng.random() < 0.6 else [OPERATOR]:
                yield self._from(source, [(R.job_reg(job, R.JOB_CONFIG), 0)])
            del self.owned[job]
        if rng.random() < 0.5:
            yield self._from(OPERATOR, [(R.job_reg(rng.randrange(self.jobs), R.JOB_CONFIG), 0)])

    def _from(self, source: W.Endpoint, records) -> Frame:
        """Writes from `source` (a worker of an epoch before, or the operator), on a random
        port."""
        return Frame(self.rng.randrange(self.ports), W.control_request(
            [(a | R.WRITE, v) for a, v in records], 0, source, SWITCH).frame(), Kind.CONTROL)

    def _foreign(self, jobs: dict) -> Frame:
        """Writes to a job's registers and rows from an address that is neither its owner's
        nor the manager's: `FOREIGN`, or a worker of another job."""
        rng = self.rng
        job = rng.choice(list(jobs))
        members, count = jobs[job]
        others = [m for j, (ms, _) in jobs.items() if j != job for m in ms]
        source = rng.choice(others) if others and rng.random() < 0.3 else None
        records = []
        for _ in range(rng.randint(1, 4)):
            offset = rng.choice((R.JOB_CONFIG, R.JOB_SLOT_BASE, R.JOB_SLOT_COUNT,
                                 R.JOB_CREDITS, R.JOB_QUORUM, R.JOB_EPOCH, R.JOB_KEY,
                                  R.JOB_DEADLINE, None))
            address = (R.job_reg(job, offset) if offset is not None else
                       R.worker_reg(job, rng.randrange(len(members)), rng.randrange(8)))
            value = rng.choice((0, 1, count, rng.getrandbits(32),
                                R.CONFIG.pack(enable=1, workers=len(members))))
            records.append((R.WRITE | address, value))
        if source is not None and any(a == R.WRITE | R.job_reg(job, R.JOB_CONFIG)
                                      for a, _ in records):
            self.owned.setdefault(job, []).append(source.endpoint)
        if source is None:
            frame = W.control_request(records, rng.getrandbits(24), FOREIGN, SWITCH).frame()
            return Frame(rng.randrange(self.ports), frame, Kind.FOREIGN)
        frame = W.control_request(records, source.next_psn(), source.endpoint, SWITCH).frame()
        return Frame(source.port, frame, Kind.FOREIGN)

    def _liveness(self, members: list[Member]) -> list[Frame]:
        """What the host's liveness sends meanwhile: a worker's heartbeat, or (less often) a
        worker's read of every heartbeat of its job."""
        rng, out = self.rng, []
        if rng.random() < 0.5:
            m = rng.choice(members)
            out.append(self._control(m, [(R.beat_reg(m.job, m.rank), m.next_beat())]))
        if rng.random() < 0.15:
            m = rng.choice(members)
            out.append(Frame(m.port, W.control_request(
                [(R.beat_reg(m.job, r), 0) for r in range(len(members))], m.next_psn(),
                m.endpoint, SWITCH).frame(), Kind.READ))
        return out

    def _msn(self, job: int, use: int, count: int, slot: int) -> int:
        """The msn of `use` of `slot` of a job of `count` slots: use * count + slot, and, with
        `jumps`, the messages the job skipped before it: at a use of the job, with chance
        `jumps`, as many as another switch took meanwhile (2^15 and more: a spine back after
        its uplink was down) or far more (2^31: as far behind as ahead)."""
        if self.jumps:
            last, skipped = self.msn_jump.get(job, (use, 0))
            if use != last and self.rng.random() < self.jumps:
                skipped += self.rng.choice(MSN_JUMPS)
            self.msn_jump[job] = use, skipped
            return (use * count + slot + skipped) & 0xFFFFFFFF
        return use * count + slot

    def _contribution(self, m: Member, slot: int, use: int, count: int, lanes: np.ndarray,
                      exponent: int) -> Frame:
        rng = self.rng
        marks = {}
        if rng.random() < 0.2:
            marks = dict(droppable=True, dscp=W.priority_dscp(rng.randrange(8)))
        packet = W.contribution(job=m.job, rank=m.rank, slot=slot, version=use % 2,
                                offset=slot * 4 * self.lanes, lanes=lanes.tobytes(),
                                psn=m.next_psn(), src=m.endpoint, dst=SWITCH,
                                exponent=exponent, msn=self._msn(m.job, use, count, slot),
                                key=m.key, **marks)
        port = rng.randrange(self.ports) if rng.random() < 0.2 else m.port
        return Frame(port, packet.frame(), Kind.CONTRIBUTION)

    def epoch(self) -> Iterator[Frame]:
        rng = self.rng
        if self.epochs == 0:      # the switch's own addresses, as the host writes them
            yield Frame(0, W.control_request(
                [(R.WRITE | R.REG_IP, W.ip_to_int(SWITCH.ip)),
                 (R.WRITE | R.REG_MAC_HI, SWITCH.mac >> 32),
                 (R.WRITE | R.REG_MAC_LO, SWITCH.mac & 0xFFFFFFFF)], 0, HOST,
                SWITCH).frame(), Kind.CONTROL)
        yield from self._release()
        self.epochs += 1
        jobs, base = {}, rng.randrange(max(1, self.slots - 8))
        for j in rng.sample(range(self.jobs), min(self.jobs, rng.choice((1, 2)))):
            key = rng.getrandbits(32) if rng.random() < 0.9 else 0      # 0: KEY's reset
            tag = rng.getrandbits(32)
            self.keys[j] = key, tag
            members = [self._member(j, r, key, tag)
                       for r in range(rng.randint(1, min(4, self.max_workers)))]
            if jobs and rng.random() < 0.1:     # overlapping the job before: refused
                base = max(0, base - rng.randint(1, 2))
            count = min(rng.randint(1, 4), self.slots - base)
            if count < 1:
                break
            n = len(members)
            credits = rng.choice((0, count, count, 2 * count, rng.randint(1, count)))
            yield from self._configure(j, members, base, count, credits,
                                       rng.choice((0, 0, 0, rng.randint(1, n))))
            jobs[j], base = (members, count), base + count
            self.owned.setdefault(j, []).append(members[0].endpoint)
        sent = []
        for use in range(rng.randint(1, 6)):
            batch = []
            for members, count in jobs.values():
                for slot in range(count):
                    n = rng.choice((1, 2, 3, 4, 8, 16, 31, 64, 128, self.lanes))
                    for m in members:
                        if self.skip and rng.random() < self.skip:
                            continue
                        lanes = self.np_rng.integers(-(1 << 24), 1 << 24, n, dtype="<i4")
                        batch.append(self._contribution(m, slot, use, count, lanes,
                                                        rng.randint(-8, 8)))
                batch += self._liveness(members)
            rng.shuffle(batch)
            for frame in batch:
                if jobs and rng.random() < 0.03:
                    yield self._foreign(jobs)
                yield frame
                if rng.random() < 0.04:
                    yield TICK
                if sent and rng.random() < 0.05:   # a retransmission: duplicate or replay
                    yield dataclasses.replace(rng.choice(sent[-64:]), kind=Kind.RESEND)
                sent.append(frame)
        yield from reads(self.ports, self.jobs, self.max_workers, rng)
