"""A use's deadline, on the golden model and the RTL alike: a retransmission (a contribution
of a rank already in the use) that finds the use at least its job's DEADLINE ticks old closes
it with the contributions it has, as a quorum would, and its result, of those contributions,
goes to every worker; before the deadline, with no deadline, or with another length, it is a
duplicate. Ages are counted modulo the tick count's range. The golden model and the RTL give
the same frames, byte for byte, on the same frames and ticks."""

from __future__ import annotations

import random

import numpy as np
import pytest
from netagg.sim import wire as W
from netagg.sim.golden import GoldenSwitch
from netagg.sim.scapy_frames import ImmDt
from scapy.contrib.roce import BTH

from tests.switch_traffic import control_frame, dissect
from tests.test_fuzz import configure, exchange, job_counters, lanes_of

TICKS = 1 << W.DEADLINE_BITS


def set_deadline(switch, job: int, ticks: int):
    exchange(switch, [(0, control_frame([(W.WRITE | W.job_reg(job, W.JOB_DEADLINE), ticks)]))])


def tick(switch, n: int = 1):
    for _ in range(n):
        assert not switch.tick()       # a tick sends nothing


def count_of(frame: bytes) -> int:
    """A result's count of contributions with data (its ImmDt, after the RETH)."""
    imm = ImmDt(bytes(dissect(frame)[BTH].payload)[16:20]).data
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
        (W.WRITE | W.job_reg(1, W.JOB_DEADLINE), 0x1234), (W.job_reg(1, W.JOB_DEADLINE), 0)]))])
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
