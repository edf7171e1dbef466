"""A use's deadline, on the golden model and the RTL alike: a retransmission (a contribution
of a rank already in the use) that finds the use at least its job's DEADLINE ticks old closes
it with the contributions it has, as a quorum would, and its result, of those contributions,
goes to every worker; before the deadline, with no deadline, or with another length, it is a
duplicate. Ages are counted modulo the tick count's range. The golden model and the RTL give
the same frames, byte for byte, on the same frames and ticks."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from scapy.contrib.roce import BTH

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import numerics as N
from netagg.host.errors import NetaggRankGone
from netagg.sim.golden import GoldenSwitch
from netagg.sim.scapy_frames import ImmDt
from tests.switch_traffic import control_frame, dissect
from tests.test_fuzz import configure, exchange, job_counters, lanes_of

TICKS = 1 << R.DEADLINE_BITS


def set_deadline(switch, job: int, ticks: int):
    exchange(switch, [(0, control_frame([(R.WRITE | R.job_reg(job, R.JOB_DEADLINE), ticks)]))])


def tick(switch, n: int = 1):
    for _ in range(n):
        assert not switch.tick()       # a tick sends nothing


def count_of(frame: bytes) -> int:
    """A result's count of contributions with data (its ImmDt, after the RETH)."""
    imm = ImmDt(bytes(dissect(frame)[BTH].payload)[W.RETH_LEN:]).data
    return W.unpack_imm(W.RESULT_IMM, imm)["count"]


def a_stalled_use(switch, deadline: int, credits: int = 0):
    """Job 0 of three workers, two of which contribute to slot 0's first use: the third
    never comes. The workers and the two contributions' lanes."""
    ws = configure(switch, [(0, 3, 0, 2, credits)])[0]
    set_deadline(switch, 0, deadline)
    x, y = np.arange(1, 17, dtype=np.int32), np.full(16, -5, np.int32)
    assert exchange(switch, [(ws[0].port, ws[0].contribution(0, 0, 0, x, 1)),
                             (ws[1].port, ws[1].contribution(0, 0, 0, y, 1))]) == []
    return ws, x, y


def test_a_retransmission_past_the_deadline_closes_the_use_short(switch):
    """Deadline 4: a retransmission 3 ticks in is a duplicate; one 4 ticks in closes the use:
    every worker (the silent one too) gets the sums of the two, count 2, with the credit
    limit the completion moved; the silent rank's late contribution then gets that result
    again, alone, and the slot's next use begins afresh."""
    ws, x, y = a_stalled_use(switch, deadline=4, credits=2)
    tick(switch, 3)
    assert exchange(switch, [(ws[0].port, ws[0].contribution(0, 0, 0, x, 2))]) == []
    tick(switch)
    out = exchange(switch, [(ws[1].port, ws[1].contribution(0, 0, 0, y, 2))])
    assert sorted(p for p, _ in out) == sorted(w.port for w in ws)
    for _, frame in out:
        assert lanes_of(frame).tolist() == (x + y).tolist()
        assert count_of(frame) == 2
        assert dissect(frame)[BTH].psn == 1 + 2          # COMPLETED + CREDITS
    c = job_counters(switch, 0)
    assert (c["closed_late"], c["completed"], c["duplicates"], c["contributions"],
            c["COMPLETED"]) == (1, 1, 1, 2, 1)
    [(port, again)] = exchange(switch, [(ws[2].port, ws[2].contribution(0, 0, 0, x * 0 + 9, 3))])
    assert port == ws[2].port and lanes_of(again).tolist() == (x + y).tolist()
    z = np.full(16, 2, np.int32)
    sends = [(w.port, w.contribution(0, 1, 0, z, 4)) for w in ws]
    assert [lanes_of(f).tolist() for _, f in exchange(switch, sends)] == [(3 * z).tolist()] * 3
    assert job_counters(switch, 0)["replays"] == 1


@pytest.mark.parametrize("deadline", [0, 5])
def test_no_deadline_or_another_length_waits(switch, deadline):
    """With no deadline, a retransmission long after is a duplicate; past a deadline, one of
    another length than the use's is too (a close would send rows it does not cover)."""
    ws, x, _ = a_stalled_use(switch, deadline)
    tick(switch, 200)
    retransmission = ws[0].contribution(0, 0, 0, x if deadline == 0 else x[:4], 2)
    assert exchange(switch, [(ws[0].port, retransmission)]) == []
    c = job_counters(switch, 0)
    assert (c["closed_late"], c["duplicates"], c["completed"]) == (0, 1, 0)


def test_the_age_wraps(switch):
    """Ages count modulo the tick count's range: a use TICKS + 1 ticks old looks 1 tick old,
    and closes at the next retransmission past the deadline."""
    ws, x, _ = a_stalled_use(switch, deadline=3)
    tick(switch, TICKS + 1)
    assert exchange(switch, [(ws[0].port, ws[0].contribution(0, 0, 0, x, 2))]) == []
    tick(switch, 2)
    assert len(exchange(switch, [(ws[0].port, ws[0].contribution(0, 0, 0, x, 3))])) == 3


def test_the_deadline_reads_back_in_its_bits(switch):
    ws = configure(switch, [(1, 1, 0, 1, 0)])
    assert ws
    [(_, reply)] = exchange(switch, [(0, control_frame([
        (R.WRITE | R.job_reg(1, R.JOB_DEADLINE), 0x1234), (R.job_reg(1, R.JOB_DEADLINE), 0)]))])
    assert [v for _, v in W.unpack_records(W.parse_frame(reply).payload)] == [0x34, 0x34]


def test_golden_and_rtl_agree_frame_for_frame_with_ticks(rtl_model):
    """Three jobs' stalled and completing uses, retransmissions and ticks at random: the
    golden model and the RTL send the same frames, byte for byte, and count alike."""
    rng = random.Random(5)
    rtl_model.reset()
    switches = (GoldenSwitch(), rtl_model)
    workers = [configure(s, [(0, 3, 0, 4, 0), (1, 2, 4, 4, 0)]) for s in switches][0]
    for s in switches:
        set_deadline(s, 0, 3)
        set_deadline(s, 1, 6)
    for _ in range(120):
        if rng.random() < 0.3:
            n = rng.randrange(1, 4)
            for s in switches:
                tick(s, n)
            continue
        job = rng.randrange(2)
        w = rng.choice(workers[job])
        slot, version = rng.randrange(4), rng.randrange(2)
        lanes = np.array([rng.randrange(-99, 99) for _ in range(8)], np.int32)
        frame = w.contribution(slot, version, 0, lanes, 1, msn=rng.randrange(3) * 4 + slot)
        outs = [exchange(s, [(w.port, frame)]) for s in switches]
        assert outs[0] == outs[1]
    for job in (0, 1):
        assert job_counters(switches[0], job) == job_counters(switches[1], job)
    assert job_counters(switches[0], 0)["closed_late"] > 0


# --- the host's workers ----------------------------------------------------------------------

def three_without_rank_2(backend, rtl_model):
    """Three in-process workers of job 0 with a deadline of 0.1 s on `backend`, which
    allreduce once together; then rank 2's engine is no longer driven (it is gone)."""
    from tests.host_workers import allreduce_all, workers

    if backend == "rtl":
        rtl_model.reset()
    ws = workers(3, GoldenSwitch() if backend == "golden" else rtl_model, deadline=0.1,
                 timeout=20)
    first = allreduce_all(ws, [np.full(N.LANES, r, np.int32) for r in range(3)])
    assert all((x == 3).all() for x in first)
    ws[0].transport.driver.engines.remove(ws[2].engine)
    return ws


@pytest.mark.parametrize("backend", ["golden", "rtl"])
def test_a_job_with_a_loss_budget_goes_on_without_a_stopped_rank(backend, rtl_model):
    """Rank 2 of three is gone: the two others' allreduce with a loss budget of one rank in
    three completes, every chunk closed short at its deadline and scaled to the world's
    (the mean of the two present stands for the third), instead of waiting for ever."""
    ws = three_without_rank_2(backend, rtl_model)
    try:
        size = 8 * N.LANES
        handles = [w.allreduce_async(np.full(size, r + 1, np.float32), loss_budget=0.34)
                   for r, w in enumerate(ws[:2])]
        out = [h.wait() for h in handles]
        for x in out:
            np.testing.assert_allclose(x, np.full(size, 4.5), rtol=1e-3)
        stats = handles[0].stats()[0]
        assert stats["rescaled_chunks"] > 0 and stats["lost_contributions"] > 0
        [closed] = ws[0].engine.control.request([(R.job_counter(0, "closed_late"), 0)])
        assert closed[1] > 0
    finally:
        for w in ws:
            w.close()


def test_with_no_loss_budget_a_stopped_rank_is_still_named(rtl_model):
    """Rank 2 of three is gone and the sums must be exact: the uses its data is missing from
    close at the deadline and are filled in, which cannot complete either; the two others
    fail within seconds naming rank 2 (the heartbeats), never with a wrong sum."""
    ws = three_without_rank_2("golden", rtl_model)
    try:
        handles = [w.allreduce_async(np.full(8 * N.LANES, r + 1, np.int32))
                   for r, w in enumerate(ws[:2])]
        started = time.monotonic()
        for h in handles:
            with pytest.raises(NetaggRankGone, match="rank 2 of job 0 is gone"):
                h.wait()
        assert time.monotonic() - started < 10
    finally:
        for w in ws:
            w.close()


def test_the_deadline_is_checked():
    from tests.host_workers import workers

    for seconds in (1.01, 2.5, -0.1):
        with pytest.raises(ValueError, match="deadline must be 0..1 s"):
            workers(1, deadline=seconds)


def test_a_rank_that_asks_another_deadline_than_rank_0s_is_refused():
    """Rank 1 asks for a deadline rank 0 did not configure: its join fails naming both."""
    from netagg.host import Worker
    from netagg.host.errors import NetaggError

    switch = GoldenSwitch()
    ws = [Worker(r, 2, switch, session="deadline-check", deadline=d, timeout=5)
          for r, d in ((0, 0.1), (1, 0.25))]
    try:
        handles = [w.allreduce_async(np.ones(8, np.int32)) for w in ws]
        with pytest.raises(NetaggError, match=r"deadline=13 ticks .* rank 1 expects .*"
                                              r"deadline=32"):
            handles[1].wait()
    finally:
        for w in ws:
            w.close()
