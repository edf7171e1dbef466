"""A stand-in for the golden leaf and spine, for the fabric's tests until `sim.golden` has them.

`StandinSwitch(uplinks=N)` is a `GoldenSwitch` that is a leaf when a job has PARENT.enable
(its locally complete uses go up as partials, its parent's results come down and complete
them) and a spine for a job with CONFIG.partials (the partials' counts add up, its results'
RETH.va is the use's CONTRIBUTION_VA). No failure handling beyond re-sending a partial for a
local retransmission to the slot's current uplink (the next one up), and no pulls: enough to
test the network and the hosts, not the leaf.
"""

from __future__ import annotations

import enum

import numpy as np
from netagg.sim import wire as W
from netagg.sim.golden import GoldenSwitch


class CopyState(enum.Enum):
    UPSTREAM = "upstream"
    DONE = "done"


class StandinSwitch(GoldenSwitch):
    def __init__(self, uplinks: int = 0, **params):
        super().__init__(**params)
        self.uplinks = uplinks
        self.uplink = [[0] * W.UPLINK_FIELDS for _ in range(uplinks)]
        self.uplink_down = 0
        self.parent = [0] * self.jobs
        self.parent_key = [0] * self.jobs
        self.spray = [0] * self.jobs
        self.partials_cfg = [False] * self.jobs
        self.fabric = {}            # (index, version) -> [CopyState, msn]
        self.fabric_counters = [dict.fromkeys(W.FABRIC_COUNTERS, 0) for _ in range(self.jobs)]
        self._frame = b""
        self._msn = 0
        self._going_up = None
        self.counts = {}            # a spine's (index, version) -> the use's count

    # --- registers --------------------------------------------------------------------------

    def read(self, addr: int, port: int = 0) -> int:
        if addr == W.REG_UPLINKS:
            return self.uplinks
        if addr == W.REG_UPLINK_DOWN:
            return self.uplink_down if self.uplinks else 0
        if self.uplinks and W.UPLINK_BASE <= addr < W.UPLINK_BASE + W.UPLINK_STRIDE * \
                self.uplinks:
            i, f = divmod(addr - W.UPLINK_BASE, W.UPLINK_STRIDE)
            return self.uplink[i][f] if f < W.UPLINK_FIELDS else 0
        if W.JOB_BASE <= addr < W.JOB_BASE + W.JOB_STRIDE * self.jobs:
            j, off = divmod(addr - W.JOB_BASE, W.JOB_STRIDE)
            if off == W.JOB_PARENT:
                return self.parent[j] if self.uplinks else 0
            if off == W.JOB_SPRAY:
                return self.spray[j] if self.uplinks else 0
            if off == W.JOB_CONFIG:
                return super().read(addr, port) | int(self.partials_cfg[j]) << 30
        if W.JOB_COUNTERS_BASE <= addr < W.JOB_COUNTERS_BASE + W.JOB_COUNTERS_STRIDE * \
                self.jobs:
            j, i = divmod(addr - W.JOB_COUNTERS_BASE, W.JOB_COUNTERS_STRIDE)
            if i >= W.FABRIC_COUNTERS_OFFSET and i - W.FABRIC_COUNTERS_OFFSET < len(
                    W.FABRIC_COUNTERS):
                return self.fabric_counters[j][W.FABRIC_COUNTERS[i -
                                                                 W.FABRIC_COUNTERS_OFFSET]]
        return super().read(addr, port)

    def apply(self, addr: int, value: int, source: int, port: int):
        if addr == W.REG_UPLINK_DOWN and self.uplinks:
            self.uplink_down = value & ((1 << self.uplinks) - 1)
            return
        if self.uplinks and W.UPLINK_BASE <= addr < W.UPLINK_BASE + W.UPLINK_STRIDE * \
                self.uplinks:
            i, f = divmod(addr - W.UPLINK_BASE, W.UPLINK_STRIDE)
            if f < W.UPLINK_FIELDS:
                self.uplink[i][f] = value
            return
        if W.JOB_BASE <= addr < W.JOB_BASE + W.JOB_STRIDE * self.jobs:
            j, off = divmod(addr - W.JOB_BASE, W.JOB_STRIDE)
            if off == W.JOB_PARENT and self.uplinks:
                self.parent[j] = value & 0x8000001F
                return
            if off == W.JOB_PARENT_KEY and self.uplinks:
                self.parent_key[j] = value
                return
            if off == W.JOB_SPRAY and self.uplinks:
                self.spray[j] = value
                return
            if off == W.JOB_CONFIG:
                self.partials_cfg[j] = bool(value >> 30 & 1)
                value &= ~(1 << 30)
        super().apply(addr, value, source, port)

    # --- frames -----------------------------------------------------------------------------

    def receive(self, port, frame, fill=0, null=None):
        self._frame = bytes(frame)
        return super().receive(port, frame, fill, null)

    def _contribution(self, port, header, reth, req, payload, null):
        if header.dqpn == W.UPLINK_QPN and self.uplinks:
            return self._parent_result(reth, payload)
        self._msn = W.split_va(reth.va)[0]
        j = req.job
        if j < self.jobs and self.partials_cfg[j] and self.job[j].enable:
            return self._partial_in(port, header, reth, req, payload)
        return super()._contribution(port, header, reth, req, payload, null)

    def _is_leaf(self, j: int) -> bool:
        return bool(self.uplinks and self.parent[j] >> 31)

    def _complete(self, job, counters, copy):
        j = self.job.index(job)
        if not self._is_leaf(j):
            return super()._complete(job, counters, copy)
        copy.count = 0
        self._going_up = copy

    def _results(self, j, slot, version, copy, ranks, offset):
        key = (self.job[j].slot_base + slot, version)
        if self._is_leaf(j):
            if self._going_up is copy:
                self._going_up = None
                self.fabric[key] = [CopyState.UPSTREAM, self._msn]
                return self._send_up(j, slot, version, copy, offset)
            state = self.fabric.get(key)
            if state is not None and state[0] is CopyState.UPSTREAM:
                return self._send_up(j, slot, version, copy, offset)
        if self.partials_cfg[j]:
            return self._spine_results(j, slot, version, copy, ranks, offset)
        return super()._results(j, slot, version, copy, ranks, offset)

    def _uplink_of(self, j: int, slot: int) -> int | None:
        first = W.spray_entry(self.spray[j], slot)
        for k in range(self.uplinks):
            u = (first + k) % self.uplinks
            if not self.uplink_down >> u & 1:
                return u
        return None

    def _send_up(self, j, slot, version, copy, offset):
        u = self._uplink_of(j, slot)
        if u is None:
            self.fabric_counters[j]["no_uplink"] += 1
            return []
        port, mac_hi, mac_lo, ip, udp = self.uplink[u]
        msn = self.fabric[self.job[j].slot_base + slot, version][1]
        imm = W.pack_imm(W.REQUEST_IMM, job=j, rank=self.parent[j] & 0x1F, version=version,
                         slot=slot, exponent=copy.exponent)
        psn = W.pack_imm(W.PARTIAL, count=copy.data, overflow=int(copy.overflow))
        pkt = W.Packet(W.OP_CONTRIBUTION, 0, psn, copy.sums.astype("<i4").tobytes(),
                       va=W.contribution_va(msn, offset), rkey=self.parent_key[j], imm=imm,
                       src=W.Endpoint(W.ip_text(self.ip.to_bytes(4, "big")), self.udp_sport,
                                      self.mac),
                       dst=W.Endpoint(W.ip_text(ip.to_bytes(4, "big")), udp,
                                      mac_hi << 32 | mac_lo),
                       dscp=W.PARTIAL_DSCP)
        self.fabric_counters[j]["upstream"] += 1
        return [(port, pkt.frame())]

    def _parent_result(self, reth, payload):
        imm = W.unpack_imm(W.RESULT_IMM, reth.imm)
        j = imm["job"]
        if j >= self.jobs or not self._is_leaf(j):
            return []
        job = self.job[j]
        msn, offset = W.split_va(reth.va)
        key = (job.slot_base + imm["slot"], imm["version"])
        state = self.fabric.get(key)
        if state is None or state[0] is not CopyState.UPSTREAM or state[1] != msn:
            self.fabric_counters[j]["drop_parent"] += 1
            return []
        copy = self.state[key[0]][key[1]]
        copy.sums = np.frombuffer(payload, "<i4").astype(np.int64)
        copy.data, copy.overflow = imm["count"], bool(imm["overflow"])
        copy.exponent = imm["exponent"]
        state[0] = CopyState.DONE
        self.fabric_counters[j]["parent_results"] += 1
        GoldenSwitch._complete(self, job, self.job_counters[j], copy)
        return GoldenSwitch._results(self, j, imm["slot"], imm["version"], copy,
                                     range(job.workers), offset)

    # --- a spine ----------------------------------------------------------------------------

    def _partial_in(self, port, header, reth, req, payload):
        """A partial: the use's count adds the partial's (predicted as the golden model
        decides new use / add, before it builds a result)."""
        psn = int.from_bytes(self._frame[W.BTH_OFFSET + 9:W.BTH_OFFSET + 12], "big")
        count = W.unpack_imm(W.PARTIAL, psn)["count"]
        key = (self.job[req.job].slot_base + req.slot, req.version)
        copy = self.state[key[0]][key[1]]
        d = ((self._msn - copy.msn16 + 0x8000) & 0xFFFF) - 0x8000
        if copy.count == 0 and (not copy.bitmap or d > 0):
            self.counts[key] = count
        elif copy.count and d == 0 and not copy.bitmap >> req.rank & 1:
            self.counts[key] += count
        return super()._contribution(port, header, reth, req, payload, False)

    def _spine_results(self, j, slot, version, copy, ranks, offset):
        job = self.job[j]
        count = self.counts.get((job.slot_base + slot, version), copy.data)
        imm = W.pack_imm(W.RESULT_IMM, job=j, count=count, version=version, slot=slot,
                         exponent=copy.exponent, overflow=int(copy.overflow))
        sums, limit = copy.sums.astype("<i4").tobytes(), job.limit
        out = []
        for rank in ranks:
            w = job.table[rank]
            out.append((w.port, self._template(w, len(sums)).frame(
                limit, W.contribution_va(self._msn, offset), imm, sums)))
        self.job_counters[j]["results"] += len(out)
        return out
