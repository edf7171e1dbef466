"""The good traffic of the switch's fuzzer (`sim.fuzz`): frames as the host sends them.

`Traffic.epoch` configures one or two jobs through the control path as the host does (each
worker writes its job-table row, rank 0 the job's slot range, credits, quorum, CONFIG, EPOCH
and KEY and every rank's R_Key; the first epoch also the switch's own addresses), then
sends several uses of each of their slots by every worker, with the job's key (versions
alternating, MSN use * slots + slot, random int32 lanes
below 2**24 so that sums do not saturate, workers in random order, some droppable with a
random priority, some on another port than their own, a few sent again: duplicates, replays,
stale messages), with now and then a worker's heartbeat (a running count written to its
BEAT register) and a worker's read of its job's heartbeats among them, and ends with
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
from netagg.sim import wire as W

SWITCH = W.Endpoint("10.0.0.1", W.ROCEV2_PORT, 0x02AA00000001)
HOST = W.Endpoint("10.0.255.254", 0xD000, 0x02BB000000FE)     # where register reads come from


class Kind(enum.Enum):
    """What made a frame of the stream."""

    CONTROL = "control"              # good: configuration, as the host writes it
    CONTRIBUTION = "contribution"    # good
    RESEND = "resend"                # good, sent again: a duplicate, a replay or stale
    READ = "read"                    # good: a read of the registers and counters
    TICK = "tick"                    # a tick of the deadlines' clock (no frame: `data` empty)
    BYTES = "bytes"                  # the mutations (`sim.fuzz_mutations`)
    BITS = "bits"
    FIELD = "field"
    PAYLOAD = "payload"
    TRUNCATE = "truncate"
    EXTEND = "extend"
    RECORDS = "records"

    @property
    def mutated(self) -> bool:
        return self not in (Kind.CONTROL, Kind.CONTRIBUTION, Kind.RESEND, Kind.READ, Kind.TICK)


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
        """Whether it goes into the switches on its own: a control request, or a tick."""
        return self.control or self.kind is Kind.TICK


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
    names = {a: f"global {a:#06x}" for a in range(W.REG_PORT + 1)}
    names |= {W.drop_threshold(c): f"drop threshold {c}" for c in range(W.PRIORITY_CLASSES)}
    for j in range(jobs):
        for field in ("CONFIG", "SLOT_BASE", "SLOT_COUNT", "CREDITS", "QUORUM", "COMPLETED",
                      "EPOCH", "KEY"):
            names[W.job_reg(j, getattr(W, f"JOB_{field}"))] = f"job {j} {field}"
        names |= {W.job_counter(j, n): f"job {j} {n}" for n in W.JOB_COUNTERS}
        names |= {W.beat_reg(j, r): f"job {j} beat {r}" for r in range(max_workers)}
    for p in range(ports):
        names |= {W.port_counter(p, n): f"port {p} {n}" for n in W.PORT_COUNTERS}
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
    """Good traffic, an epoch at a time (see the module's docstring)."""

    def __init__(self, rng: random.Random, ports: int, jobs: int, max_workers: int,
                 slots: int, max_payload: int):
        self.rng, self.np_rng = rng, np.random.default_rng(rng.getrandbits(64))
        self.ports, self.jobs, self.max_workers, self.slots = ports, jobs, max_workers, slots
        self.lanes = max_payload // 4
        self.epochs = 0
        self.keys: dict[int, tuple[int, int]] = {}      # job -> (key, tag) of the epoch

    def _member(self, job: int, rank: int, key: int, tag: int) -> Member:
        rng = self.rng
        endpoint = W.Endpoint(f"10.{job + 1}.{self.epochs % 200}.{rank + 10}",
                              0xC100 + 16 * job + rank, 0x020000000000 | (job << 8) | rank)
        return Member(job, rank, rng.randrange(self.ports), endpoint, rng.randrange(1, 1 << 24),
                      tag, rng.getrandbits(64), key)

    def _control(self, m: Member, records) -> Frame:
        records = [(a | W.WRITE, v) for a, v in records]
        return Frame(m.port, W.control_request(records, m.next_psn(), m.endpoint,
                                               SWITCH).frame(), Kind.CONTROL)

    def _configure(self, job: int, members: list[Member], base: int, count: int, credits: int,
                   quorum: int) -> Iterator[Frame]:
        """The control requests the host sends to set up a job (`host.worker`)."""
        for m in members:
            e = m.endpoint
            yield self._control(m, [
                (W.worker_reg(job, m.rank, W.WORKER_PORT),
                 W.WORKER_ENDPOINT.pack(switch_port=m.port, udp_port=e.port)),
                (W.worker_reg(job, m.rank, W.WORKER_MAC_HI), e.mac >> 32),
                (W.worker_reg(job, m.rank, W.WORKER_MAC_LO), e.mac & 0xFFFFFFFF),
                (W.worker_reg(job, m.rank, W.WORKER_IP), W.ip_to_int(e.ip)),
                (W.worker_reg(job, m.rank, W.WORKER_QPN), m.qpn),
                (W.worker_reg(job, m.rank, W.WORKER_VA_HI), m.va >> 32),
                (W.worker_reg(job, m.rank, W.WORKER_VA_LO), m.va & 0xFFFFFFFF)])
        yield self._control(members[0], [
            (W.job_reg(job, W.JOB_SLOT_BASE), base), (W.job_reg(job, W.JOB_SLOT_COUNT), count),
            (W.job_reg(job, W.JOB_CREDITS), credits), (W.job_reg(job, W.JOB_QUORUM), quorum),
            (W.job_reg(job, W.JOB_DEADLINE), self.rng.choice((0, 0, 1, 2, 3))),
            (W.job_reg(job, W.JOB_CONFIG), W.CONFIG.pack(enable=1, workers=len(members))),
            (W.job_reg(job, W.JOB_EPOCH), self.rng.getrandbits(32)),
            (W.job_reg(job, W.JOB_KEY), members[0].key)]
            + [(W.worker_reg(job, m.rank, W.WORKER_RKEY), m.rkey) for m in members])

    def _liveness(self, members: list[Member]) -> list[Frame]:
        """What the host's liveness sends meanwhile: a worker's heartbeat, or (less often) a
        worker's read of every heartbeat of its job."""
        rng, out = self.rng, []
        if rng.random() < 0.5:
            m = rng.choice(members)
            out.append(self._control(m, [(W.beat_reg(m.job, m.rank), m.next_beat())]))
        if rng.random() < 0.15:
            m = rng.choice(members)
            out.append(Frame(m.port, W.control_request(
                [(W.beat_reg(m.job, r), 0) for r in range(len(members))], m.next_psn(),
                m.endpoint, SWITCH).frame(), Kind.READ))
        return out

    def _contribution(self, m: Member, slot: int, use: int, count: int, lanes: np.ndarray,
                      exponent: int) -> Frame:
        rng = self.rng
        marks = {}
        if rng.random() < 0.2:
            marks = dict(droppable=True, dscp=W.priority_dscp(rng.randrange(8)))
        packet = W.contribution(job=m.job, rank=m.rank, slot=slot, version=use % 2,
                                offset=slot * 4 * self.lanes, lanes=lanes.tobytes(),
                                psn=m.next_psn(), src=m.endpoint, dst=SWITCH,
                                exponent=exponent, msn=use * count + slot, key=m.key,
                                **marks)
        port = rng.randrange(self.ports) if rng.random() < 0.2 else m.port
        return Frame(port, packet.frame(), Kind.CONTRIBUTION)

    def epoch(self) -> Iterator[Frame]:
        rng = self.rng
        if self.epochs == 0:      # the switch's own addresses, as the host writes them
            yield Frame(0, W.control_request(
                [(W.WRITE | W.REG_IP, W.ip_to_int(SWITCH.ip)),
                 (W.WRITE | W.REG_MAC_HI, SWITCH.mac >> 32),
                 (W.WRITE | W.REG_MAC_LO, SWITCH.mac & 0xFFFFFFFF)], 0, HOST,
                SWITCH).frame(), Kind.CONTROL)
        self.epochs += 1
        jobs, base = {}, rng.randrange(max(1, self.slots - 8))
        for j in rng.sample(range(self.jobs), min(self.jobs, rng.choice((1, 2)))):
            key = rng.getrandbits(32) if rng.random() < 0.9 else 0      # 0: KEY's reset
            tag = rng.getrandbits(32)
            self.keys[j] = key, tag
            members = [self._member(j, r, key, tag)
                       for r in range(rng.randint(1, min(4, self.max_workers)))]
            count = min(rng.randint(1, 4), self.slots - base)
            if count < 1:
                break
            n = len(members)
            credits = rng.choice((0, count, count, 2 * count, rng.randint(1, count)))
            yield from self._configure(j, members, base, count, credits,
                                       rng.choice((0, 0, 0, rng.randint(1, n))))
            jobs[j], base = (members, count), base + count
        sent = []
        for use in range(rng.randint(1, 6)):
            batch = []
            for members, count in jobs.values():
                for slot in range(count):
                    n = rng.choice((1, 2, 3, 4, 8, 16, 31, 64, 128, self.lanes))
                    for m in members:
                        lanes = self.np_rng.integers(-(1 << 24), 1 << 24, n, dtype="<i4")
                        batch.append(self._contribution(m, slot, use, count, lanes,
                                                        rng.randint(-8, 8)))
                batch += self._liveness(members)
            rng.shuffle(batch)
            for frame in batch:
                yield frame
                if rng.random() < 0.04:
                    yield TICK
                if sent and rng.random() < 0.05:   # a retransmission: duplicate or replay
                    yield dataclasses.replace(rng.choice(sent[-64:]), kind=Kind.RESEND)
                sent.append(frame)
        yield from reads(self.ports, self.jobs, self.max_workers, rng)
