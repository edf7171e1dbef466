"""The fuzzer's spine mode (`sim.fuzz`, `netagg fuzz --spine`): a switch built as a spine
(`hw.switch.Switch(spine=True)`) against `sim.golden_spine.GoldenSpine`.

`SpineTraffic` is the fuzzer's good traffic (`sim.fuzz_traffic.Traffic`) as leaves send it
to a spine (docs/leafspine.md): its jobs enabled with CONFIG.partials, their workers the
leaves (QPN UPLINK_QPN), and each contribution a leaf's partial: IPv4 DSCP PARTIAL_DSCP,
BTH.dqpn 0, never droppable, BTH.psn a `PARTIAL` of a random count (0..3), now and then
marked `overflow`, `resent` (the spine pulls the leaves missing from a use it leaves in
progress) or `final` (it completes the use as it is); a leaf's partial to a use is left
out now and then (`skip`), so that uses stay in progress, resent partials pull, and a later
use of the copy gives one up (`abandoned`); a job's msns jump ahead now and then (`jumps`:
2^15 and more, as a spine whose uplink was down sees them, up to 2^31), while the
retransmissions of older frames are late partials of uses left behind; and a fifth of the
partials come in by another port than their leaf's entry (`drop_bad_worker`, a spoofed
leaf). `PartialMutator` adds to the fuzzer's mutations
one that sets a PARTIAL field of a contribution's BTH.psn.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np

from netagg.contract import headers as H
from netagg.contract import wire as W
from netagg.sim.fuzz_mutations import Field, Mutator, get_field, repair_icrc, set_field
from netagg.sim.fuzz_traffic import SWITCH, Frame, Kind, Member, Traffic

# The PARTIAL fields of a contribution's BTH.psn, where they are on the wire.
PARTIAL_FIELDS = [Field(f"partial.{name}", 8 * (H.BTH_OFFSET + H.BTH.byte_offset("psn")) + pos,
                        width)
                  for name, pos, width in H.PARTIAL.field_offsets()]


class SpineTraffic(Traffic):
    """Good traffic to a spine: leaves' partials (see the module's docstring)."""

    config = {"partials": 1}
    qpn = W.UPLINK_QPN
    skip = 0.15
    jumps = 0.15

    def _configure(self, job: int, members: list[Member], base: int, count: int, credits: int,
                   quorum: int) -> Iterator[Frame]:
        """A spine's job as the hosts set it up half of the time (CREDITS 0: the leaves hold
        the credit, and the msns' jumps reach the copies); else as one switch's."""
        credits = 0 if self.rng.random() < 0.5 else credits
        yield from super()._configure(job, members, base, count, credits, quorum)

    def _contribution(self, m: Member, slot: int, use: int, count: int, lanes: np.ndarray,
                      exponent: int) -> Frame:
        rng = self.rng
        psn = W.pack_imm(W.PARTIAL, count=rng.randint(0, 3), overflow=int(rng.random() < 0.05),
                         resent=int(rng.random() < 0.2), final=int(rng.random() < 0.08))
        packet = W.contribution(job=m.job, rank=m.rank, slot=slot, version=use % 2,
                                offset=slot * 4 * self.lanes, lanes=lanes.tobytes(), psn=psn,
                                src=m.endpoint, dst=SWITCH, exponent=exponent,
                                msn=self._msn(m.job, use, count, slot), key=m.key,
                                dscp=W.PARTIAL_DSCP, dqpn=0)
        port = rng.randrange(self.ports) if rng.random() < 0.2 else m.port
        return Frame(port, packet.frame(), Kind.CONTRIBUTION)


class PartialMutator(Mutator):
    """The fuzzer's mutations, and one more FIELD mutation: a PARTIAL field of a
    contribution's BTH.psn (count, overflow, resent, final, reserved) set to a random
    value."""

    def _field(self, buf: bytearray) -> str:
        if buf[H.BTH_OFFSET] != W.OP_CONTRIBUTION or self.rng.random() >= 0.3:
            return super()._field(buf)
        field = self.rng.choice(PARTIAL_FIELDS)
        old = get_field(bytes(buf), field)
        if old is None:
            return f"{field.name} beyond the frame"
        value = self.rng.getrandbits(field.width)
        set_field(buf, field, value)
        if self.rng.random() < 0.9:
            repair_icrc(buf)
        return f"{field.name}={value:#x}"


def partial_of(frame: bytes) -> dict:
    """The PARTIAL fields of a contribution's BTH.psn."""
    psn = int.from_bytes(frame[H.BTH_OFFSET + 9:H.BTH_OFFSET + 12], "big")
    return W.unpack_imm(W.PARTIAL, psn)


def spine_parts(rng: random.Random, ports: int, jobs: int, max_workers: int, slots: int,
                max_payload: int, host: W.Endpoint, switch: W.Endpoint):
    """The spine mode's traffic and mutator, for `sim.fuzz.stream`."""
    traffic = SpineTraffic(rng, ports, jobs, max_workers, slots, max_payload)
    return traffic, PartialMutator(rng, ports, jobs, max_workers, host, switch, traffic.keys)
