"""The fast switch (sim.fast): the golden model's switch with its common contribution compiled.
Frame for frame, output and counters, the same as the golden model on scapy-built traffic
(uses, duplicates, stale messages, replays, quorum, deadlines, priority nulls, refused
contributions, saturation, control writes in the middle of a use), whole runs as one frame
after another, its sums numpy's; the differential fuzzer finds no difference; over UDP
through `SimServer`, workers' int32 allreduces are exact."""

from __future__ import annotations

import random
import uuid

import numpy as np
import pytest
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import Worker
from netagg.sim import fast_build
from netagg.sim.bench import contributions_per_second
from netagg.sim.bench_fast import in_memory
from netagg.sim.fast import FastSwitch
from netagg.sim.fuzz import Comparer, InOrder, main, stream
from netagg.sim.golden import GoldenSwitch
from netagg.sim.scapy_frames import ImmDt
from netagg.sim.serve import SimServer, make_backend
from tests.host_workers import in_threads
from tests.switch_traffic import (
    check_results,
    control_frame,
    dissect,
    job_config_records,
    make_workers,
    run_rounds,
    scenario,
    switch_records,
)

pytestmark = pytest.mark.skipif(fast_build.library() is None,
                                reason=f"{fast_build.unavailable()}")


def pair(**params) -> tuple[FastSwitch, GoldenSwitch]:
    return FastSwitch(**params), GoldenSwitch(**params)


def exchange(fast: FastSwitch, golden: GoldenSwitch, port: int, frame: bytes) -> list:
    """One frame into both; what they sent, the same."""
    fast.send(port, frame)
    got, want = fast.run(), golden.receive(port, frame)
    assert got == want
    return want


def assert_same(fast: FastSwitch, golden: GoldenSwitch):
    """Counters, every register the C++ writes (COMPLETED) and every slot copy."""
    assert fast.counters() == golden.counters()
    assert [j.completed for j in fast.job] == [j.completed for j in golden.job]
    assert fast.state == golden.state


def imm_of(frame: bytes) -> dict:
    return W.unpack_imm(W.RESULT_IMM, ImmDt(bytes(dissect(frame)[BTH].payload)[16:20]).data)


def lanes_of(frame: bytes) -> np.ndarray:
    return np.frombuffer(bytes(dissect(frame)[BTH].payload)[20:], "<i4")


def configure(switches, workers_of_jobs, slots: int = 8, credits: int = 0, quorum: int = 0):
    """The switch's addresses, then each job of `workers_of_jobs` over its own slots."""
    frames = [control_frame(switch_records())] + [
        control_frame(job_config_records(j, ws, j * slots, slots, credits, quorum))
        for j, ws in enumerate(workers_of_jobs)]
    for frame in frames:
        exchange(*switches, 0, frame)


def lanes(rng: random.Random, n: int, limit: int = 1 << 28) -> np.ndarray:
    return np.array([rng.randrange(-limit, limit) for _ in range(n)], np.int32)


@pytest.mark.parametrize("seed", range(4))
def test_uses_and_their_drops_are_the_golden_models(seed):
    """Two jobs of three workers, four rounds of uses of each slot, shuffled, through both
    switches frame for frame: duplicates, replays, malformed frames (a bad ICRC, truncated,
    another rank's address, a slot outside the job, an unknown job), stale messages and
    messages beyond the credit, other keys, saturating lanes, droppable contributions nulled
    by priority from the second round (class thresholds 0 written between rounds)."""
    sc = scenario(random.Random(seed), ports=4, jobs=2, workers=3, slots=8, rounds=4,
                  max_lanes=64, duplicates=0.2, malformed=0.1, saturate=True, credits=8,
                  stale=0.2, droppable=0.3, bad_keys=0.05)
    fast, golden = pair(ports=4)
    nulls = control_frame([(R.WRITE | R.drop_threshold(c), 0) for c in range(0, 8, 2)])
    for rnd, batch in enumerate([[(0, f) for f in sc.config], *sc.rounds]):
        if rnd == 2:
            exchange(fast, golden, 1, nulls)
        for port, frame in batch:
            exchange(fast, golden, port, frame)
    assert_same(fast, golden)
    c = fast.counters()
    jobs, ports = ({name: sum(s[name] for s in c[scope]) for name in c[scope][0]}
                   for scope in ("jobs", "ports"))
    assert all(jobs[name] for name in ("contributions", "completed", "duplicates", "replays",
                                       "drop_stale", "drop_credit", "overflows",
                                       "drop_bad_key", "drop_bad_worker", "drop_bad_slot"))
    assert all(ports[name] for name in ("drop_priority", "drop_bad_icrc", "drop_bad_job"))
    assert fast.paths.compiled > fast.paths.golden


def test_frames_given_to_the_golden_models_receive_keep_the_credit_in_step():
    """`receive` (the golden model's code alone) and `send` (the C++) taking turns at random
    on one stream with credits: COMPLETED, which the credit check reads, stays the same on
    both sides, and so does every frame out."""
    sc = scenario(random.Random(9), ports=4, jobs=2, workers=3, slots=8, rounds=4,
                  credits=8, stale=0.2)
    fast, golden = pair(ports=4)
    rng = random.Random(1)
    for port, frame in [(0, f) for f in sc.config] + [p for r in sc.rounds for p in r]:
        if rng.random() < 0.3:
            assert fast.receive(port, frame) == golden.receive(port, frame)
        else:
            exchange(fast, golden, port, frame)
    assert_same(fast, golden)
    assert sum(c["drop_credit"] for c in fast.job_counters)


@pytest.mark.parametrize("workers, saturate", [(4, False), (2, True)])
def test_every_result_carries_numpys_sums_to_every_worker(workers, saturate):
    """scapy reads every result: numpy's int32 sums (saturated: of two workers, whose one
    saturating add is numpy's clipped sum) and the overflow flag, the count of all workers,
    addressed from the job table, the credit limit in BTH.psn."""
    sc = scenario(random.Random(workers), ports=4, jobs=2, workers=workers, slots=8,
                  rounds=3, saturate=saturate, credits=8)
    fast = FastSwitch(ports=4)
    for frame in sc.config:
        fast.send(0, frame)
    fast.run()
    check_results(sc, run_rounds(fast, sc))


def test_a_use_completes_at_its_quorum_and_a_late_contribution_is_a_replay():
    """Quorum 2 of 3: the second contribution completes the use, to all three workers with
    count 2; the third is a replay, answered to it alone."""
    rng = random.Random(1)
    ws = make_workers(0, 3, 4, rng, slot_count=8)
    fast, golden = pair(ports=4)
    configure((fast, golden), [ws], quorum=2)
    x = [lanes(rng, 32) for _ in ws]
    frames = [w.contribution(3, 0, 0, v, 0) for w, v in zip(ws, x)]
    assert exchange(fast, golden, 0, frames[0]) == []
    done = exchange(fast, golden, 1, frames[1])
    assert [dissect(f)[IP].dst for _, f in done] == [w.ip for w in ws]
    assert imm_of(done[0][1])["count"] == 2
    assert np.array_equal(lanes_of(done[0][1]), x[0] + x[1])
    [(port, replay)] = exchange(fast, golden, 2, frames[2])
    assert port == ws[2].port
    assert dissect(replay)[IP].dst == ws[2].ip and imm_of(replay)["count"] == 2
    assert_same(fast, golden)
    assert fast.job_counters[0]["replays"] == 1


def test_a_use_past_its_deadline_closes_short_at_a_contribution_sent_again():
    """DEADLINE 3 ticks: two of three contribute; before the deadline a contribution sent
    again is a duplicate, after it the use closes (`closed_late`) with what it has, to every
    worker."""
    rng = random.Random(2)
    ws = make_workers(0, 3, 4, rng, slot_count=8)
    fast, golden = pair(ports=4)
    configure((fast, golden), [ws])
    exchange(fast, golden, 0, control_frame([(R.WRITE | R.job_reg(0, R.JOB_DEADLINE), 3)]))
    x = [lanes(rng, 16) for _ in ws]
    first = [w.contribution(5, 0, 64, v, 0) for w, v in zip(ws[:2], x)]
    for port, frame in enumerate(first):
        exchange(fast, golden, port, frame)
    for _ in range(2):
        fast.tick(), golden.tick()
    assert exchange(fast, golden, 0, first[0]) == []            # a duplicate
    fast.tick(), golden.tick()
    closed = exchange(fast, golden, 0, first[0])
    assert len(closed) == 3 and imm_of(closed[0][1])["count"] == 2
    assert np.array_equal(lanes_of(closed[0][1]), x[0] + x[1])
    assert fast.job_counters[0]["closed_late"] == 1 and fast.job_counters[0]["duplicates"] == 1
    assert_same(fast, golden)


def test_priority_nulls_add_zeros_and_are_not_counted_as_data():
    """Class 1's threshold 0: its droppable contributions are nulls (their lanes zeros,
    `drop_priority`, not in the result's count); a forced decision and a queue's fill go
    through the golden model's code and decide the same."""
    rng = random.Random(3)
    ws = make_workers(0, 3, 4, rng, slot_count=8)
    fast, golden = pair(ports=4)
    configure((fast, golden), [ws])
    exchange(fast, golden, 0, control_frame([(R.WRITE | R.drop_threshold(1), 0),
                                             (R.WRITE | R.drop_threshold(2), 100)]))
    x = [lanes(rng, 8) for _ in ws]
    dscp = W.priority_dscp(1)
    exchange(fast, golden, 0, ws[0].contribution(0, 0, 0, x[0], 0, droppable=True, dscp=dscp))
    exchange(fast, golden, 1, ws[1].contribution(0, 0, 0, x[1], 0, droppable=True))
    done = exchange(fast, golden, 2, ws[2].contribution(0, 0, 0, x[2], 0))
    assert imm_of(done[0][1])["count"] == 2
    assert np.array_equal(lanes_of(done[0][1]), x[1] + x[2])
    later = [w.contribution(1, 0, 0, v, 0, droppable=True, dscp=W.priority_dscp(2))
             for w, v in zip(ws, x)]
    for (port, frame), fill, null in zip(enumerate(later), (0, 100, 0), (None, None, True)):
        fast.send(port, frame, fill=fill, null=null)
        assert fast.run() == golden.receive(port, frame, fill=fill, null=null)
    assert fast.port_counters[0]["drop_priority"] == 1
    assert sum(c["drop_priority"] for c in fast.port_counters) == 3
    assert_same(fast, golden)


def test_refused_and_malformed_frames_are_dropped_and_counted_as_the_golden_model_does():
    """A bad key, a source address not the rank's, a rank outside the job, a slot outside
    it, an unknown or disabled job, a dma_length not the payload's, a pad, a payload larger
    than the queue, a bad ICRC, a truncated frame, a bad IPv4 checksum, another opcode."""
    rng = random.Random(4)
    ws = make_workers(0, 3, 4, rng, slot_count=8)
    fast, golden = pair(ports=4, queue_capacity=512)
    configure((fast, golden), [ws])
    w, x = ws[0], lanes(rng, 16)
    good = w.contribution(2, 0, 0, x, 0, msn=2)
    frames = [w.contribution(2, 0, 0, x, 0, msn=2, key=w.key ^ 1),
              w.contribution(2, 0, 0, x, 0, msn=2, ip="10.99.0.1"),
              w.contribution(2, 0, 0, x, 0, msn=2, rank=5),
              w.contribution(9, 0, 0, x, 0, msn=9),
              w.contribution(2, 0, 0, x, 0, msn=2, job=3),
              w.contribution(2, 0, 0, x, 0, msn=2, job=15),
              w.contribution(2, 0, 0, x, 0, msn=2, length=60),
              w.contribution(2, 0, 0, lanes(rng, 200), 0, msn=2),
              good[:-1] + bytes([good[-1] ^ 1]), good[:-3],
              good[:W.IP_OFFSET + 10] + b"\0\0" + good[W.IP_OFFSET + 12:],
              good[:W.BTH_OFFSET] + bytes([0x2A]) + good[W.BTH_OFFSET + 1:]]
    padded = bytearray(good)
    padded[W.BTH_OFFSET + 1] |= 1 << 4
    frames.append(bytes(padded))
    for port, frame in enumerate(frames):
        assert exchange(fast, golden, port % 4, frame) == []
    assert_same(fast, golden)
    assert fast.paths.golden >= len(frames) and fast.job_counters[0]["contributions"] == 0
    assert fast.job_counters[0]["drop_bad_key"] == 1
    assert fast.job_counters[0]["drop_bad_worker"] == 2
    assert exchange(fast, golden, 0, good) == []            # and the good one is taken
    assert fast.job_counters[0]["contributions"] == 1


def test_control_writes_in_the_middle_of_a_use_apply_to_its_next_contribution():
    """A use in progress: QUORUM written lower completes it at its next contribution; a
    worker's entry rewritten sends its result elsewhere; a new KEY refuses the old; CONFIG
    clears the slots and COMPLETED; a stale contribution after it begins a use again."""
    rng = random.Random(5)
    ws = make_workers(0, 4, 4, rng, slot_count=8)
    fast, golden = pair(ports=4)
    configure((fast, golden), [ws])
    x = [lanes(rng, 24) for _ in ws]
    exchange(fast, golden, 0, ws[0].contribution(1, 0, 0, x[0], 0))
    exchange(fast, golden, 0, control_frame([(R.WRITE | R.job_reg(0, R.JOB_QUORUM), 2)]))
    moved = dict(ip=W.ip_to_int("10.7.7.7"), port=R.WORKER_ENDPOINT.pack(switch_port=3,
                                                                          udp_port=0xBEEF))
    exchange(fast, golden, 0, control_frame([
        (R.WRITE | R.worker_reg(0, 3, R.WORKER_IP), moved["ip"]),
        (R.WRITE | R.worker_reg(0, 3, R.WORKER_PORT), moved["port"])]))
    done = exchange(fast, golden, 1, ws[1].contribution(1, 0, 0, x[1], 0))
    assert len(done) == 4 and done[3][0] == 3 and dissect(done[3][1])[IP].dst == "10.7.7.7"
    exchange(fast, golden, 0, control_frame([(R.WRITE | R.job_reg(0, R.JOB_KEY), 0x1234)]))
    assert exchange(fast, golden, 2, ws[2].contribution(2, 0, 0, x[2], 0)) == []
    assert fast.job_counters[0]["drop_bad_key"] == 1
    for w in ws:
        w.key = 0x1234
    exchange(fast, golden, 2, ws[2].contribution(2, 0, 0, x[2], 0, msn=2))
    config = R.CONFIG.pack(enable=1, workers=4)
    exchange(fast, golden, 0, control_frame([(R.WRITE | R.job_reg(0, R.JOB_CONFIG), config)]))
    assert fast.job[0].completed == 0 and not fast.state[2][0].bitmap
    exchange(fast, golden, 1, ws[1].contribution(1, 0, 0, x[1], 0, msn=1))
    assert_same(fast, golden)


def _runs(rng: random.Random, ws, slots: int):
    """Each worker's contributions to a random set of slots as one run (one length), some
    rows replaced or followed by one the C++ hands back (a bad ICRC, a bad key, another
    rank's address) or takes as a drop (a duplicate, a stale message)."""
    use = {}
    for step in range(24):
        w = ws[step % len(ws)]
        n = rng.choice([1, 16, 64])
        frames = []
        for slot in rng.sample(range(slots), rng.randrange(1, slots + 1)):
            u = use[w.rank, slot] = use.get((w.rank, slot), -1) + 1
            msn = u * slots + slot
            frame = w.contribution(slot, u % 2, 64 * slot, lanes(rng, n), step, msn=msn)
            kind = rng.randrange(12)
            if kind == 0:
                frame = frame[:-1] + bytes([frame[-1] ^ 0x10])
            elif kind == 1:
                frame = w.contribution(slot, u % 2, 0, lanes(rng, n), step, msn=msn,
                                       key=w.key ^ 2)
            elif kind == 2:
                frame = w.contribution(slot, u % 2, 0, lanes(rng, n), step, msn=msn,
                                       ip="10.99.0.2")
            frames.append(frame)
            if kind == 3:
                frames.append(frame)
            elif kind == 4:
                frames.append(w.contribution(slot, u % 2, 0, lanes(rng, n), step,
                                             msn=msn - 2 * slots))
        yield w.port, frames


@pytest.mark.parametrize("seed", range(3))
def test_a_run_is_taken_as_its_frames_one_after_another(seed):
    """Runs through `send_run`: the same frames out, in order, as the golden model's
    `receive` of each row, with the rows the C++ hands back among them; `sent_runs` gives
    them as one run per destination, each in order."""
    rng = random.Random(seed)
    slots = 16
    ws = make_workers(0, 3, 4, rng, slot_count=slots)
    fast, golden = pair(ports=4, slots=32)
    configure((fast, golden), [ws], slots=slots)
    for step, (port, frames) in enumerate(_runs(rng, ws, slots)):
        size = len(frames[0]) - W.BTH_OFFSET
        heads = [f[:W.BTH_OFFSET] for f in frames]
        body = b"".join(f[W.BTH_OFFSET:] for f in frames)
        fast.send_run(port, heads, body, size)
        want = [out for f in frames for out in golden.receive(port, f)]
        if step % 2:
            assert fast.run() == want
            continue
        runs = fast.sent_runs()
        for run in runs:
            assert [f for _, f in run.frames()] == [f for _, f in want if f[:W.BTH_OFFSET]
                                                    == run.head]
        assert sum(len(run) for run in runs) == len(want)
    assert_same(fast, golden)
    assert fast.paths.compiled and fast.paths.golden and fast.paths.calls > 24


def test_the_fuzzer_finds_no_difference_from_the_golden_model():
    s = Comparer(InOrder(FastSwitch), GoldenSwitch(), seed=21).run(stream(21, 20_000))
    assert s.differences == 0 and s.wrong_sums == 0, s.text()
    assert s.frames == 20_000 and s.results > 2000 and s.counters > 20_000


@pytest.mark.slow
def test_the_fuzzer_finds_no_difference_on_a_million_frames():
    s = Comparer(InOrder(FastSwitch), GoldenSwitch(), seed=22).run(stream(22, 1_000_000))
    assert s.differences == 0 and s.wrong_sums == 0, s.text()
    assert s.frames == 1_000_000


def test_the_fuzzer_finds_a_wrong_fast_switch():
    """A fast switch whose C++ completes a use one contribution late differs."""
    class Late(FastSwitch):
        def _refresh(self):
            super()._refresh()
            self._table[:, fast_build.JOB_WORDS.index("needed")] += 1

    s = Comparer(InOrder(Late), GoldenSwitch(), seed=3).run(stream(3, 3000))
    assert s.differences > 0


def test_netagg_fuzz_against_fast(capsys):
    import json
    assert main(400, 2, as_json=True, against="fast") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["frames"] == 400 and report["differences"] == 0 and report["counters"] > 0


def test_workers_allreduce_exact_int32_sums_over_udp():
    """Four host.Workers over UDP through `sim serve`'s fast switch: int32 sums exact, the
    C++ took the contributions."""
    rng = np.random.default_rng(7)
    n = 40_000
    xs = [rng.integers(-2**29, 2**29, n, dtype=np.int32) for _ in range(4)]
    session = uuid.uuid4().hex
    with SimServer(make_backend("fast")).start() as server:
        def rank(r):
            with Worker(r, 4, server.url, session=session, timeout=20) as w:
                return w.allreduce(xs[r], timeout=60)
        out = in_threads(rank, 4)
        paths = server.backend.paths
    expected = np.sum(np.array(xs, np.int64), axis=0).astype(np.int32)
    assert all(np.array_equal(o, expected) for o in out)
    assert paths.compiled > 4 * n // 255


def test_without_its_compiled_core_it_says_why(monkeypatch):
    monkeypatch.setenv("NETAGG_COMPILED", "0")
    with pytest.raises(RuntimeError, match="NETAGG_COMPILED=0"):
        FastSwitch()


def test_bench_measures_the_fast_switch():
    r = in_memory(workers=4, uses=2, seconds=0.1)
    assert r["errors"] == 0 and r["results"] == r["contributions"] > 0
    assert r["golden_frames"] and r["compiled_rows"] == r["contributions"]
    u = contributions_per_second("fast", senders=3, seconds=0.5, warmup=0.2)
    assert u["errors"] == 0 and u["contributions"] > 0
