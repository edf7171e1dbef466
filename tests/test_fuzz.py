"""The differences the differential fuzzing of the switch found between its RTL and its golden
model, minimised, as scapy-built regressions on both switches."""

import random

import numpy as np
import pytest
from scapy.contrib.roce import BTH

from sim import wire as W
from sim.golden import GoldenSwitch
from tests.switch_traffic import (
    control_frame,
    dissect,
    job_config_records,
    make_workers,
    switch_records,
)


@pytest.fixture(scope="module")
def rtl_model():
    from sim.model import make_switch

    with make_switch() as rtl:
        yield rtl


@pytest.fixture(params=["golden", "rtl"])
def switch(request):
    if request.param == "golden":
        return GoldenSwitch()
    rtl = request.getfixturevalue("rtl_model")
    rtl.reset()
    return rtl


def exchange(switch, sends) -> list:
    """Frames in ((port, frame) pairs, sent together), the frames out."""
    for port, frame in sends:
        switch.send(port, frame)
    if isinstance(switch, GoldenSwitch):
        return switch.run()
    out = switch.run(idle_cycles=600)
    while switch.busy:
        out += switch.run(idle_cycles=600)
    return out


def job_counters(switch, job: int) -> dict:
    [(_, reply)] = exchange(switch, [(0, control_frame(
        [(W.job_counter(job, n), 0) for n in W.JOB_COUNTERS]
        + [(W.job_reg(job, W.JOB_COMPLETED), 0)]))])
    values = [v for _, v in W.unpack_records(bytes(dissect(reply)[BTH].payload))]
    return dict(zip([*W.JOB_COUNTERS, "COMPLETED"], values))


def configure(switch, jobs) -> dict:
    """Jobs of (job, workers, slot base, slot count, credits), configured as the tests of
    the golden model do; their workers."""
    rng = random.Random(0)
    exchange(switch, [(0, control_frame(switch_records()))])
    workers = {}
    for job, n, base, count, credits in jobs:
        workers[job] = make_workers(job, n, 4, rng, slot_count=count)
        exchange(switch, [(0, control_frame(job_config_records(job, workers[job], base, count,
                                                                credits)))])
    return workers


def lanes_of(frame: bytes) -> np.ndarray:
    return np.frombuffer(bytes(dissect(frame)[BTH].payload)[20:], "<i4")


def test_a_replay_of_another_length_is_dropped(switch):
    """A contribution to a completed use whose length is not the use's: the RTL sent the
    sums' rows its own payload's beats covered (a part of the sums, or rows beyond them)
    under its own length; now both switches drop it as `drop_bad_length`."""
    [w] = configure(switch, [(0, 1, 0, 1, 0)])[0]
    values = np.arange(1, 9, dtype=np.int32)
    [(_, result)] = exchange(switch, [(1, w.contribution(0, 0, 0, values, 1, msn=0))])
    for other in (values[:2], np.arange(12, dtype=np.int32)):
        assert exchange(switch, [(1, w.contribution(0, 0, 0, other, 2, msn=0))]) == []
    [(_, again)] = exchange(switch, [(1, w.contribution(0, 0, 0, values, 3, msn=0))])
    assert lanes_of(again).tolist() == lanes_of(result).tolist() == values.tolist()
    c = job_counters(switch, 0)
    assert (c["drop_bad_length"], c["replays"], c["results"]) == (2, 1, 2)


def test_back_to_back_completions_move_the_credit_limit(switch):
    """Two uses of a job with one credit, committed in consecutive cycles (the same length
    on ports 0 and 1): the second is within the limit the first's completion moves. The
    RTL's lookup read COMPLETED before the completion ahead of it counted, and dropped the
    second as beyond the credit."""
    [w] = configure(switch, [(2, 1, 0, 1, 1)])[2]
    lanes = np.arange(16, dtype=np.int32)
    assert len(exchange(switch, [(0, w.contribution(0, 0, 0, lanes, 1, msn=0))])) == 1
    out = exchange(switch, [(0, w.contribution(0, 1, 0, lanes, 2, msn=1)),
                            (1, w.contribution(0, 0, 0, lanes + 1, 3, msn=2))])
    assert [dissect(f)[BTH].psn for _, f in out] == [3, 4]      # COMPLETED + CREDITS
    c = job_counters(switch, 2)
    assert (c["completed"], c["drop_credit"], c["COMPLETED"]) == (3, 0, 3)


def test_a_config_write_clears_the_slot_range_the_request_leaves(switch):
    """A request that writes job 1's CONFIG and then moves its slot range clears the slots
    of the range it leaves (1..4), as the gateware clears them after the request: the use
    job 0 had begun in slot 4 is gone, and its first worker's contribution begins it again
    instead of being a duplicate."""
    workers = configure(switch, [(0, 2, 4, 1, 0), (1, 1, 0, 4, 0)])
    a, b = workers[0]
    exchange(switch, [(0, a.contribution(0, 0, 0, np.full(4, 5, np.int32), 1, msn=0))])
    exchange(switch, [(0, control_frame([
        (W.WRITE | W.job_reg(1, W.JOB_CONFIG), W.CONFIG.pack(enable=1, workers=1)),
        (W.WRITE | W.job_reg(1, W.JOB_SLOT_BASE), 1)]))])
    assert exchange(switch, [(0, a.contribution(0, 0, 0, np.full(4, 7, np.int32), 2,
                                                msn=0))]) == []
    out = exchange(switch, [(0, b.contribution(0, 0, 0, np.full(4, 1, np.int32), 1, msn=0))])
    assert [lanes_of(f).tolist() for _, f in out] == [[8] * 4] * 2
    c = job_counters(switch, 0)
    assert (c["contributions"], c["duplicates"], c["completed"]) == (3, 0, 1)
