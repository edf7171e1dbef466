"""The registers of a golden leaf or spine (`sim.golden_leaf`, docs/leafspine.md), over a
golden switch's (`sim.golden_registers`): the uplink table, REG_UPLINKS and REG_UPLINK_DOWN,
a job's PARENT, PARENT_KEY and SPRAY (mapped on a switch with uplinks only: without, they
are unknown addresses, read 0 and ignore writes, as on the RTL), CONFIG.partials (a spine's
job) and the job counters FABRIC_COUNTERS. The uplink registers are the switch's own: once a
manager is set, only it writes them. The job state (`FabricJob`), slot copy state
(`FabricCopy`, `CopyState`) and uplinks (`Uplink`) a leaf and a spine keep are declared here.
"""

from __future__ import annotations

import dataclasses
import enum

from netagg.contract import regmap as R
from netagg.sim.golden import Job, SlotCopy
from netagg.sim.golden_registers import Refusal, Space, mac_half


class CopyState(enum.Enum):
    """Where a use of a slot copy is, at a leaf (a spine's and one switch's copies are
    FRESH, IN_USE or DONE)."""

    FRESH = "fresh"             # no use since the slot was cleared
    IN_USE = "in use"           # contributions arriving (count > 0)
    UPSTREAM = "upstream"       # a leaf's: locally complete, its partial sent up
    DONE = "done"               # complete: the copy holds the use's final


@dataclasses.dataclass(eq=False)
class FabricCopy(SlotCopy):
    """A slot copy of a leaf or a spine: a slot copy, its `CopyState` and the use's whole
    msn (32 bits: a spine's job compares them, docs/leafspine.md)."""

    state: CopyState = CopyState.FRESH
    msn: int = 0                      # the use's MSN, 32 bits

    def begin(self, bit: int, sums, null: bool, msn: int, exponent: int, now: int):
        super().begin(bit, sums, null, msn, exponent, now)
        self.msn = msn & 0xFFFFFFFF


@dataclasses.dataclass
class FabricJob(Job):
    """A job of a leaf or a spine: a job and its CONFIG.partials, PARENT, PARENT_KEY, SPRAY."""

    partials: bool = False            # a spine's: its contributions are leaves' partials
    parent: bool = False              # a leaf's: PARENT.enable, its uses complete at a spine
    parent_rank: int = 0              # the leaf's rank in the spines' job
    parent_key: int = 0               # the R_Key of its partials (the spines' KEY)
    spray: int = 0                    # SPRAY: the uplink of each slot number modulo 16

    @property
    def config(self) -> int:
        return R.CONFIG.pack(enable=int(self.enable), partials=int(self.partials),
                             workers=self.workers)


@dataclasses.dataclass
class Uplink:
    """Uplink i of a leaf: the switch port it leaves by, and its spine's address."""

    port: int = 0
    mac: int = 0
    ip: int = 0
    udp_port: int = 0


_FABRIC_JOB = (R.JOB_PARENT, R.JOB_PARENT_KEY, R.JOB_SPRAY)


class LeafRegisters:
    """The leaf's and spine's registers, before a `GoldenSwitch`'s in the method order: the
    switch keeps `uplinks`, `uplink` (a list of `Uplink`), `uplink_down` (REG_UPLINK_DOWN as
    written), `links_down` (bit p: port p's link is lost), `fabric_counters` (by job,
    FABRIC_COUNTERS) and `FabricJob`s."""

    @property
    def lost(self) -> int:
        """The uplinks on a port whose link is lost (bit i): what REG_UPLINK_LOST reads."""
        return sum(1 << i for i, u in enumerate(self.uplink) if self.links_down >> u.port & 1)

    @property
    def down(self) -> int:
        """The uplinks that are down (bit i): marked down, or on a port whose link is lost."""
        return self.uplink_down | self.lost

    def set_link(self, port: int, up: bool):
        """Port `port`'s MAC reports its link up or lost (an uplink on a lost link is down,
        as if marked so, until the link is back)."""
        self.links_down = self.links_down & ~(1 << port) | (0 if up else 1 << port)

    def _fabric(self, addr: int):
        """(what, index, field) of an address that is a leaf's or spine's register here, or
        None: what is "uplinks", "down", "lost", "uplink" (index i), "job" (index j, field the
        offset) or "counter" (index j, field the counter's name)."""
        if addr == R.REG_UPLINKS:
            return "uplinks", 0, 0
        if addr == R.REG_UPLINK_DOWN and self.uplinks:
            return "down", 0, 0
        if addr == R.REG_UPLINK_LOST and self.uplinks:
            return "lost", 0, 0
        i, field = divmod(addr - R.UPLINK_BASE, R.UPLINK_STRIDE)
        if addr >= R.UPLINK_BASE and i < self.uplinks and field < R.UPLINK_FIELDS:
            return "uplink", i, field
        if R.JOB_BASE <= addr < R.BEAT_BASE:
            j, off = divmod(addr - R.JOB_BASE, R.JOB_STRIDE)
            if j < self.jobs and off in _FABRIC_JOB and self.uplinks:
                return "job", j, off
        if R.JOB_COUNTERS_BASE <= addr:
            j, off = divmod(addr - R.JOB_COUNTERS_BASE, R.JOB_COUNTERS_STRIDE)
            i = off - R.FABRIC_COUNTERS_OFFSET
            if j < self.jobs and 0 <= i < len(R.FABRIC_COUNTERS):
                return "counter", j, R.FABRIC_COUNTERS[i]
        return None

    def read(self, addr: int, port: int = 0) -> int:
        at = self._fabric(addr)
        if at is None:
            return super().read(addr, port)
        what, index, field = at
        if what == "uplinks":
            return self.uplinks
        if what == "down":
            return self.uplink_down
        if what == "lost":
            return self.lost
        if what == "uplink":
            u = self.uplink[index]
            return (u.port, u.mac >> 32, u.mac & 0xFFFFFFFF, u.ip, u.udp_port)[field]
        if what == "counter":
            return self.fabric_counters[index][field] & 0xFFFFFFFF
        job = self.job[index]
        return {R.JOB_PARENT: R.PARENT.pack(enable=int(job.parent), rank=job.parent_rank),
                R.JOB_SPRAY: job.spray}.get(field, 0)          # PARENT_KEY reads 0

    def _write_refusal(self, addr: int, value: int, source: int) -> Refusal | None:
        at = self._fabric(addr)
        if at is not None and at[0] in ("down", "uplink"):
            by_manager = self.manager != 0 and source == self.manager
            return None if self.manager == 0 or by_manager else Refusal.DENIED
        return super()._write_refusal(addr, value, source)

    def write(self, addr: int, value: int):
        at = self._fabric(addr)
        if at is None:
            super().write(addr, value)
            kind, index, off = self._decode(addr)
            if kind is Space.JOB and off == R.JOB_CONFIG:
                self.job[index].partials = bool(R.CONFIG.unpack(value)["partials"])
            return
        what, index, field = at
        if what == "down":
            self.uplink_down = value & ((1 << self.uplinks) - 1)
        elif what == "uplink":
            u = self.uplink[index]
            if field == R.UPLINK_PORT:
                u.port = value & ((1 << R.UPLINK_PORT_BITS) - 1)
            elif field in (R.UPLINK_MAC_HI, R.UPLINK_MAC_LO):
                u.mac = mac_half(u.mac, value, field == R.UPLINK_MAC_HI)
            elif field == R.UPLINK_IP:
                u.ip = value
            elif field == R.UPLINK_UDP_PORT:
                u.udp_port = value & ((1 << R.UPLINK_UDP_PORT_BITS) - 1)
        elif what == "job":
            job = self.job[index]
            if field == R.JOB_PARENT:
                parent = R.PARENT.unpack(value)
                job.parent, job.parent_rank = bool(parent["enable"]), parent["rank"]
            elif field == R.JOB_PARENT_KEY:
                job.parent_key = value
            elif field == R.JOB_SPRAY:
                job.spray = value

    def counters(self) -> dict:
        """The port and job counters, each job's FABRIC_COUNTERS among its own."""
        out = super().counters()
        for jobs, fabric in zip(out["jobs"], self.fabric_counters):
            jobs.update(fabric)
        return out
