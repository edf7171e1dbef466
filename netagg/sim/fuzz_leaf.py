"""The fuzzer's leaf mode (`sim.fuzz`, `netagg fuzz --leaf`): a switch built with uplinks
(`hw.switch.Switch(uplinks=UPLINKS)`) against `sim.golden_leaf.GoldenLeaf`, on its local
workers' traffic and a fake spine's: the upward half of a leaf (docs/leafspine.md), uses
that complete locally and go up as partials (UPSTREAM), re-sent on a retransmission, and
held back when every uplink is down; and its downward half, the spine's results (DONE) and
pulls.

`LeafTraffic` is the fuzzer's good traffic (`sim.fuzz_traffic.Traffic`) with the uplink
table written first (uplink i leaves by port i + 1, to spine i's MAC, IP and UDP port), each
job given a parent most of the time (rank 0 writes its PARENT with a random rank,
PARENT_KEY and a random SPRAY after its set-up), REG_UPLINK_DOWN written now and then
(by the operator, the manager once it is one: every uplink down too), and now and then an
uplink's port (or another) losing its link or getting it back (`Kind.LINK`, to both
switches' `set_link`). A fake spine answers
now and then (`_parent_result`): a result of a recent use, from an uplink's spine by its
port (now and then by another), RETH.rkey the job's PARENT_KEY, RESULT_IMM a random count,
exponent and overflow, and sums of the use's length (now and then of another); the leaf
takes it when the use went up (DONE: its result to every local worker), and counts
`drop_parent` else. A third of them are pulls (no payload): the leaf answers a use gone up
or done with its partial or its final. A use not answered stays UPSTREAM, and its workers'
retransmissions re-send its partial. A job's msns jump ahead now and then (`jumps`, 2^15 and
more: stale at a leaf's copy, which compares 16 bits), and a fifth of the jobs take partials
too (`PARTIALS`: CONFIG.partials written after the set-up; the whole msns compared, a
contribution taken only from its rank's entry's port).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.codec import ResultTemplate, result_imm
from netagg.sim.fuzz_mutations import Mutator
from netagg.sim.fuzz_traffic import HOST, OPERATOR, SWITCH, Frame, Kind, Member, Traffic

UPLINKS = 2
ANSWERS = 0.12        # a fake spine's results and pulls per contribution
PULLS = 0.3           # of which pulls
PARTIALS = 0.2        # jobs that take partials too (a spine's job on a leaf's gateware)


def spine_endpoint(i: int) -> W.Endpoint:
    """Spine i, the other end of uplink i."""
    return W.Endpoint(f"10.200.0.{i + 1}", W.ROCEV2_PORT, 0x02DD00000000 | i)


class LeafTraffic(Traffic):
    """Good traffic to a leaf's local workers' jobs (see the module's docstring)."""

    jumps = 0.1

    def __init__(self, *args):
        super().__init__(*args)
        self.parent_keys: dict[int, int] = {}     # job -> its PARENT_KEY
        # the recent uses (job, version, slot, msn, offset, length), as the workers sent them
        self.uses: list[tuple[int, int, int, int, int, int]] = []

    def _contribution(self, m: Member, slot: int, use: int, count: int, lanes: np.ndarray,
                      exponent: int) -> Frame:
        one = (m.job, use % 2, slot, self._msn(m.job, use, count, slot), slot * 4 * self.lanes,
               4 * len(lanes))
        if one not in self.uses[-8:]:
            self.uses = self.uses[-15:] + [one]
        return super()._contribution(m, slot, use, count, lanes, exponent)

    def _parent_result(self) -> Frame:
        """A fake spine's result or pull of a recent use (see the module's docstring)."""
        rng = self.rng
        job, version, slot, msn, offset, length = rng.choice(self.uses[-8:])
        pull = rng.random() < PULLS
        if rng.random() < 0.1:
            length = 4 * rng.randint(1, self.lanes)
        if pull:
            length = 0
        u = rng.randrange(UPLINKS)
        spine = spine_endpoint(u)
        key = self.parent_keys.get(job, 0) if rng.random() < 0.95 else rng.getrandbits(32)
        port = (u + 1) % self.ports if rng.random() < 0.9 else rng.randrange(self.ports)
        lanes = self.np_rng.integers(-(1 << 30), 1 << 30, length // 4, dtype="<i4")
        imm = result_imm(job, 0, version, slot, 0, 0) if pull else \
            result_imm(job, rng.randrange(64), version, slot, rng.randint(-8, 8),
                       int(rng.random() < 0.1))
        template = ResultTemplate((spine.mac, W.ip_to_int(spine.ip), spine.port),
                                  (SWITCH.mac, W.ip_to_int(SWITCH.ip), SWITCH.port),
                                  W.UPLINK_QPN, key, length)
        return Frame(port, template.frame(rng.getrandbits(24), W.contribution_va(msn, offset),
                                          imm, lanes.tobytes()), Kind.CONTRIBUTION)

    def _uplink_table(self) -> Frame:
        records = [record for i in range(UPLINKS)
                   for record in W.uplink_records(i, (i + 1) % self.ports, spine_endpoint(i))]
        return Frame(0, W.control_request([(R.WRITE | a, v) for a, v in records], 0, HOST,
                                          SWITCH).frame(), Kind.CONTROL)

    def _configure(self, job: int, members: list[Member], *args) -> Iterator[Frame]:
        yield from super()._configure(job, members, *args)
        rng = self.rng
        if rng.random() < 0.85:
            self.parent_keys[job] = rng.getrandbits(32)
            spray = R.spray_word([rng.randrange(R.MAX_UPLINKS) for _ in range(R.SPRAY_ENTRIES)])
            yield self._control(members[0], [
                (R.job_reg(job, R.JOB_PARENT_KEY), self.parent_keys[job]),
                (R.job_reg(job, R.JOB_SPRAY), spray),
                (R.job_reg(job, R.JOB_PARENT), R.PARENT.pack(enable=1,
                                                             rank=rng.randrange(32)))])
        if rng.random() < PARTIALS:
            yield self._control(members[0], [(R.job_reg(job, R.JOB_CONFIG), R.CONFIG.pack(
                enable=1, partials=1, workers=len(members)))])

    def epoch(self) -> Iterator[Frame]:
        rng = self.rng
        if self.epochs == 0:
            yield self._uplink_table()
        for frame in super().epoch():
            yield frame
            if frame.kind is Kind.CONTRIBUTION and self.uses and rng.random() < ANSWERS:
                yield self._parent_result()
            if frame.kind is Kind.CONTRIBUTION and rng.random() < 0.03:
                down = rng.choice((0, 0, 1, 2, (1 << UPLINKS) - 1, (1 << UPLINKS) - 1))
                yield Frame(rng.randrange(self.ports), W.control_request(
                    [(R.WRITE | R.REG_UPLINK_DOWN, down)], 0, OPERATOR, SWITCH).frame(),
                    Kind.CONTROL)
            if frame.kind is Kind.CONTRIBUTION and rng.random() < 0.02:
                # an uplink's port (now and then another) loses its link, or gets it back
                port = (rng.randrange(UPLINKS) + 1) % self.ports if rng.random() < 0.9 else \
                    rng.randrange(self.ports)
                yield Frame(port, bytes([rng.random() < 0.6]), Kind.LINK)


def leaf_parts(rng: random.Random, ports: int, jobs: int, max_workers: int, slots: int,
               max_payload: int, host: W.Endpoint, switch: W.Endpoint):
    """The leaf mode's traffic and mutator, for `sim.fuzz.stream`."""
    traffic = LeafTraffic(rng, ports, jobs, max_workers, slots, max_payload)
    return traffic, Mutator(rng, ports, jobs, max_workers, host, switch, traffic.keys)
