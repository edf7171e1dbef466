"""The plain window (`host.window`): the engine's common case as arrays gives the same
packets and the same sums as the engine message by message, over several tensors in flight
at once, and hands its state over to it, mid-tensor, when loss, duplication and reordering
leave the common case."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import numpy as np
import pytest

from netagg.host import Worker
from netagg.host import numerics as N
from netagg.host.window import PlainWindow
from netagg.sim.golden import GoldenSwitch

SIZES = [5, N.LANES * N.DEFAULT_BLOCK * 3 + 11, 1000]


def _run(inputs, steps: int = 2, **kw):
    """Each of len(inputs) in-process workers allreduces its arrays `steps` times (several
    tensors in flight at once); the results of each step and each worker's counters."""
    switch, session = GoldenSwitch(), uuid.uuid4().hex
    ws = [Worker(r, len(inputs), switch, session=session, timeout=20, **kw)
          for r in range(len(inputs))]
    try:
        results = []
        for _ in range(steps):
            handles = [w.allreduce_async(x) for w, x in zip(ws, inputs)]
            results.append([h.wait() for h in handles])
        return results, [w.counters() for w in ws]
    finally:
        for w in ws:
            w.close()


def _inputs(dtype, workers=3, seed=1):
    rng = np.random.default_rng(seed)
    if dtype == "int32":
        return [[rng.integers(-2**20, 2**20, n, dtype=np.int32) for n in SIZES]
                for _ in range(workers)]
    return [[(rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3)).astype(dtype)
             for n in SIZES] for _ in range(workers)]


@pytest.mark.parametrize("dtype", ["int32", "float32", "float16"])
def test_the_window_sends_and_sums_as_the_engine_does_message_by_message(dtype, monkeypatch):
    inputs = _inputs(dtype)
    windowed, counters = _run(inputs)
    monkeypatch.setattr(PlainWindow, "takes", staticmethod(lambda engine, work: False))
    reference, reference_counters = _run(inputs)
    for step, ref in zip(windowed, reference):
        for got, want in zip(step, ref):
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and np.array_equal(a, b)
    if dtype == "int32":
        exact = np.sum([x[1].astype(np.int64) for x in inputs], axis=0)
        assert np.array_equal(windowed[0][0][1], exact)
    for c, r in zip(counters, reference_counters):
        assert c["packets_sent"] == r["packets_sent"] and c["bytes_sent"] == r["bytes_sent"]
        assert c.get("window_fallbacks", 0) == 0 and c.get("retransmissions", 0) == 0


def test_the_window_carries_loss_copies_and_reordering_and_the_sums_stay_exact():
    """Lost packets are sent again and late copies of results dropped by the window itself:
    it never hands its slots to the engine's message path for them."""
    inputs = _inputs("int32", seed=2)
    results, counters = _run(inputs, faults=dict(drop=0.02, duplicate=0.02, reorder=0.05,
                                                 max_delay=0.01, seed=3))
    for step in results:
        for got in step:
            for x, want in zip(got, [np.sum([w[i].astype(np.int64) for w in inputs], axis=0)
                                     for i in range(len(SIZES))]):
                assert np.array_equal(x, want)
    assert sum(c.get("window_fallbacks", 0) for c in counters) == 0
    assert sum(c.get("retransmissions", 0) for c in counters) > 0
    assert sum(c.get("stale_results", 0) for c in counters) > 0


def test_a_span_in_a_gap_between_the_messages_started_is_not_one_of_theirs():
    """Messages 0 and 10 start while the span of messages 4..7 lies between them (slots free
    up in any order under DDP's buckets): it is not one of their spans, whose payloads would
    be made for no message (a ValueError on an empty array, the rank's allreduce failed)."""
    spans = [SimpleNamespace(first=f, count=4) for f in (0, 4, 8)]
    window = SimpleNamespace(spans=spans)
    assert PlainWindow._spans_of(window, np.array([0, 10])) == [spans[0], spans[2]]
    assert PlainWindow._spans_of(window, np.array([5])) == [spans[1]]
