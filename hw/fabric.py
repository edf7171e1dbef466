"""The switch's place in a fabric of leaves and spines (docs/leafspine.md), as gateware
parameters, and what the stages add for it.

`Fabric(spine=..., uplinks=...)` is what a `hw.switch.Switch` is built as: `spine`, its jobs
may take leaves' partials (CONFIG.partials: a contribution's data count is its
PARTIAL.count, a `final` partial completes the use as it is, a later use of a copy in
progress gives the use up, a `resent` partial pulls the leaves missing from the use, and
results carry the use's CONTRIBUTION_VA); `uplinks` (0..MAX_UPLINKS), a leaf's. With neither
(`NO_FABRIC`, every board) no stage adds a signal: the netlist is a single switch's.

What the stages add when the switch is a spine: the job table's CONFIG.partials bit
(`job_layout`); the decide stage's events (`SPINE_EVENTS`, counted as FABRIC_COUNTERS); the
result descriptor's `pull` (a payload-less result to the leaves missing from a use) and the
use's msn, which a spine's results and pulls carry in RETH.va (`descriptor_fields`); and the
egress ports' count of pulls sent (`pulls`, like `results`).
"""

from __future__ import annotations

import dataclasses

from amaranth.lib import data

from . import regmap as R

# The decide stage's events of a spine's job, each counted by the FABRIC_COUNTER of its name.
SPINE_EVENTS = ("finals", "abandoned")
# The FABRIC_COUNTERS counted from the egress ports' frames (as `results` is).
SENT_COUNTERS = ("pulls",)


@dataclasses.dataclass(frozen=True)
class Fabric:
    """What a switch is built as in a fabric: a spine (its jobs may take partials), and the
    uplinks it has (a leaf's, 0..MAX_UPLINKS)."""

    spine: bool = False
    uplinks: int = 0

    def __post_init__(self):
        if not 0 <= self.uplinks <= R.MAX_UPLINKS:
            raise ValueError(f"uplinks must be 0..{R.MAX_UPLINKS}, not {self.uplinks}")
        if self.uplinks:
            raise NotImplementedError("the gateware's leaf (uplinks > 0) is not built yet")

    @property
    def any(self) -> bool:
        """Whether the switch is more than a single switch (its counters take 32 words a
        job)."""
        return self.spine or self.uplinks > 0

    @property
    def events(self) -> tuple[str, ...]:
        """The decide stage's fabric events, by FABRIC_COUNTERS name."""
        return SPINE_EVENTS if self.spine else ()


NO_FABRIC = Fabric()


def job_layout(base: data.StructLayout, fabric: Fabric) -> data.StructLayout:
    """A job table entry: a single switch's (`base`), and CONFIG.partials on a spine."""
    if not fabric.spine:
        return base
    return data.StructLayout({**{name: f.shape for name, f in base}, "partials": 1})


def descriptor_fields(fabric: Fabric) -> dict:
    """What a result descriptor adds on a spine: `pull` (no payload: RETH.dma_length 0,
    count, exponent and overflow 0), and `fabric_va` with `msn` (RETH.va is the use's
    CONTRIBUTION_VA, its msn and the descriptor's offset, not the worker's base address plus
    the offset)."""
    if not fabric.spine:
        return {}
    return {"pull": 1, "fabric_va": 1, "msn": 32}
