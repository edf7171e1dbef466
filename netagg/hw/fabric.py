"""The switch's place in a fabric of leaves and spines (docs/leafspine.md), as gateware
parameters, and what the stages add for it.

`Fabric(spine=..., uplinks=...)` is what a `hw.switch.Switch` is built as: `spine`, its jobs
may take leaves' partials (CONFIG.partials: a contribution's data count is its
PARTIAL.count, a `final` partial completes the use as it is, a later use of a copy in
progress gives the use up, a `resent` partial pulls the leaves missing from the use, and
results carry the use's CONTRIBUTION_VA); `uplinks` (0..MAX_UPLINKS), a leaf's, which takes
partials too. With neither (`NO_FABRIC`, every board) no stage adds a signal: the netlist is
a single switch's.

What the stages add when the switch is a spine: the job table's CONFIG.partials bit
(`job_layout`); a slot copy's whole msn (`msn_bits`: a spine's job compares 32 bits, the
others 16, as on one switch); a contribution to a spine's job taken only from the port of
its leaf's entry (the lookup's worker check); the decide stage's events (`SPINE_EVENTS`,
counted as FABRIC_COUNTERS); the result descriptor's `pull` (a payload-less result to the
leaves missing from a use) and the use's msn, which a spine's results and pulls carry in
RETH.va (`descriptor_fields`); and the egress ports' count of pulls sent (`pulls`, like
`results`). When it has uplinks (a leaf): the uplink table (`UPLINK`), REG_UPLINK_DOWN and
REG_UPLINK_LOST, each job's PARENT, PARENT_KEY and SPRAY (`leaf_registers`); a slot copy's
`upstream` and `done` bits (`copy_fields`); the descriptor's partial fields (`up`, the
uplink, the `resent` and `final` marks), which the egress ports address from the uplink
table; the events `LEAF_EVENTS`; a header entry's mark of a frame from an uplink's spine
(`parent_fields`: opcode 0x2B at UPLINK_QPN from an uplink's IP, never dropped by priority),
which the lookup stage checks as the golden leaf's `drop_parent` does and the decide stage
takes as a result of a use gone up (DONE: COMPLETED + 1, its sums to every local worker) or
as a pull (answered up the uplink it came by with the copy's partial, or its final marked
`final`).
"""

from __future__ import annotations

import dataclasses

from amaranth.lib import data

from netagg.contract import regmap as R

# The decide stage's events of a spine's job and a leaf's, each counted by the FABRIC_COUNTER
# of its name.
SPINE_EVENTS = ("finals", "abandoned")
LEAF_EVENTS = ("upstream", "resends", "no_uplink", "parent_results", "drop_parent", "pulled")
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
        # a switch with uplinks takes partials too (its gateware serves as a spine as well)
        object.__setattr__(self, "spine", self.spine or self.uplinks > 0)

    @property
    def any(self) -> bool:
        """Whether the switch is more than a single switch (its counters take 32 words a
        job)."""
        return self.spine or self.uplinks > 0

    @property
    def events(self) -> tuple[str, ...]:
        """The decide stage's fabric events, by FABRIC_COUNTERS name."""
        return (SPINE_EVENTS if self.spine else ()) + (LEAF_EVENTS if self.uplinks else ())


NO_FABRIC = Fabric()


# An uplink of a leaf: the switch port it leaves by, and its spine's MAC, IPv4 address and
# UDP port (the uplink table's fields, `netagg.contract.regmap.UPLINK_*`).
UPLINK = data.StructLayout({"port": 4, "mac": 48, "ip": 32, "udp_port": 16})


def job_layout(base: data.StructLayout, fabric: Fabric) -> data.StructLayout:
    """A job table entry: a single switch's (`base`), and CONFIG.partials on a spine; a
    leaf's PARENT (`parent`, the register's word: enable and rank), PARENT_KEY and SPRAY."""
    if not fabric.spine:
        return base
    fields = {**{name: f.shape for name, f in base}, "partials": 1}
    if fabric.uplinks:
        fields |= {"parent": 32, "parent_key": 32, "spray": 32}
    return data.StructLayout(fields)


def leaf_registers(m, fabric: Fabric, jobs, job_ok, switch_ok, uplinks, down, lost,
                   register):
    """A leaf's registers, as `register(addr, value, field, allowed, copy=...)` makes them
    (`hw.control_registers.Register`): REG_UPLINKS, REG_UPLINK_DOWN (`down`), REG_UPLINK_LOST
    (`lost`: the uplinks whose port's link is lost, read only) and the uplink
    table (`uplinks`, of `UPLINK`), the switch's own (written by its manager, once it has
    one: `switch_ok`); each job's PARENT (read as its enable and rank), PARENT_KEY (write
    only) and SPRAY, its block's (`job_ok`)."""
    regs = [register(R.REG_UPLINKS, fabric.uplinks),
            register(R.REG_UPLINK_DOWN, down, down, switch_ok, copy=0),
            register(R.REG_UPLINK_LOST, lost)]
    for i, up in enumerate(uplinks):
        regs += [
            register(R.uplink_reg(i, R.UPLINK_PORT), up.port, up.port, switch_ok, copy=0),
            register(R.uplink_reg(i, R.UPLINK_MAC_HI), up.mac[32:], up.mac[32:], switch_ok,
                     copy=0),
            register(R.uplink_reg(i, R.UPLINK_MAC_LO), up.mac[:32], up.mac[:32], switch_ok,
                     copy=0),
            register(R.uplink_reg(i, R.UPLINK_IP), up.ip, up.ip, switch_ok, copy=0),
            register(R.uplink_reg(i, R.UPLINK_UDP_PORT), up.udp_port, up.udp_port, switch_ok,
                     copy=0),
        ]
    enable, rank = R.PARENT.bits("enable")[0], R.PARENT.bits("rank")
    for j, job in enumerate(jobs):
        shown = job.parent & ((1 << enable) | ((1 << rank[1]) - 1) << rank[0])
        regs += [
            register(R.job_reg(j, R.JOB_PARENT), shown, job.parent, job_ok[j]),
            register(R.job_reg(j, R.JOB_PARENT_KEY), 0, job.parent_key, job_ok[j]),
            register(R.job_reg(j, R.JOB_SPRAY), job.spray, job.spray, job_ok[j], copy=0),
        ]
    return regs


def descriptor_fields(fabric: Fabric) -> dict:
    """What a result descriptor adds on a spine: `pull` (no payload: RETH.dma_length 0,
    count, exponent and overflow 0), and `fabric_va` with `msn` (RETH.va is the use's
    CONTRIBUTION_VA, its msn and the descriptor's offset, not the worker's base address plus
    the offset)."""
    if not fabric.spine:
        return {}
    fields = {"pull": 1, "fabric_va": 1, "msn": 32}
    if fabric.uplinks:
        # a leaf's partial: up `uplink` (the uplink table's header template), its PARTIAL's
        # resent and final marks
        fields |= {"up": 1, "uplink": 2, "resent": 1, "final": 1}
    return fields


def parent_fields(fabric: Fabric) -> dict:
    """What a header entry adds on a leaf: `parent`, the frame is a spine's (opcode 0x2B at
    UPLINK_QPN from an uplink's IP); `by`, it came in by the port of such an uplink, the
    first of which is `uplink` (a pull's answer goes up it)."""
    return {"parent": 1, "by": 1, "uplink": 2} if fabric.uplinks else {}


def msn_bits(fabric: Fabric) -> int:
    """The bits of its use's msn a slot copy keeps: 16 on a single switch (a worker's uses of
    a copy are at most two apart); 32 on a switch that takes partials, whose spine's jobs
    compare whole msns (a spine whose uplink was down while the leaves ran 2^15 messages or
    more elsewhere still tells the new uses from the old, docs/leafspine.md)."""
    return 32 if fabric.spine else 16


def copy_fields(fabric: Fabric) -> dict:
    """What a slot copy adds on a leaf: `upstream`, its use is locally complete and its
    partial went up (docs/leafspine.md's UPSTREAM); `done`, its use of a job with a parent
    or taking partials is complete (DONE: the copy holds the final). A copy with neither is
    fresh or in use, or was last used by a job with neither (a pull finds no use there)."""
    return {"upstream": 1, "done": 1} if fabric.uplinks else {}
