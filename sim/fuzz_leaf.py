"""The fuzzer's leaf mode (`sim.fuzz`, `netagg fuzz --leaf`): a switch built with uplinks
(`hw.switch.Switch(uplinks=UPLINKS)`) against `sim.golden_leaf.GoldenLeaf`, on its local
workers' traffic: the upward half of a leaf (docs/leafspine.md), uses that complete locally
and go up as partials (UPSTREAM), re-sent on a retransmission, and held back when every
uplink is down.

`LeafTraffic` is the fuzzer's good traffic (`sim.fuzz_traffic.Traffic`) with the uplink
table written first (uplink i leaves by port i + 1, to spine i's MAC, IP and UDP port), each
job given a parent most of the time (rank 0 writes its PARENT with a random rank,
PARENT_KEY and a random SPRAY after its set-up), and REG_UPLINK_DOWN written now and then
(by the operator, the manager once it is one: every uplink down too). No spine answers: a
use that went up stays UPSTREAM, and its workers' retransmissions re-send its partial.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from netagg.sim import wire as W
from netagg.sim.fuzz_mutations import Mutator
from netagg.sim.fuzz_traffic import HOST, OPERATOR, SWITCH, Frame, Kind, Member, Traffic

UPLINKS = 2


def spine_endpoint(i: int) -> W.Endpoint:
    """Spine i, the other end of uplink i."""
    return W.Endpoint(f"10.200.0.{i + 1}", W.ROCEV2_PORT, 0x02DD00000000 | i)


class LeafTraffic(Traffic):
    """Good traffic to a leaf's local workers' jobs (see the module's docstring)."""

    def _uplink_table(self) -> Frame:
        records = []
        for i in range(UPLINKS):
            spine = spine_endpoint(i)
            records += [(W.uplink_reg(i, W.UPLINK_PORT), (i + 1) % self.ports),
                        (W.uplink_reg(i, W.UPLINK_MAC_HI), spine.mac >> 32),
                        (W.uplink_reg(i, W.UPLINK_MAC_LO), spine.mac & 0xFFFFFFFF),
                        (W.uplink_reg(i, W.UPLINK_IP), W.ip_to_int(spine.ip)),
                        (W.uplink_reg(i, W.UPLINK_UDP_PORT), spine.port)]
        return Frame(0, W.control_request([(W.WRITE | a, v) for a, v in records], 0, HOST,
                                          SWITCH).frame(), Kind.CONTROL)

    def _configure(self, job: int, members: list[Member], *args) -> Iterator[Frame]:
        yield from super()._configure(job, members, *args)
        rng = self.rng
        if rng.random() < 0.85:
            spray = W.spray_word([rng.randrange(W.MAX_UPLINKS) for _ in range(W.SPRAY_ENTRIES)])
            yield self._control(members[0], [
                (W.job_reg(job, W.JOB_PARENT_KEY), rng.getrandbits(32)),
                (W.job_reg(job, W.JOB_SPRAY), spray),
                (W.job_reg(job, W.JOB_PARENT), W.PARENT.pack(enable=1,
                                                             rank=rng.randrange(32)))])

    def epoch(self) -> Iterator[Frame]:
        rng = self.rng
        if self.epochs == 0:
            yield self._uplink_table()
        for frame in super().epoch():
            yield frame
            if frame.kind is Kind.CONTRIBUTION and rng.random() < 0.03:
                down = rng.choice((0, 0, 1, 2, (1 << UPLINKS) - 1, (1 << UPLINKS) - 1))
                yield Frame(rng.randrange(self.ports), W.control_request(
                    [(W.WRITE | W.REG_UPLINK_DOWN, down)], 0, OPERATOR, SWITCH).frame(),
                    Kind.CONTROL)


def leaf_parts(rng: random.Random, ports: int, jobs: int, max_workers: int, slots: int,
               max_payload: int, host: W.Endpoint, switch: W.Endpoint):
    """The leaf mode's traffic and mutator, for `sim.fuzz.stream`."""
    traffic = LeafTraffic(rng, ports, jobs, max_workers, slots, max_payload)
    return traffic, Mutator(rng, ports, jobs, max_workers, host, switch, traffic.keys)
