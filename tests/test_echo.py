"""The echo switch (sim.echo): each contribution answered at once, to its sender alone, with
the result a job of one worker gives; the golden model's control path and checks; its lean
path and its run path (sim.echo_run) frame for frame and counter for counter as `receive`.
Over UDP through `SimServer`, read with scapy; and `sim.bench` measuring it."""

from __future__ import annotations

import functools
import random
import select
import socket
import uuid

import numpy as np
import pytest
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import SwitchControl, Worker
from netagg.host import udp_offload as U
from netagg.host.udp_socket import IP_MTU_DISCOVER, IP_PMTUDISC_DO, switch_port_for
from netagg.sim.bench import contributions_per_second
from netagg.sim.echo import RUN_MIN, EchoSwitch, RankCopies
from netagg.sim.golden import GoldenSwitch
from netagg.sim.scapy_frames import RETH, ImmDt
from netagg.sim.serve import SimServer, make_backend
from tests.switch_traffic import (
    SWITCH_IP,
    control_frame,
    dissect,
    job_config_records,
    make_workers,
    scapy_rebuilds,
    scenario,
    switch_records,
)

JOB, SLOT_BASE, SLOTS, CREDITS = 1, 4, 8, 3
KEY = 0xACE0C0DE                # the job's KEY, every contribution's RETH.rkey


class Sender:
    """A worker at the wire level: a UDP socket (Don't Fragment: the canonical IPv4 header the
    ICRC covers), its rank and its job-table entry."""

    def __init__(self, rank: int, server: SimServer):
        self.rank, self.server = rank, server
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        self.sock.bind(("127.0.0.1", 0))
        self.local = W.Endpoint(*self.sock.getsockname())
        self.qpn, self.rkey, self.va = 0x120 + rank, 0xACE00000 + rank, (rank + 1) << 36

    def row(self) -> list:
        """Its job-table entry, as (register, value) pairs."""
        port = switch_port_for(self.local.ip, self.local.port, self.server.ports)
        return W.entry_records(JOB, self.rank, port, self.local, self.qpn, va=self.va,
                               rkey=self.rkey)

    def send(self, slot: int, version: int, lanes: np.ndarray, msn: int, **kw):
        pkt = W.contribution(job=JOB, rank=self.rank, slot=slot, version=version,
                             offset=0x40 * slot, lanes=lanes.astype("<i4").tobytes(),
                             psn=100 + msn, src=self.local, dst=W.Endpoint(*self.server.address),
                             msn=msn, **{"key": KEY, **kw})
        self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, pkt.dscp << 2)
        self.sock.sendto(pkt.datagram(), self.server.address)

    def result(self, timeout: float = 2.0):
        """The next datagram: scapy's reading of it (as a frame with the canonical headers,
        whose ICRC scapy recomputes to the same bytes) and where it came from."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        assert ready, f"rank {self.rank}: no result"
        data, sender = self.sock.recvfrom(4096)
        frame = W.wrap_datagram(W.Endpoint(*sender), self.local, data)
        assert scapy_rebuilds(frame)
        return dissect(frame), sender

    def nothing_waiting(self) -> bool:
        return not select.select([self.sock], [], [], 0.2)[0]


def check_result(pkt, sender: Sender, slot: int, version: int, lanes, exponent: int,
                 psn: int, count: int = 1):
    """A result field by field: the sender's own lanes, count 1, its exponent, addressed from
    its job-table entry, the credit limit in BTH.psn."""
    bth = pkt[BTH]
    body = bytes(bth.payload)
    reth, imm = RETH(body[:16]), W.unpack_imm(W.RESULT_IMM, ImmDt(body[16:20]).data)
    assert pkt[IP].dst == sender.local.ip and pkt[UDP].dport == sender.local.port
    assert bth.opcode == W.OP_RESULT and bth.dqpn == sender.qpn and bth.psn == psn
    assert reth.va == sender.va + 0x40 * slot and reth.rkey == sender.rkey
    assert reth.dma_length == 4 * len(lanes)
    assert imm == {"job": JOB, "count": count, "version": version, "slot": slot,
                   "exponent": exponent, "overflow": 0}
    assert np.array_equal(np.frombuffer(body[20:], "<i4"), lanes)


def test_each_contribution_is_answered_at_once_to_its_sender_alone():
    """Two ranks of a job: rank 0's contribution is answered before rank 1 sends, each with
    its own lanes; a retransmission is a replay with the current credit limit, an older
    message is dropped, a null is answered with zeros and count 0, and the counters and
    COMPLETED count a use per contribution."""
    with SimServer(make_backend("echo", jobs=2, max_workers=4, slots=16)).start() as server:
        senders = [Sender(r, server) for r in range(2)]
        ctl = SwitchControl(server.url)
        ctl.write([(R.REG_IP, W.ip_to_int(server.bound_ip))]
                  + [pair for s in senders for pair in s.row()]
                  + [(R.job_reg(JOB, R.JOB_SLOT_BASE), SLOT_BASE),
                     (R.job_reg(JOB, R.JOB_SLOT_COUNT), SLOTS),
                     (R.job_reg(JOB, R.JOB_CREDITS), CREDITS),
                     (R.job_reg(JOB, R.JOB_CONFIG), R.CONFIG.pack(enable=1, workers=2)),
                     (R.job_reg(JOB, R.JOB_KEY), KEY)])
        rng = np.random.default_rng(5)
        lanes = [rng.integers(-2**31, 2**31, 200, dtype=np.int64).astype(np.int32)
                 for _ in senders]
        for s, x in zip(senders, lanes):            # each answered before the next sends
            s.send(slot=2, version=0, lanes=x, msn=2, exponent=s.rank - 3)
            pkt, source = s.result()
            assert source == (server.bound_ip, 0xC000)
            check_result(pkt, s, 2, 0, x, s.rank - 3, psn=s.rank + 1 + CREDITS)
        assert all(s.nothing_waiting() for s in senders)     # to the sender alone
        a = senders[0]
        a.send(slot=2, version=0, lanes=lanes[0], msn=2, exponent=-3)      # retransmission
        check_result(a.result()[0], a, 2, 0, lanes[0], -3, psn=2 + CREDITS)
        a.send(slot=2, version=0, lanes=lanes[0], msn=1)                   # older: dropped
        a.send(slot=3, version=0, lanes=lanes[0], msn=3, key=KEY ^ 1)      # bad key: dropped
        assert a.nothing_waiting()
        ctl.write([(R.drop_threshold(0), 0)])          # class 0 droppable: always nulled
        a.send(slot=2, version=0, lanes=lanes[0], msn=4, droppable=True)   # within credit
        check_result(a.result()[0], a, 2, 0, np.zeros(200, np.int32), 0, psn=3 + CREDITS,
                     count=0)
        c = ctl.counters(jobs=[JOB])["jobs"][JOB]
        assert (c["contributions"], c["completed"], c["replays"], c["drop_stale"],
                c["drop_bad_key"], c["results"]) == (3, 3, 1, 1, 1, 4)
        assert ctl.read(R.job_reg(JOB, R.JOB_COMPLETED)) == [3]
        ctl.close()
        for s in senders:
            s.sock.close()


@pytest.mark.parametrize("seed", range(3))
def test_results_are_those_of_a_job_of_one_worker(seed):
    """Frame for frame, the echo switch answers a rank of a job of three as the golden model
    answers the same rank alone in a job of one (both from the rank's first use on)."""
    rng = random.Random(seed)
    [w] = make_workers(0, 1, 2, rng, slot_count=SLOTS)
    echo, golden = EchoSwitch(ports=2, jobs=1, max_workers=4), GoldenSwitch(ports=2, jobs=1)
    others = make_workers(0, 3, 2, rng, slot_count=SLOTS)[1:]           # ranks 1 and 2
    for sw, ws in ((echo, [w, *others]), (golden, [w])):
        for records in (switch_records(), job_config_records(0, ws, 0, SLOTS, SLOTS)):
            sw.receive(0, control_frame(records))
    for use in range(3):
        for slot in rng.sample(range(SLOTS), SLOTS):
            lanes = np.array([rng.randrange(-2**31, 2**31) for _ in range(64)], np.int32)
            frame = w.contribution(slot, use % 2, 64 * slot, lanes, use,
                                   exponent=rng.randrange(-8, 8))
            expected = golden.receive(w.port, frame)
            assert len(expected) == 1 and echo.receive(w.port, frame) == expected
            assert dissect(expected[0][1])[IP].src == SWITCH_IP


class _Frames(EchoSwitch):
    """An echo switch that applies every frame through the golden model's `receive` only."""

    def _answer(self, port, frame):
        return None


def assert_same_copies(a: EchoSwitch, b: EchoSwitch):
    for name in (*RankCopies.FIELDS, "sums"):
        assert np.array_equal(getattr(a.copies, name), getattr(b.copies, name)), name


@pytest.mark.parametrize("seed", range(3))
def test_the_lean_path_sends_and_counts_what_receive_does(seed):
    """Frame for frame, `send` (the lean path for new uses) gives what `receive` gives, with
    the same counters and COMPLETED, over a stream with duplicates (replays), malformed
    frames, stale messages and messages beyond the credit, droppable ones nulled from the
    second round (a class's threshold 0, written between rounds), and a job reconfigured."""
    sc = scenario(random.Random(seed), ports=4, jobs=2, workers=3, slots=8, rounds=4,
                  max_lanes=64, duplicates=0.2, malformed=0.1, credits=8, stale=0.2,
                  droppable=0.3, bad_keys=0.05)
    lean, frames = EchoSwitch(ports=4), _Frames(ports=4)
    between = [[(0, control_frame([(R.WRITE | R.drop_threshold(c), 0) for c in range(8)]))],
               [(1, control_frame(job_config_records(1, sc.workers[1], 8, 8, 8)))], []]
    for batch in [[(0, f) for f in sc.config], *(b + m for b, m in zip(sc.rounds, between))]:
        for port, frame in batch:
            lean.send(port, frame)
            assert lean.run() == frames.receive(port, frame)
    assert lean.counters() == frames.counters()
    assert [job.completed for job in lean.job] == [job.completed for job in frames.job]
    assert_same_copies(lean, frames)
    assert lean._replies and not frames._replies        # the lean path was taken
    c = lean.counters()
    assert all(sum(scope[name] for scope in c["jobs"]) for name in (
        "contributions", "replays", "drop_credit", "drop_stale", "drop_bad_worker",
        "drop_bad_key"))
    assert all(sum(scope[name] for scope in c["ports"]) for name in (
        "drop_priority", "drop_bad_icrc", "control"))


def _run(frames: list[bytes], renumber: bool) -> tuple[list, bytes, int]:
    """Frames of one length as a run (heads, datagrams, length); `renumber`: as a GSO run of
    them arrives, each segment with the identification the kernel gives it (and its ICRC,
    made for identification 0, for it: `udp_offload.ident_deltas`)."""
    size = len(frames[0]) - W.BTH_OFFSET
    body = bytearray(b"".join(f[W.BTH_OFFSET:] for f in frames))
    heads = [f[:W.BTH_OFFSET] for f in frames]
    if renumber:
        heads = [heads[0][:W.IP_OFFSET] + h for h in U.segment_headers(
            heads[0][W.IP_OFFSET:], size, size * len(frames))]
        icrc = np.frombuffer(body, "<u4").reshape(len(frames), -1)[:, -1]
        icrc ^= U.ident_deltas(size)[:len(frames)]
    return heads, bytes(body), size


def _runs(rng: random.Random, workers: list, slots: int, credits: int, steps: int):
    """Runs of one worker's contributions to some slots, a use at a time, each row perhaps
    replaced or followed by one the run path must not take: a stale or duplicated message
    (a replay), one beyond the credit, a corrupted ICRC or IPv4 header, another rank's, its
    rank claimed, one of a bad length, slot or key, a droppable one."""
    use = {}
    for step in range(steps):
        w = workers[step % len(workers)]
        lanes = rng.choice([1, 16, 64, 256])
        frames = []
        for slot in rng.sample(range(slots), rng.randrange(1, slots + 1)):
            u = use[w.rank, slot] = use.get((w.rank, slot), -1) + 1
            msn = u * slots + slot
            x = np.array([rng.randrange(-2**31, 2**31) for _ in range(lanes)], np.int32)
            frame = functools.partial(w.contribution, slot, u % 2, 64 * slot, x, step,
                                      exponent=rng.randrange(-8, 8))
            good = frame(msn=msn)
            kind = rng.randrange(16)
            if kind == 0:                                   # in its place: stale
                good = frame(msn=msn - 4 * slots)
            elif kind == 1:                                 # a corrupted ICRC
                good = bytearray(good)
                good[rng.randrange(W.BTH_OFFSET + 8, len(good))] ^= 1 << rng.randrange(8)
            elif kind == 2:                                 # a corrupted IPv4 header
                good = bytearray(good)
                good[W.IP_OFFSET + 8] ^= 1 << rng.randrange(8)
            elif kind == 3:                                 # droppable
                good = frame(msn=msn, droppable=True, dscp=W.priority_dscp(rng.randrange(8)))
            elif kind == 4:                                 # its address not its rank's
                good = frame(msn=msn, ip="10.99.0.1")
            elif kind == 10:                                # another key than the job's
                good = frame(msn=msn, key=rng.choice((w.rkey, w.key ^ 1)))
            frames.append(bytes(good))
            if kind == 5:                                   # after it: a replay
                frames.append(good)
            elif kind == 6:
                frames.append(frame(msn=msn + 64 * slots + credits))   # beyond the credit
            elif kind == 7:                                 # another rank's, its rank claimed
                other = workers[(w.rank + 1) % len(workers)]
                frames.append(other.contribution(slot, u % 2, 0, x, step, msn=msn))
                frames.append(frame(msn=msn, rank=other.rank))
            elif kind == 8:
                frames.append(frame(msn=msn, length=4 * lanes + 4))
            elif kind == 9:
                frames.append(w.contribution(slots + 3, 0, 0, x, step, msn=msn))    # slot

        yield frames


@pytest.mark.parametrize("seed", range(4))
def test_a_run_is_answered_as_receive_answers_its_frames(seed):
    """Runs of contributions through `send_run` (the run path, with what it leaves to
    `send`) give what `receive` gives frame by frame, output frame for output frame, with
    the same counters, COMPLETED and copies: runs as GSO runs arrive and as batches, with
    replays, stale, duplicated and corrupted frames, frames beyond the credit, of another
    rank, of a bad length, slot or key, droppable ones nulled (a class's threshold 0, written
    between runs), a run shorter than RUN_MIN, the job reconfigured between runs."""
    rng = random.Random(seed)
    slots, credits = 24, 64
    workers = make_workers(0, 3, 2, rng, slot_count=slots)
    lean, frames = EchoSwitch(ports=2, jobs=1), _Frames(ports=2, jobs=1)
    config = [control_frame(switch_records()),
              control_frame(job_config_records(0, workers, 8, slots, credits))]
    between = {8: control_frame([(R.WRITE | R.drop_threshold(c), 0) for c in range(0, 8, 2)]),
               16: config[1]}
    for step, run in enumerate(_runs(rng, workers, slots, credits, 30)):
        for f in ([*config] if step == 0 else []) + ([between[step]] if step in between else []):
            lean.send(0, f)
            assert lean.run() == frames.receive(0, f)
        by_length = {}
        for f in run:
            by_length.setdefault(len(f), []).append(f)
        for same in by_length.values():
            heads, body, size = _run(same, renumber=len(same) > 1 and rng.random() < 0.5)
            port = rng.randrange(2)
            lean.send_run(port, heads, body, size)
            expected = [out for h, at in zip(heads, range(0, len(body), size))
                        for out in frames.receive(port, h + body[at:at + size])]
            assert lean.run() == expected
    assert lean.counters() == frames.counters()
    assert lean.job[0].completed == frames.job[0].completed
    assert_same_copies(lean, frames)
    paths = lean.paths
    assert paths.runs and paths.run_rows > paths.runs and paths.lean and paths.receive
    assert frames.paths.lean == frames.paths.runs == 0
    c = lean.counters()
    assert all(c["jobs"][0][name] for name in (
        "contributions", "replays", "drop_credit", "drop_stale", "drop_bad_worker",
        "drop_bad_slot", "drop_bad_key"))
    assert all(sum(port[name] for port in c["ports"]) for name in (
        "drop_priority", "drop_bad_icrc", "drop_bad_ip_checksum", "drop_bad_payload"))


def test_a_worker_alone_gets_what_the_golden_model_gives():
    """host.Worker, world size 1, over UDP: int32 exact, floats bit for bit the golden
    model's."""
    rng = np.random.default_rng(1)
    ints = rng.integers(-2**24, 2**24, 5000, dtype=np.int32)
    floats = rng.standard_normal(3000).astype(np.float32)
    got = {}
    for name in ("echo", "golden"):
        with SimServer(make_backend(name)).start() as server:
            with Worker(0, 1, server.url, session=uuid.uuid4().hex, timeout=10) as w:
                got[name] = (w.allreduce(ints, timeout=20), w.allreduce(floats, timeout=20))
            if name == "echo":              # the worker's GSO runs took the run path
                assert server.backend.paths.run_rows >= RUN_MIN
    assert np.array_equal(got["echo"][0], ints)
    assert np.array_equal(got["echo"][1], got["golden"][1])


def test_bench_measures_the_echo_switch():
    r = contributions_per_second("echo", senders=2, seconds=0.5, warmup=0.2)
    assert r["errors"] == 0 and r["contributions"] > 0
    assert r["contributions_per_second"] == r["contributions"] / r["seconds"]
