"""Early loss recovery (netagg/host/retransmit.py's `RecentAnswer`): a packet is sent again when a
packet sent after it is answered, or when the tail of those in flight goes unanswered for a
probe timeout, without waiting for its own timeout; every sum stays exact. The rules on
their own; the Python window and the engine's message path under heavy loss (the lossy
transport); the compiled step (netagg/host/cpp/step.cpp) over UDP with a switch that loses
datagrams each way; and `Recovery.TIMERS`, which turns the rules off."""

from __future__ import annotations

import random
import threading
import uuid

import numpy as np
import pytest

from netagg.contract import wire as W
from netagg.host import Worker, compiled_build
from netagg.host.retransmit import (
    LOSS_MEMORY,
    PROBE_MIN,
    RecentAnswer,
    Recovery,
    RetransmitTimer,
    RttEstimator,
)
from netagg.sim.golden import GoldenSwitch
from netagg.sim.serve import SimServer


def _estimator(srtt: float) -> RttEstimator:
    rtt = RttEstimator()
    rtt.sample(srtt)
    return rtt


def test_a_packet_sent_before_a_later_ones_answer_is_lost():
    rtt, recent = _estimator(0.008), RecentAnswer()
    assert recent.horizon(RttEstimator()) == -np.inf      # no round trip yet: nothing
    assert recent.answered(last_sent=10.0, now=10.01)
    assert not recent.answered(last_sent=9.5, now=10.02)  # an older sending: not newer
    # lost: sent more than a quarter of the smoothed round trip before 10.0
    assert recent.horizon(rtt) == pytest.approx(10.0 - 0.002)
    # a retry found so keeps its wait; one after a timeout doubles it
    timer = RetransmitTimer()
    timer.sent(9.0, rtt)
    first = timer.rto
    timer.sent(10.02, rtt, lost=True)
    assert timer.rto == first and timer.deadline == pytest.approx(10.02 + first)
    timer.sent(10.5, rtt)
    assert timer.rto == pytest.approx(min(rtt.rto_max, 2 * first))


def test_the_tail_is_probed_once_until_an_answer():
    rtt, recent = _estimator(0.03), RecentAnswer()
    recent.answered(last_sent=1.0, now=1.01)
    # two smoothed round trips after the later of the last answer and the last sending
    assert recent.probe_at(rtt, last_sent=1.02) == pytest.approx(1.02 + 0.06)
    recent.probed = True
    assert recent.probe_at(rtt, last_sent=1.02) == np.inf
    recent.answered(last_sent=1.02, now=1.05)
    assert recent.probe_at(rtt, last_sent=1.02) == pytest.approx(1.05 + 0.06)
    # at least the shortest timeout while no loss is found: a rank waiting for a slower
    # one is probed no sooner than the timeouts would send
    fast = _estimator(0.001)
    assert recent.probe_at(fast, last_sent=1.0) == pytest.approx(1.05 + fast.rto_min)
    # at least PROBE_MIN for LOSS_MEMORY after the rule found a loss
    recent.found(1.04)
    assert recent.probe_at(fast, last_sent=1.0) == pytest.approx(1.05 + PROBE_MIN)
    assert PROBE_MIN < fast.rto_min
    recent.answered(last_sent=1.03, now=1.04 + LOSS_MEMORY)
    assert recent.probe_at(fast, last_sent=1.0) == pytest.approx(
        1.04 + LOSS_MEMORY + fast.rto_min)


def test_sprayed_packets_are_probed_only_and_timers_only_finds_nothing_early():
    rtt = _estimator(0.008)
    sprayed, off = RecentAnswer(sprayed=True), RecentAnswer(off=True)
    for recent in (sprayed, off):
        recent.answered(last_sent=10.0, now=10.01)
        assert recent.horizon(rtt) == -np.inf
    assert sprayed.probe_at(rtt, 10.0) < np.inf and off.probe_at(rtt, 10.0) == np.inf


def _lossy_run(recovery: Recovery | str, spray_paths: int = 1, seed: int = 5) -> tuple[list, list]:
    """Three in-process workers, each way 20 % of packets lost, 2 % duplicated, 10 % held
    back up to 3 ms: their sums and counters."""
    switch = GoldenSwitch(ports=4, max_workers=4)
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(20_000).astype(np.float32) for _ in range(3)]
    ints = [rng.integers(-2**20, 2**20, 5_000, dtype=np.int32) for _ in range(3)]
    session = uuid.uuid4().hex
    ws = [Worker(r, 3, switch, session=session, timeout=30, paths=spray_paths,
                 recovery=recovery, faults=dict(drop=0.2, duplicate=0.02, reorder=0.1,
                                                max_delay=0.003, seed=seed + r))
          for r in range(3)]
    handles = [w.allreduce_async([x, i]) for w, x, i in zip(ws, xs, ints)]
    out = [h.wait(timeout=60) for h in handles]
    counters = [w.counters() for w in ws]
    for w in ws:
        w.close()
    exact = np.sum([i.astype(np.int64) for i in ints], axis=0)
    for o in out:
        assert np.array_equal(o[1], exact)
        assert np.array_equal(o[0], out[0][0])          # every rank the same bits
    return out, counters


def test_heavy_loss_is_recovered_early_and_exactly():
    """The Python window and the message path: most retransmissions are early, the tails
    are probed, the sums exact and the same bits as with the timeouts alone."""
    early, counters = _lossy_run("early")
    timers, timer_counters = _lossy_run(Recovery.TIMERS)
    total = sum(c["retransmissions"] for c in counters)
    assert sum(c.get("early_retransmissions", 0) for c in counters) > total / 2
    assert sum(c.get("probes", 0) for c in counters) > 0
    assert all(c.get("early_retransmissions", 0) == 0 and c.get("probes", 0) == 0
               for c in timer_counters)
    assert all(c["retransmissions"] > 0 for c in timer_counters)
    for a, b in zip(early, timers):
        assert np.array_equal(a[0], b[0])


def test_sprayed_packets_are_never_taken_as_lost():
    """Over several paths packets arrive out of order by design: no early retransmission
    for a later packet's answer (the tail's probe still goes)."""
    _, counters = _lossy_run("early", spray_paths=3, seed=11)
    assert all(c.get("early_retransmissions", 0) <= c.get("probes", 0) * 64 for c in counters)
    assert all(c["retransmissions"] > 0 for c in counters)


class _LossySwitch(GoldenSwitch):
    """The golden switch behind a link that loses `drop` of the data frames each way
    (seeded); control frames pass."""

    def __init__(self, drop: float, seed: int, **params):
        super().__init__(**params)
        self.drop, self.rng, self.lost = drop, random.Random(seed), 0

    def _data(self, frame: bytes) -> bool:
        try:
            return W.parse_frame(frame).dqpn != W.CONTROL_QPN
        except W.WireError:
            return False

    def send(self, port: int, frame: bytes, *args, **kw):
        if self._data(frame) and self.rng.random() < self.drop:
            self.lost += 1
            return None
        return super().send(port, frame, *args, **kw)

    def run(self) -> list:
        out = []
        for item in super().run():
            if self._data(item[1]) and self.rng.random() < self.drop:
                self.lost += 1
                continue
            out.append(item)
        return out


@pytest.mark.skipif(compiled_build.library() is None,
                    reason=f"{compiled_build.unavailable()}")
def test_the_compiled_step_recovers_early_over_udp(monkeypatch):
    """Workers over UDP run the compiled step; the switch loses 10 % of the data frames
    each way: the step hands the losses it finds to Python, which sends them early; every
    sum exact."""
    monkeypatch.setenv("NETAGG_COMPILED", "1")
    switch = _LossySwitch(0.1, seed=3, ports=4, max_workers=4)
    rng = np.random.default_rng(2)
    ints = [rng.integers(-2**20, 2**20, 60_000, dtype=np.int32) for _ in range(2)]
    with SimServer(switch).start() as server:
        session, out, counters = uuid.uuid4().hex, [None, None], [None, None]

        def one(r):
            with Worker(r, 2, server.url, session=session, timeout=30) as w:
                out[r] = w.allreduce(ints[r], timeout=60)
                counters[r] = w.counters()
        threads = [threading.Thread(target=one, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    assert switch.lost > 0
    exact = ints[0].astype(np.int64) + ints[1]
    for o, c in zip(out, counters):
        assert o is not None and np.array_equal(o, exact)
        assert c["compiled_packets"] > 0
        # most losses are found by a later result the C++ took (without its rule they wait
        # for a probe, which sends every message in flight: 12 to 17 probes a rank, tried)
        assert c.get("early_retransmissions", 0) > 10 * c.get("probes", 0), c
