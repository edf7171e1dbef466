"""The golden leaf and spine: a golden switch (`sim.golden`) whose jobs may have a parent (a
leaf's: their uses complete at a spine) and may take leaves' partials (a spine's,
CONFIG.partials), frame for frame as docs/leafspine.md says.

`GoldenLeaf(uplinks=N, **GoldenSwitch's parameters)`, N = 0..4: a switch with N uplinks
(the uplink table, `sim.golden_leaf_registers`); `sim.golden_spine.GoldenSpine` is one
without uplinks. Both take a spine's job (CONFIG.partials); a leaf's job with PARENT.enable
sends its uses' partials up. A job with neither is served as by `GoldenSwitch`, bit for bit.

At a leaf, a slot copy of a job with a parent goes IN_USE -> UPSTREAM (locally complete: the
partial is sent up the slot's uplink, SPRAY and REG_UPLINK_DOWN) -> DONE (the spine's result
with the copy's msn arrived: the final replaces the partial, COMPLETED + 1, the result goes
to every local worker). A local retransmission of a use re-sends its partial, marked
`resent`, in UPSTREAM and replays the final in DONE. A frame from an uplink's spine (opcode
0x2B at UPLINK_QPN from the uplink's IP, `from_parent`) is a result (payload) or a pull (no
payload: the leaf answers with its partial, or its final marked `final`).

At a spine, a partial comes in by the port of its leaf's entry (else `drop_bad_worker`), a
copy keeps its use's whole msn and compares 32 bits (`_distance`: a spine back after 2^15
or more of the job's messages elsewhere takes the new uses, and a late partial of an old one
stays stale); a contribution's data count is its PARTIAL.count and its overflow ORs in (the
use's data count is RESULT_IMM's 6 bits: it wraps modulo 64, as the RTL's does); a partial
marked `final` completes the use with its sums as they are; a use in progress gives way to a
later use of its copy (`abandoned`); a resent partial that leaves a use in progress pulls
every leaf missing from it; results carry RETH.va CONTRIBUTION_VA (msn, offset).
"""

from __future__ import annotations

from typing import NamedTuple

from netagg.contract import headers as H
from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.codec import Extension, Header, Request, decode, result_imm
from netagg.sim.golden import GoldenSwitch, add_saturating, signed, wide_lanes
from netagg.sim.golden_leaf_registers import (
    CopyState,
    FabricCopy,
    FabricJob,
    LeafRegisters,
    Uplink,
)

_PSN_AT = W.BTH_OFFSET + H.BTH.byte_offset("psn")     # a frame's BTH.psn (hw.headers.BTH)
_PSN_END = _PSN_AT + H.BTH.wire_fields["psn"] // 8


class Partial(NamedTuple):
    """What a contribution adds at a spine (PARTIAL, its BTH.psn): a worker's contribution
    elsewhere is a partial of count 1 (0 for a null)."""

    count: int
    overflow: int = 0
    resent: int = 0
    final: int = 0


def _partial(frame: bytes) -> Partial:
    """The PARTIAL fields of a contribution's BTH.psn."""
    fields = W.unpack_imm(W.PARTIAL, int.from_bytes(frame[_PSN_AT:_PSN_END], "big"))
    return Partial(fields["count"], fields["overflow"], fields["resent"], fields["final"])


class Use(NamedTuple):
    """The use a frame names: job, slot number, version, msn (32 bits) and offset."""

    job: int
    slot: int
    version: int
    msn: int
    offset: int


class GoldenLeaf(LeafRegisters, GoldenSwitch):
    """A leaf with `uplinks` (0..MAX_UPLINKS), and a spine; the other parameters as
    `GoldenSwitch`'s."""

    job_type, copy_type = FabricJob, FabricCopy

    def __init__(self, *args, uplinks: int = 0, **kwargs):
        if not 0 <= uplinks <= R.MAX_UPLINKS:
            raise ValueError(f"uplinks must be 0..{R.MAX_UPLINKS}, not {uplinks}")
        self.uplinks, self.uplink_down, self.links_down = uplinks, 0, 0
        self.uplink = [Uplink() for _ in range(uplinks)]
        super().__init__(*args, **kwargs)
        self.fabric_counters = [dict.fromkeys(R.FABRIC_COUNTERS, 0) for _ in range(self.jobs)]

    # --- which frame ------------------------------------------------------------------------

    def from_parent(self, header: Header | None) -> bool:
        return (bool(self.uplinks) and header is not None and header.opcode == W.OP_RESULT
                and header.dqpn == W.UPLINK_QPN
                and any(u.ip == header.src_ip for u in self.uplink))

    def drops_payload(self, frame: bytes, fill: int) -> bool:
        return not self.from_parent(decode(frame)[1]) and super().drops_payload(frame, fill)

    def _contribution(self, port: int, frame: bytes, header: Header, reth: Extension,
                      req: Request, payload: bytes, null: bool) -> list:
        if self.from_parent(header):
            return self._parent_frame(port, header, reth, payload)
        job = self.job[req.job] if req.job < self.jobs else None
        if job is None or not job.enable or not (job.partials or job.parent):
            return super()._contribution(port, frame, header, reth, req, payload, null)
        if not self._admitted(port, header, reth, req, len(payload)):
            return []
        part = _partial(frame) if job.partials else Partial(int(not null))
        return self._add(Use(req.job, req.slot, req.version, *W.split_va(reth.va)), req.rank,
                         req.exponent, payload, part)

    def _by_entry_port(self, job: FabricJob, rank: int, port: int | None) -> bool:
        """A spine's job takes a leaf's partial only from the port of the leaf's entry (a
        host that spoofs the leaf's IP elsewhere is `drop_bad_worker`, as a wrong IP is)."""
        return port is None or not job.partials or port == job.table[rank].port

    # --- a contribution to a leaf's or a spine's job ---------------------------------------

    @staticmethod
    def _distance(job: FabricJob, copy: FabricCopy, msn: int) -> int:
        """d: how far `msn` is beyond the use of `copy`: signed32 of the whole msns for a
        spine's job (a spine back after any time away takes the new uses), signed16 of their
        low 16 bits for another, as on one switch."""
        if job.partials:
            return signed(msn - copy.msn, 32)
        return signed(msn - copy.msn16, 16)

    def _add(self, use: Use, rank: int, exponent: int, payload: bytes, part: Partial) -> list:
        """A contribution of `rank` to `use`, past the checks: a spine's is a partial, a
        leaf's a worker's (`part`: count 1, or 0 for a null, whose payload is zeros)."""
        job, counters = self.job[use.job], self.job_counters[use.job]
        fabric = self.fabric_counters[use.job]
        copy, needed, ranks = self._aggregation(job, job.slot_base + use.slot, use.version, rank)
        bit, d = 1 << rank, self._distance(job, copy, use.msn)
        if copy.count == 0:
            if copy.bitmap and d == 0 and len(payload) != copy.length:
                counters["drop_bad_length"] += 1
                return []
            if copy.bitmap and d == 0 and copy.state is CopyState.UPSTREAM:
                fabric["resends"] += 1
                return self._send_up(use, copy, resent=True)
            if copy.bitmap and d == 0:
                counters["replays"] += 1
                return self._results(use.job, use.slot, use.version, copy, [rank], use.offset,
                                     self._va(job, use))
            if copy.bitmap and (d < 0 or copy.state is CopyState.UPSTREAM):
                counters["drop_stale"] += 1
                return []
            self._begin(copy, bit, payload, use.msn, exponent, part)
        elif d < 0 or (d > 0 and not job.partials):
            counters["drop_stale"] += 1
            return []
        elif d > 0:
            fabric["abandoned"] += 1
            self._begin(copy, bit, payload, use.msn, exponent, part)
        elif copy.bitmap & bit and not (part.final and len(payload) == copy.length):
            if self._late(job, copy) and len(payload) == copy.length:
                counters["closed_late"] += 1
                return self._finish(use, copy, ranks)
            counters["duplicates"] += 1
            return self._pulls(use, copy) if part.resent else []
        elif len(payload) != copy.length:
            counters["drop_bad_length"] += 1
            return []
        elif not part.final:
            copy.overflow |= add_saturating(copy.sums, payload) | bool(part.overflow)
            copy.exponent = max(copy.exponent, exponent)
            copy.bitmap |= bit
            copy.count += 1
            copy.data = (copy.data + part.count) & W.MAX_DATA_COUNT
        counters["contributions"] += 1
        if part.final:
            fabric["finals"] += 1
            self._take(copy, payload, part.count, exponent, part.overflow)
            copy.bitmap |= bit
            return self._finish(use, copy, ranks)
        if copy.count < needed:
            return self._pulls(use, copy) if part.resent else []
        return self._finish(use, copy, ranks)

    def _begin(self, copy: FabricCopy, bit: int, payload: bytes, msn: int, exponent: int,
               part: Partial):
        """A new use of `copy`, begun by one contribution (a spine's: a partial)."""
        copy.begin(bit, wide_lanes(payload), not part.count, msn, exponent, self.now)
        copy.data, copy.overflow, copy.state = part.count, bool(part.overflow), CopyState.IN_USE

    @staticmethod
    def _take(copy: FabricCopy, payload: bytes, count: int, exponent: int, overflow: int):
        """The copy takes a use's final as it is: sums, count, exponent, overflow."""
        copy.sums, copy.length = wide_lanes(payload), len(payload)
        copy.data, copy.exponent, copy.overflow = count, exponent, bool(overflow)

    def _finish(self, use: Use, copy: FabricCopy, ranks) -> list:
        """A use complete here: a leaf's goes UPSTREAM with its partial; else it is DONE, and
        its result goes to every one of `ranks`."""
        job = self.job[use.job]
        if job.parent:
            copy.count, copy.state = 0, CopyState.UPSTREAM
            return self._send_up(use, copy)
        self._complete(job, self.job_counters[use.job], copy)
        copy.state = CopyState.DONE
        return self._results(use.job, use.slot, use.version, copy, ranks, use.offset,
                             self._va(job, use))

    @staticmethod
    def _va(job: FabricJob, use: Use) -> int | None:
        """A result's RETH.va: a spine's job's carries the use's (msn, offset); None: the
        worker's base address + the offset."""
        return W.contribution_va(use.msn, use.offset) if job.partials else None

    # --- up: partials ------------------------------------------------------------------------

    def _uplink_for(self, job: FabricJob, slot: int) -> int | None:
        """The uplink slot number `slot` goes up: its SPRAY entry's, or the next one up."""
        entry = R.spray_entry(job.spray, slot)
        for k in range(self.uplinks):
            u = (entry + k) % self.uplinks
            if not self.down >> u & 1:
                return u
        return None

    def _send_up(self, use: Use, copy: FabricCopy, *, resent: bool = False,
                 uplink: int | None = None) -> list:
        """The copy's partial (its final, marked `final`, when it is DONE) up `uplink`, or
        the slot's uplink; nothing when every uplink is down (`no_uplink`)."""
        job, fabric = self.job[use.job], self.fabric_counters[use.job]
        u = self._uplink_for(job, use.slot) if uplink is None else uplink
        if u is None:
            fabric["no_uplink"] += 1
            return []
        fabric["upstream"] += 1
        up = self.uplink[u]
        psn = W.pack_imm(W.PARTIAL, count=copy.data, overflow=int(copy.overflow),
                         resent=int(resent), final=int(copy.state is CopyState.DONE))
        frame = W.contribution(
            job=use.job, rank=job.parent_rank, slot=use.slot, version=use.version,
            offset=use.offset, lanes=copy.sums.astype("<i4").tobytes(), psn=psn,
            src=W.Endpoint(W.ip_text(self.ip.to_bytes(4, "big")), self.udp_sport, self.mac),
            dst=W.Endpoint(W.ip_text(up.ip.to_bytes(4, "big")), up.udp_port, up.mac),
            key=job.parent_key, exponent=copy.exponent, msn=use.msn, dscp=W.PARTIAL_DSCP,
            dqpn=0).frame()
        return [(up.port, frame)] if up.port < self.ports else []

    # --- down: a spine's frames ---------------------------------------------------------------

    def _pulls(self, use: Use, copy: FabricCopy) -> list:
        """A spine's pulls of `use` to every leaf missing from the copy: result-shaped frames
        without payload."""
        job = self.job[use.job]
        imm = result_imm(use.job, 0, use.version, use.slot, 0, 0)
        va = W.contribution_va(use.msn, use.offset)
        out = []
        for rank in range(job.workers):
            w = job.table[rank]
            if copy.bitmap >> rank & 1 or w.port >= self.ports:
                continue
            out.append((w.port, self.result_template(w, 0).frame(job.limit, va, imm, b"")))
        self.fabric_counters[use.job]["pulls"] += len(out)
        return out

    def _parent_frame(self, port: int, header: Header, reth: Extension,
                      payload: bytes) -> list:
        """A frame from an uplink's spine: a result of a use in UPSTREAM makes it DONE; a pull
        is answered with the copy's partial or final; anything else is `drop_parent`."""
        imm = W.unpack_imm(W.RESULT_IMM, reth.imm)
        if imm["job"] >= self.jobs:
            self.port_counters[port]["drop_bad_job"] += 1
            return []
        j, slot, version = imm["job"], imm["slot"], imm["version"]
        job, fabric = self.job[j], self.fabric_counters[j]
        by = [i for i, u in enumerate(self.uplink) if u.ip == header.src_ip and u.port == port]
        if not (by and job.enable and job.parent and reth.rkey == job.parent_key
                and reth.dma_length == len(payload) and slot < job.slot_count
                and job.slot_base + slot < self.slots):
            fabric["drop_parent"] += 1
            return []
        use = Use(j, slot, version, *W.split_va(reth.va))
        copy = self.state[job.slot_base + slot][version]
        ours = copy.bitmap and copy.count == 0 and self._distance(job, copy, use.msn) == 0
        if payload and ours and copy.state is CopyState.UPSTREAM and \
                len(payload) == copy.length:
            fabric["parent_results"] += 1
            self._take(copy, payload, imm["count"], imm["exponent"], imm["overflow"])
            self._complete(job, self.job_counters[j], copy)
            copy.state = CopyState.DONE
            return self._results(j, slot, version, copy, range(job.workers), use.offset,
                                 self._va(job, use))
        if not payload and ours and copy.state in (CopyState.UPSTREAM, CopyState.DONE):
            fabric["pulled"] += 1
            return self._send_up(use, copy, uplink=by[0])
        fabric["drop_parent"] += 1
        return []

