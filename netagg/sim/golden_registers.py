"""The golden switch's registers (`netagg.contract.regmap`), as the gateware's control path decodes
them: an address is a global register, one of a job's, a field of a worker's job-table entry, a
rank's heartbeat, or a port's or a job's counter (`Space`); `read` gives a register's value,
`write` applies a record's. Unknown addresses read 0 and ignore writes; read-only registers
ignore writes. `apply` is a control request's write record: it judges who may write
(`netagg.contract.regmap`'s rules: the manager, a job's owner, a worker entry's own address, the
slot ranges of enabled jobs), counts what it refuses (`control_denied` on the request's port,
`config_refused` on the job) and writes the rest. `sim.golden.GoldenSwitch` is a
`Registers`: these read and write its state."""

from __future__ import annotations

import enum

from netagg.contract import regmap as R
from netagg.contract import wire as W


class Space(enum.Enum):
    """Which part of the register map an address is in."""

    GLOBAL = "global"
    JOB = "job"
    WORKER = "worker"
    BEAT = "beat"
    PORT_COUNTER = "port counter"
    JOB_COUNTER = "job counter"
    NONE = "none"               # outside every part: reads 0, writes nothing


class Refusal(enum.Enum):
    """Why a write record is refused, by the counter that counts it."""

    DENIED = "control_denied"       # neither the job's owner nor the manager (port counter)
    REFUSED = "config_refused"      # a slot range that cannot be enabled (job counter)


# The switch's own registers a request may write (while there is no manager, or from it).
SWITCH_WRITABLE = frozenset((R.REG_MAC_HI, R.REG_MAC_LO, R.REG_IP, R.REG_UDP_SPORT,
                             R.REG_MANAGER, *(R.drop_threshold(c)
                                              for c in range(R.PRIORITY_CLASSES))))


class Registers:
    """The register map over a golden switch's state."""

    def _decode(self, addr: int):
        """(kind, index, offset) of a register address."""
        if addr < R.JOB_BASE:
            return Space.GLOBAL, 0, addr
        if R.BEAT_BASE <= addr < R.BEAT_BASE + W.MAX_JOBS * R.BEAT_STRIDE:
            j, rank = divmod(addr - R.BEAT_BASE, R.BEAT_STRIDE)
            ok = j < self.jobs and rank < self.max_workers
            return (Space.BEAT, (j, rank), 0) if ok else (Space.NONE, 0, 0)
        if addr < R.PORT_COUNTERS_BASE:
            j, off = divmod(addr - R.JOB_BASE, R.JOB_STRIDE)
            if j >= self.jobs:
                return Space.NONE, 0, 0
            if off >= R.WORKER_BASE:
                rank, field = divmod(off - R.WORKER_BASE, R.WORKER_STRIDE)
                if rank >= self.max_workers:
                    return Space.NONE, 0, 0
                return Space.WORKER, (j, rank), field
            return Space.JOB, j, off
        if addr < R.JOB_COUNTERS_BASE:
            p, off = divmod(addr - R.PORT_COUNTERS_BASE, R.PORT_COUNTERS_STRIDE)
            ok = p < self.ports and off < len(R.PORT_COUNTERS)
            return (Space.PORT_COUNTER, p, off) if ok else (Space.NONE, 0, 0)
        j, off = divmod(addr - R.JOB_COUNTERS_BASE, R.JOB_COUNTERS_STRIDE)
        ok = j < self.jobs and off < len(R.JOB_COUNTERS)
        return (Space.JOB_COUNTER, j, off) if ok else (Space.NONE, 0, 0)

    def read(self, addr: int, port: int = 0) -> int:
        """The register at `addr`, as a control request that came in by `port` reads it."""
        kind, index, off = self._decode(addr)
        if kind is Space.GLOBAL:
            return {
                R.REG_MAGIC: R.MAGIC,
                R.REG_PARAMS: R.PARAMS.pack(ports=self.ports, jobs=self.jobs,
                                            max_workers=self.max_workers,
                                            width64=self.width // 64),
                R.REG_SLOTS: self.slots, R.REG_MAX_PAYLOAD: self.max_payload,
                R.REG_MAC_HI: self.mac >> 32, R.REG_MAC_LO: self.mac & 0xFFFFFFFF,
                R.REG_IP: self.ip, R.REG_UDP_SPORT: self.udp_sport, R.REG_PORT: port,
                R.REG_MANAGER: self.manager,
                **{R.drop_threshold(c): t for c, t in enumerate(self.drop_thresholds)},
            }.get(off, 0)
        if kind is Space.JOB:
            job = self.job[index]
            return {R.JOB_CONFIG: job.config, R.JOB_SLOT_BASE: job.slot_base,
                    R.JOB_SLOT_COUNT: job.slot_count, R.JOB_CREDITS: job.credits,
                    R.JOB_QUORUM: job.quorum, R.JOB_COMPLETED: job.completed,
                    R.JOB_EPOCH: job.epoch, R.JOB_DEADLINE: job.deadline,
                    R.JOB_OWNER: job.owner}.get(off, 0)       # KEY reads 0
        if kind is Space.WORKER:
            j, rank = index
            w = self.job[j].table[rank]
            return (
                R.WORKER_ENDPOINT.pack(switch_port=w.port, udp_port=w.udp_port), w.mac >> 32,
                w.mac & 0xFFFFFFFF, w.ip, w.qpn, w.rkey, w.va >> 32, w.va & 0xFFFFFFFF,
            )[off]
        if kind is Space.BEAT:
            j, rank = index
            return self.job[j].beats[rank]
        if kind is Space.PORT_COUNTER:
            return self.port_counters[index][R.PORT_COUNTERS[off]] & 0xFFFFFFFF
        if kind is Space.JOB_COUNTER:
            return self.job_counters[index][R.JOB_COUNTERS[off]] & 0xFFFFFFFF
        return 0

    def apply(self, addr: int, value: int, source: int, port: int):
        """A control request's write of `value` at `addr`, from IPv4 address `source` on
        `port`: written, or refused and counted."""
        refusal = self._write_refusal(addr, value, source)
        kind, index, off = self._decode(addr)
        if refusal is Refusal.DENIED:
            self.port_counters[port][refusal.value] += 1
        elif refusal is Refusal.REFUSED:
            self.job_counters[index][refusal.value] += 1
        elif kind is Space.JOB and off == R.JOB_CONFIG:
            job = self.job[index]
            enabling, was = bool(R.CONFIG.unpack(value)["enable"]), job.enable
            self.write(addr, value)
            job.owner = (job.owner if was else source) if enabling else 0
        else:
            self.write(addr, value)

    def _write_refusal(self, addr: int, value: int, source: int) -> Refusal | None:
        """Why a write of `value` at `addr` from `source` is refused, or None."""
        kind, index, off = self._decode(addr)
        by_manager = self.manager != 0 and source == self.manager
        if kind is Space.GLOBAL:
            ok = off not in SWITCH_WRITABLE or self.manager == 0 or by_manager
            return None if ok else Refusal.DENIED
        if kind is Space.BEAT:          # a rank's own address, or the manager
            ip = self.job[index[0]].table[index[1]].ip
            return None if (ip != 0 and source == ip) or by_manager else Refusal.DENIED
        if kind not in (Space.JOB, Space.WORKER):
            return None
        j = index if kind is Space.JOB else index[0]
        job = self.job[j]
        own_entry = kind is Space.WORKER and job.table[index[1]].ip in (0, source)
        if job.enable and source != job.owner and not by_manager and not own_entry:
            return Refusal.DENIED
        if kind is Space.JOB and off in (R.JOB_SLOT_BASE, R.JOB_SLOT_COUNT) and job.enable:
            return Refusal.REFUSED
        if (kind is Space.JOB and off == R.JOB_CONFIG and R.CONFIG.unpack(value)["enable"]
                and not self._range_free(j)):
            return Refusal.REFUSED
        return None

    def _range_free(self, j: int) -> bool:
        """Whether job j's slot range is inside the switch's slots and shares no slot with
        another enabled job's (an empty range shares none)."""
        job = self.job[j]
        end = job.slot_base + job.slot_count
        if end > self.slots:
            return False
        return not any(
            k != j and other.enable and job.slot_count and other.slot_count
            and job.slot_base < other.slot_base + other.slot_count and other.slot_base < end
            for k, other in enumerate(self.job))

    def write(self, addr: int, value: int):
        """Write a register, whoever asks (`apply` judges a control request's records)."""
        kind, index, off = self._decode(addr)
        if kind is Space.GLOBAL:
            if off in (R.REG_MAC_HI, R.REG_MAC_LO):
                self.mac = mac_half(self.mac, value, off == R.REG_MAC_HI)
            elif off == R.REG_IP:
                self.ip = value
            elif off == R.REG_UDP_SPORT:
                self.udp_sport = value & 0xFFFF
            elif off == R.REG_MANAGER:
                self.manager = value
            elif 0 <= off - R.REG_DROP_THRESHOLD < R.PRIORITY_CLASSES:
                self.drop_thresholds[off - R.REG_DROP_THRESHOLD] = value & 0xFFFF
        elif kind is Space.JOB:
            job = self.job[index]
            if off == R.JOB_CONFIG:
                config = R.CONFIG.unpack(value)
                job.enable = bool(config["enable"])
                job.workers = min(config["workers"], self.max_workers)
                self._clear(job)
            elif off == R.JOB_SLOT_BASE:
                job.slot_base = value & 0xFFFF
            elif off == R.JOB_SLOT_COUNT:
                job.slot_count = value & 0xFFFF
            elif off == R.JOB_CREDITS:
                job.credits = value & 0xFFFF
            elif off == R.JOB_QUORUM:
                job.quorum = value & 0x3F
            elif off == R.JOB_EPOCH:
                job.epoch = value
            elif off == R.JOB_KEY:
                job.key = value
            elif off == R.JOB_DEADLINE:
                job.deadline = value & ((1 << R.DEADLINE_BITS) - 1)
        elif kind is Space.WORKER:
            j, rank = index
            w = self.job[j].table[rank]
            if off == R.WORKER_PORT:
                endpoint = R.WORKER_ENDPOINT.unpack(value)
                w.port, w.udp_port = endpoint["switch_port"], endpoint["udp_port"]
            elif off in (R.WORKER_MAC_HI, R.WORKER_MAC_LO):
                w.mac = mac_half(w.mac, value, off == R.WORKER_MAC_HI)
            elif off == R.WORKER_IP:
                w.ip = value
            elif off == R.WORKER_QPN:
                w.qpn = value & 0xFFFFFF
            elif off == R.WORKER_RKEY:
                w.rkey = value
            elif off == R.WORKER_VA_HI:
                w.va = (value << 32) | (w.va & 0xFFFFFFFF)
            elif off == R.WORKER_VA_LO:
                w.va = (w.va & ~0xFFFFFFFF) | value
        elif kind is Space.BEAT:
            j, rank = index
            self.job[j].beats[rank] = value & 0xFFFFFFFF


def mac_half(mac: int, value: int, high: bool) -> int:
    """A 48-bit MAC with its bits 47-32 (`high`) or 31-0 replaced by a register's value."""
    if high:
        return ((value & 0xFFFF) << 32) | (mac & 0xFFFFFFFF)
    return (mac & ~0xFFFFFFFF) | (value & 0xFFFFFFFF)
