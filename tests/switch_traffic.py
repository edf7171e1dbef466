"""Switch traffic built with scapy: control requests, contributions, and whole scenarios of
N workers (several jobs, duplicates, reordering, malformed, stale and beyond-credit frames
between good ones) with the sums numpy expects. Used by the golden-model tests and the switch
testbench alike.

Every contribution carries its job's KEY in RETH.rkey and its message sequence number (MSN)
in RETH.va's top half, as the host does: msn = use * slot_count + slot, where use counts the
job's uses of the slot from 0 after its CONFIG write. A `Worker` numbers its uses itself (see
`Worker.use_msn`)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.scapy_frames import RETH, ImmDt
from tests.frames import mac_str, scapy_frame

SWITCH_IP = "10.0.0.1"
SWITCH_MAC = 0x02AA00000001
HOST_IP = "10.0.9.9"          # where control requests come from
SWITCH = W.Endpoint(SWITCH_IP, W.ROCEV2_PORT, SWITCH_MAC)


def control_frame(records, psn=0, *, src_ip=HOST_IP, sport=0xD000, src_mac=0x02BB00000009):
    return scapy_frame(W.OP_CONTROL, W.CONTROL_QPN, psn, W.pack_records(records),
                       W.Endpoint(src_ip, sport, src_mac), SWITCH)


def dissect(frame: bytes) -> Ether:
    """scapy's reading of a frame, with the UDP payload read as a BTH whatever the ports
    (scapy binds the BTH to destination port 4791 only; results and control replies go to
    the worker's own UDP port)."""
    pkt = Ether(frame)
    if BTH not in pkt:
        udp = pkt[UDP]
        bth = BTH(bytes(udp.payload))
        udp.remove_payload()
        pkt = pkt / bth
        pkt = Ether(bytes(pkt))
        pkt[UDP].remove_payload()
        pkt = pkt / bth
    return pkt


def scapy_rebuilds(frame: bytes) -> bool:
    """Whether scapy, dissecting `frame` and recomputing lengths, checksum and ICRC, gives
    back the same bytes."""
    pkt = dissect(frame)
    del pkt[IP].len, pkt[IP].chksum, pkt[UDP].len, pkt[BTH].icrc
    return bytes(pkt) == frame


@dataclasses.dataclass
class Worker:
    job: int
    rank: int
    ip: str
    mac: int
    udp_port: int
    port: int          # the switch port results leave on
    qpn: int
    rkey: int
    va: int
    slot_count: int = 1            # the job's slot count, for the MSN
    key: int = 0                   # the job's KEY, every contribution's RETH.rkey
    uses: dict = dataclasses.field(default_factory=dict, repr=False)  # slot -> (use, version)

    def use_msn(self, slot: int, version: int) -> int:
        """The MSN of this worker's use of `slot` with `version`: the use it last built for
        the slot when the version is the same (a retransmission), else the next use (the
        first is use 0), as workers alternate versions across uses."""
        use, last = self.uses.get(slot, (-1, None))
        if version != last:
            use += 1
            self.uses[slot] = (use, version)
        return use * self.slot_count + slot

    def restart(self):
        """Count uses from 0 again (after the job's CONFIG was written)."""
        self.uses.clear()

    def contribution(self, slot, version, offset, lanes: np.ndarray, psn, exponent=0,
                     ingress_sport=None, length=None, msn=None, droppable=False, dscp=0,
                     **overrides) -> bytes:
        """A contribution frame. `msn` None: the MSN of this use (`use_msn`, which counts
        it); else that MSN, and the worker's use count is left alone (stale messages,
        messages beyond the credit, frames meant to be dropped). `key=` overrides the job's
        key."""
        payload = lanes.astype("<i4").tobytes()
        if msn is None:
            msn = self.use_msn(slot, version)
        imm = W.pack_imm(W.REQUEST_IMM, job=overrides.pop("job", self.job),
                         rank=overrides.pop("rank", self.rank), version=version, slot=slot,
                         exponent=exponent, droppable=int(droppable))
        src = W.Endpoint(overrides.pop("ip", self.ip), ingress_sport or self.udp_port, self.mac)
        key = overrides.pop("key", self.key)
        if overrides:
            raise TypeError(f"unknown overrides {sorted(overrides)}")
        return scapy_frame(W.OP_CONTRIBUTION, 2, psn, payload, src, SWITCH,
                           reth=(W.contribution_va(msn, offset), key,
                                 len(payload) if length is None else length),
                           imm=imm, dscp=dscp)


def job_config_records(job: int, workers: list[Worker], slot_base: int, slot_count: int,
                       credits: int = 0, quorum: int = 0):
    """Control records that set up `job`: disabled first (an enabled job's slot range is
    fixed), CONFIG last (which enables it and clears its slots and COMPLETED); its KEY the
    workers'."""
    recs = [(R.WRITE | R.job_reg(job, R.JOB_CONFIG), 0),
            (R.WRITE | R.job_reg(job, R.JOB_SLOT_BASE), slot_base),
            (R.WRITE | R.job_reg(job, R.JOB_SLOT_COUNT), slot_count),
            (R.WRITE | R.job_reg(job, R.JOB_CREDITS), credits),
            (R.WRITE | R.job_reg(job, R.JOB_QUORUM), quorum),
            (R.WRITE | R.job_reg(job, R.JOB_KEY), workers[0].key if workers else 0)]
    for w in workers:
        recs += [(R.WRITE | a, v) for a, v in W.entry_records(
            job, w.rank, w.port, W.Endpoint(w.ip, w.udp_port, w.mac), w.qpn, va=w.va,
            rkey=w.rkey)]
    recs.append((R.WRITE | R.job_reg(job, R.JOB_CONFIG),
                 R.CONFIG.pack(enable=1, workers=len(workers))))
    return recs


def switch_records():
    return [(R.WRITE | R.REG_MAC_HI, SWITCH_MAC >> 32), (R.WRITE | R.REG_MAC_LO,
            SWITCH_MAC & 0xFFFFFFFF), (R.WRITE | R.REG_IP, W.ip_to_int(SWITCH_IP))]


def make_workers(job: int, n: int, ports: int, rng: random.Random,
                 slot_count: int = 1) -> list[Worker]:
    return [Worker(job=job, rank=r, ip=f"10.{job + 1}.0.{r + 10}",
                   mac=0x020000000000 | (job << 8) | r,
                   udp_port=0xC100 + 16 * job + r, port=(r + job) % ports,
                   qpn=rng.randrange(1, 1 << 24), rkey=rng.randrange(1 << 32),
                   va=rng.randrange(1 << 63), slot_count=slot_count, key=job_key(job))
            for r in range(n)]


def job_key(job: int) -> int:
    """The KEY the tests give job `job` (one of its own for each job)."""
    return 0x6B650000 | job << 8 | 0x5A


@dataclasses.dataclass
class Scenario:
    """Configuration frames, then contribution frames (each tagged with an ingress port),
    and what every result must hold."""

    config: list                  # control frames, in order, all on port 0
    rounds: list                  # per round, [(ingress port, frame)]
    expected: dict                # (round, job, slot, rank) -> (lanes int32 array, overflow)
    workers: dict                 # job -> [Worker]
    slots: int = 0                # slots of each job (0: results' PSNs not checked)
    credits: int = 0              # each job's CREDITS


def scenario(rng: random.Random, *, ports: int, jobs: int = 2, workers: int = 3, slots: int = 8,
             rounds: int = 2, max_lanes: int = 256, duplicates: float = 0.1,
             malformed: float = 0.05, saturate: bool = False, credits: int = 0,
             stale: float = 0.0, droppable: float = 0.0, bad_keys: float = 0.0) -> Scenario:
    """Each job allreduces `rounds` uses of each of its `slots` slots (versions alternating,
    MSN use * slots + slot). A round's packets are shuffled; some are sent twice; malformed
    frames and misaddressed contributions are mixed in. A round is sent once the one before
    it has been answered, as workers do (a worker reuses a slot only after it has the result
    of its previous use).

    `credits`: the jobs' CREDITS (`slots` is the tightest that never drops a good
    contribution). With probability `stale`, a contribution also goes out with an MSN the
    switch must drop: one older than its copy's last two uses (from round 2 on;
    `drop_stale`), or, with credits, one beyond the credit limit (`drop_credit`).
    With probability `droppable`, a contribution is droppable, of a random priority class
    (the thresholds stay NEVER_DROP: none is dropped). With probability `bad_keys`, a copy of
    a contribution also goes out with a key other than its job's (another job's, or the
    worker's R_Key of results), which the switch drops (`drop_bad_key`)."""
    ws = {j: make_workers(j, workers, ports, rng, slots) for j in range(jobs)}
    config = [control_frame(switch_records(), psn=0)]
    for j in range(jobs):
        config.append(control_frame(job_config_records(j, ws[j], j * slots, slots, credits),
                                    psn=j + 1))
    expected, rounds_out, psn = {}, [], {}
    for rnd in range(rounds):
        batch = []
        version = rnd % 2
        for j in range(jobs):
            for s in range(slots):
                n = rng.randrange(1, max_lanes + 1)
                limit = 1 << 31 if saturate else 1 << 28
                contrib = [np.array([rng.randrange(-limit, limit) for _ in range(n)], np.int64)
                           for _ in range(workers)]
                total = sum(contrib)
                clipped = np.clip(total, -(1 << 31), (1 << 31) - 1)
                for w in ws[j]:
                    expected[(rnd, j, s, w.rank)] = (clipped.astype(np.int32),
                                                         bool((clipped != total).any()))
                for w, lanes in zip(ws[j], contrib):
                    key = (j, w.rank)
                    psn[key] = psn.get(key, -1) + 1
                    marks = {}
                    if droppable and rng.random() < droppable:
                        marks = dict(droppable=True, dscp=W.priority_dscp(rng.randrange(8)))
                    f = w.contribution(s, version, 4096 * s, lanes.astype(np.int32), psn[key],
                                       exponent=rng.randrange(-8, 8), **marks)
                    port = rng.randrange(ports)
                    batch.append((port, f))
                    if rng.random() < duplicates:
                        batch.append((rng.randrange(ports), f))
                    if rng.random() < malformed:
                        batch.append((port, _malformed(rng, f, w)))
                    if bad_keys and rng.random() < bad_keys:
                        other = rng.choice((job_key(j + 1), w.rkey, 0))
                        batch.append((rng.randrange(ports), w.contribution(
                            s, version, 4096 * s, lanes.astype(np.int32) + 1, psn[key],
                            msn=rnd * slots + s, key=other)))
                    if stale and rng.random() < stale:
                        msn = rnd * slots + s
                        if credits and (rnd < 2 or rng.random() < 0.5):
                            msn = (rnd + 1) * slots + credits + s      # beyond any limit
                        elif rnd >= 2:
                            msn -= 3 * slots         # older than both copies' last uses
                        else:
                            continue
                        batch.append((rng.randrange(ports),
                                      w.contribution(s, version, 4096 * s, np.ones(4, np.int32),
                                                     psn[key], msn=msn)))
        rng.shuffle(batch)
        rounds_out.append(batch)
    return Scenario(config, rounds_out, expected, ws, slots, credits)


def _malformed(rng: random.Random, good: bytes, w: Worker) -> bytes:
    """A frame that must be dropped without touching any slot."""
    kind = rng.randrange(5)
    if kind == 0:      # bad ICRC
        b = bytearray(good)
        b[-1 - rng.randrange(4)] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 1:      # truncated
        return good[:rng.randrange(20, len(good) - 1)]
    if kind == 2:      # another rank's IP claimed (bad worker)
        return w.contribution(0, 0, 0, np.ones(4, np.int32), 0, rank=(w.rank + 1) % 32,
                              ip="10.99.0.1", msn=0)
    if kind == 3:      # slot outside the job
        return w.contribution(1000, 0, 0, np.ones(4, np.int32), 0, msn=0)
    return w.contribution(0, 0, 0, np.ones(4, np.int32), 0, job=15, msn=0)   # unknown job


def run_rounds(sw, sc):
    """Each round's frames through the model; the outputs, each tagged with its round."""
    outputs = []
    for rnd, batch in enumerate(sc.rounds):
        for port, frame in batch:
            sw.send(port, frame)
        outputs += [(rnd, port, frame) for port, frame in sw.run()]
    return outputs


def check_results(sc, outputs):
    """Every result equals numpy's sum, reaches the right worker once per use (replays
    aside), and is a frame scapy rebuilds to the same bytes; its PSN is the job's credit
    limit (COMPLETED + CREDITS), COMPLETED within its round's uses. Returns (round, job,
    slot, rank) -> [PSN of each copy received]."""
    seen = {}
    by_ip = {w.ip: w for ws in sc.workers.values() for w in ws}
    for rnd, port, frame in outputs:
        assert scapy_rebuilds(frame)
        pkt = dissect(frame)
        w = by_ip[pkt[IP].dst]
        assert port == w.port
        assert pkt.dst == mac_str(w.mac) and pkt.src == mac_str(SWITCH_MAC)
        assert pkt[IP].src == SWITCH_IP and pkt[UDP].dport == w.udp_port
        assert pkt[BTH].opcode == W.OP_RESULT and pkt[BTH].dqpn == w.qpn
        imm = W.unpack_imm(W.RESULT_IMM, ImmDt(bytes(pkt[BTH].payload)[16:20]).data)
        reth = RETH(bytes(pkt[BTH].payload)[:16])
        lanes = np.frombuffer(bytes(pkt[BTH].payload)[20:], "<i4")
        assert imm["version"] == rnd % 2
        sums, overflow = sc.expected[(rnd, imm["job"], imm["slot"], w.rank)]
        np.testing.assert_array_equal(lanes, sums)
        assert imm["overflow"] == overflow and imm["count"] == len(sc.workers[imm["job"]])
        assert reth.rkey == w.rkey and reth.dma_length == 4 * len(sums)
        assert reth.va == (w.va + 4096 * imm["slot"]) % (1 << 64)
        if sc.slots:
            completed = W.unwrap(pkt[BTH].psn - sc.credits, rnd * sc.slots)
            assert rnd * sc.slots < completed <= (rnd + 1) * sc.slots, (rnd, pkt[BTH].psn)
        seen.setdefault((rnd, imm["job"], imm["slot"], w.rank), []).append(
            pkt[BTH].psn)
    assert set(seen) == set(sc.expected)
    return seen
