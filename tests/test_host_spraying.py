"""The host driver in process, against the golden model and the RTL: packets sprayed over
several paths, reordered, give exact sums without retransmissions; the path options."""

from __future__ import annotations

import numpy as np
import pytest

from netagg.host import SwitchControl, Worker
from netagg.host import numerics as N
from netagg.sim.golden import GoldenSwitch
from tests.host_workers import (
    RecordingSwitch,
    allreduce_all,
    workers,
)


def sprayed_run(paths, spray="round_robin", faults=None):
    rng = np.random.default_rng(11)
    ints = [rng.integers(-2**24, 2**24, 24 * N.LANES + 5, dtype=np.int32) for _ in range(3)]
    floats = [rng.standard_normal(20 * N.LANES).astype(np.float32) for _ in range(3)]
    switch = RecordingSwitch()
    ws = workers(3, switch, paths=paths, spray=spray, faults=faults)
    for w in ws:        # a loaded machine may pause the cooperative loop; reordering is ~10 ms
        w.engine.rto_min = 0.25
        w.engine.rto = 1.0
    results = allreduce_all(ws, [[a, b] for a, b in zip(ints, floats)])
    expected = np.sum([x.astype(np.int64) for x in ints], axis=0)
    for r in results:
        assert np.array_equal(r[0], expected)            # int32: exact
    counters = [w.counters() for w in ws]
    ctl = SwitchControl(switch).counters(jobs=[0])
    for w in ws:
        w.close()
    return results, counters, ctl, switch


@pytest.mark.parametrize("spray", ["round_robin", "least_loaded"])
def test_spraying_reordered_is_exact_and_never_retransmits(spray):
    """Each worker sprays over 4 source ports, which enter 4 switch ports, over paths of
    different delays: the switch sees every worker's packets out of order, on every port;
    the sums are those of one path, bit for bit, without one retransmission."""
    one, one_counters, one_ctl, one_switch = sprayed_run(1)
    for seen in one_switch.seen.values():
        assert len({port for port, _ in seen}) == 1
    got, counters, ctl, switch = sprayed_run(4, spray, faults=dict(path_delay=0.003))
    for r, ref in zip(got, one):
        assert np.array_equal(r[0], ref[0]) and np.array_equal(r[1], ref[1])
    assert all(c.get("retransmissions", 0) == 0 for c in counters + one_counters)
    assert all(c.get("redone", 0) == 0 for c in counters)
    for c in counters:
        assert all(c[f"packets_sent_path{i}"] > 0 for i in range(4))
    for seen in switch.seen.values():                      # per worker: 4 ports, reordered
        assert {port for port, _ in seen} == {0, 1, 2, 3}
        psns = [psn for _, psn in seen]
        assert psns != sorted(psns)
    rx = {p: v["rx"] - v["control"] for p, v in ctl["ports"].items()}
    assert all(n > 0 for n in rx.values())                 # the switch's own counters agree
    assert ctl["jobs"][0]["duplicates"] == 0


def test_spray_options_are_checked():
    with pytest.raises(ValueError, match="spray must be"):
        Worker(0, 1, GoldenSwitch(), spray="random")
    with pytest.raises(ValueError, match="paths must be"):
        Worker(0, 1, GoldenSwitch(), paths=0)


def test_least_loaded_picks_the_emptiest_path():
    from netagg.host.transport import Sprayer
    s = Sprayer(3, "least_loaded")
    for _ in range(3):
        s.sent(s.pick())
    assert s.outstanding == [1, 1, 1]
    s.answered(1)
    assert s.pick() == 1
    s.sent(1)
    s.sent(0)
    assert s.pick() == 2
    rr = Sprayer(3)
    assert [rr.pick() for _ in range(4)] == [0, 1, 2, 0]


def test_rtl_sprayed_over_all_ports_equals_golden():
    """The switch's RTL takes each worker's packets on all 4 ports (its arbiter interleaves
    them): int32 sums exact, floats bit for bit the golden model's single path, no
    retransmission, no duplicate."""
    from netagg.sim.model import make_switch

    rng = np.random.default_rng(3)
    ints = [rng.integers(-2**24, 2**24, 16 * N.LANES + 3, dtype=np.int32) for _ in range(3)]
    floats = [rng.standard_normal(12 * N.LANES).astype(np.float32) for _ in range(3)]

    def run(switch, **kw):
        ws = workers(3, switch, **kw)
        for w in ws:        # only a pause of the loaded machine could time a packet out
            w.engine.rto_min, w.engine.rto = 0.25, 1.0
        try:
            return allreduce_all(ws, [[a, b] for a, b in zip(ints, floats)]), \
                [w.counters() for w in ws]
        finally:
            for w in ws:
                w.close()

    with make_switch() as rtl:
        ctl = SwitchControl(rtl)
        before = ctl.counters(jobs=[0])
        got, counters = run(rtl, paths=4, spray="least_loaded")
        after = ctl.counters(jobs=[0])
        ctl.close()
    want, _ = run(GoldenSwitch())
    expected = np.sum([x.astype(np.int64) for x in ints], axis=0)
    for r, ref in zip(got, want):
        assert np.array_equal(r[0], expected) and np.array_equal(r[1], ref[1])
    assert all(c.get("retransmissions", 0) == 0 for c in counters)
    rx = [after["ports"][p]["rx"] - before["ports"][p]["rx"] for p in range(4)]
    assert all(n > 3 for n in rx), rx
    assert after["jobs"][0]["duplicates"] == before["jobs"][0]["duplicates"]


def test_switch_with_smaller_payloads_gets_smaller_packets():
    """A switch that takes 512-byte payloads (the Colorlight's) gets 127 data lanes and the
    check lane per packet, and exact sums."""
    switch = GoldenSwitch(jobs=1, max_workers=2, slots=8, max_payload=512)
    rng = np.random.default_rng(9)
    inputs = [[rng.integers(-2**20, 2**20, 1000, dtype=np.int32)] for _ in range(2)]
    ws = workers(2, switch)
    results = allreduce_all(ws, inputs)
    assert np.array_equal(results[0][0], inputs[0][0] + inputs[1][0])
    c = ws[0].counters()
    assert c["packets_sent"] == -(-1000 // 127)
    assert c["bytes_sent"] == c["packets_sent"] * (512 + 36)
