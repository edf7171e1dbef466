"""In-place allreduce (`Worker.allreduce(x, out=x)`, netagg.host.outputs): the result written into
the input itself is numpy's exact sum (values chosen so that fixed point is exact: multiples
of 1/8 well inside float32's precision) or bit for bit the allreduce into new arrays, on every
path that reads a tensor's values after some of its chunks may be complete: loss,
duplication and reordering (retransmissions), a chunk redone after an overflow, quorum
fill-in rounds, a loss budget's scaled chunks, non-finite blocks, the hierarchical path, and
over UDP the compiled step and the Python window (NETAGG_COMPILED=0). A wrong `out` is a
ValueError that names what is wrong."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from netagg.host import Worker, compiled_build
from netagg.host import numerics as N
from netagg.sim.golden import GoldenSwitch
from netagg.sim.serve import SimServer, make_backend
from tests.host_workers import in_threads, workers
from tests.test_host_nonfinite import scenario


def exact_floats(rng, n: int, world: int) -> list[np.ndarray]:
    """float32 multiples of 1/8 below 2**12: their fixed-point sums are exact."""
    return [(rng.integers(-2**15, 2**15, n) / 8).astype(np.float32) for _ in range(world)]


def ints(rng, n: int, world: int) -> list[np.ndarray]:
    return [rng.integers(-2**24, 2**24, n, dtype=np.int32) for _ in range(world)]


def numpy_sum(inputs: list[np.ndarray]) -> np.ndarray:
    return np.sum([x.astype(np.float64) for x in inputs], axis=0).astype(inputs[0].dtype)


def in_place(ws, inputs, **kw) -> list:
    """Every worker's allreduce into its own inputs (an array or a list per rank); the
    results each `wait` returns."""
    handles = [w.allreduce_async(x, out=x, **kw) for w, x in zip(ws, inputs)]
    return [h.wait() for h in handles]


def close(ws):
    for w in ws:
        w.close()


@pytest.mark.parametrize("rate", [0.0, 0.05])
def test_in_place_is_numpys_sum_under_loss_duplication_and_reordering(rate):
    rng = np.random.default_rng(31)
    world = 3
    a, b = ints(rng, 20 * N.LANES + 3, world), exact_floats(rng, 2 * N.LANES * 256 + 9, world)
    expected = [numpy_sum(a), numpy_sum(b)]
    faults = dict(drop=rate, duplicate=rate, reorder=rate, max_delay=0.02) if rate else None
    switch, session = GoldenSwitch(), uuid.uuid4().hex
    ws = [Worker(r, world, switch, session=session, timeout=20,
                 faults=faults and dict(faults, seed=r + 7)) for r in range(world)]
    for w in ws:
        w.engine.rto_min = w.engine.rto = 0.005
    inputs = [[x, y] for x, y in zip(a, b)]
    results = in_place(ws, inputs)
    for got, mine in zip(results, inputs):
        assert got[0] is mine[0] and got[1] is mine[1]
        assert np.array_equal(mine[0], expected[0]) and np.array_equal(mine[1], expected[1])
    if rate:
        c = [w.counters() for w in ws]
        assert sum(x["injected_dropped"] for x in c) > 0
        assert sum(x["injected_duplicated"] for x in c) > 0
        assert sum(x.get("retransmissions", 0) for x in c) > 0
    close(ws)


def test_in_place_with_an_overflow_redo_is_the_new_arrays_result():
    """fraction_bits 30 makes sums saturate: chunks are redone, quantised again from the
    inputs, which in place still hold the values (their chunks are not complete)."""
    rng = np.random.default_rng(3)
    inputs = [(2 + 1.9 * rng.random(600 * 255)).astype(np.float32) for _ in range(4)]
    ws = workers(4, fraction_bits=30)
    fresh = [h.wait() for h in [w.allreduce_async(x) for w, x in zip(ws, inputs)]]
    overflows = ws[0].counters()["overflows"]
    mine = [x.copy() for x in inputs]
    in_place(ws, mine)
    assert overflows > 0 and ws[0].counters()["overflows"] > overflows
    assert all(m.tobytes() == fresh[0].tobytes() for m in mine)
    close(ws)


@pytest.mark.parametrize("quorum", [3, 2])
def test_in_place_with_quorum_fill_in_is_numpys_sum(quorum):
    rng = np.random.default_rng(23)
    ws = workers(4, GoldenSwitch(), quorum=quorum, slots=8)
    a, b = ints(rng, 6 * N.LANES + 1, 4), exact_floats(rng, 2 * N.LANES * 256 + 9, 4)
    expected = [numpy_sum(a), numpy_sum(b)]
    inputs = [[x, y] for x, y in zip(a, b)]
    in_place(ws, inputs)
    for x, y in inputs:
        assert np.array_equal(x, expected[0]) and np.array_equal(y, expected[1])
    assert all(w.counters()["fill_rounds"] > 0 for w in ws)
    close(ws)


def test_in_place_with_a_loss_budget_scales_the_three_that_closed():
    """Quorum 3 of 4, loss_budget 0.25: each chunk is the sum of three ranks' values scaled
    by 4/3, computed from values read before the chunk's result overwrote them."""
    rng = np.random.default_rng(24)
    ws = workers(4, GoldenSwitch(), quorum=3)
    x = [rng.standard_normal(5 * N.LANES).astype(np.float32) for _ in ws]
    original = [v.copy() for v in x]
    in_place(ws, x, loss_budget=0.25)
    assert all(np.array_equal(v, x[0]) for v in x)
    total = np.sum([v.astype(np.float64) for v in original], axis=0)
    for c in range(5):
        part = slice(c * N.LANES, (c + 1) * N.LANES)
        err = min(np.abs(x[0][part] - 4 / 3 * (total[part] - original[r][part])).max()
                  for r in range(4))
        assert err < 1e-6
    assert all(w.counters()["lost_contributions"] == 5 for w in ws)
    close(ws)


@pytest.mark.parametrize("quorum", [0, 2])
def test_in_place_non_finite_blocks_are_the_new_arrays_result(quorum):
    """Blocks with NaN and infinities go in two rounds (kinds, then finite values), both
    read from the inputs; in place the result has the same bits."""
    inputs = scenario("float32")
    ws = workers(3, GoldenSwitch(), quorum=quorum, slots=8)
    fresh = [h.wait() for h in [w.allreduce_async(x) for w, x in zip(ws, inputs)]]
    mine = [x.copy() for x in inputs]
    in_place(ws, mine)
    assert all(m.tobytes() == fresh[0].tobytes() for m in mine)
    assert np.isnan(mine[0]).any() and np.isinf(mine[0]).any()
    close(ws)


@pytest.mark.parametrize("jobs", [4, 1])
def test_in_place_hierarchical_is_numpys_sum(jobs):
    rng = np.random.default_rng(4)
    sizes = [5, 3 * N.LANES * N.DEFAULT_BLOCK + 11]
    inputs = [[*ints(rng, sizes[0], 1), *exact_floats(rng, sizes[1], 1)] for _ in range(4)]
    expected = [numpy_sum([x[i] for x in inputs]) for i in range(2)]
    switch, session = GoldenSwitch(jobs=jobs), uuid.uuid4().hex

    def hier(rank):
        with Worker(rank, 4, switch, local_size=2, session=session, timeout=30) as w:
            got = w.allreduce(inputs[rank], out=inputs[rank])
            return all(g is x for g, x in zip(got, inputs[rank]))
    assert all(in_threads(hier, 4))
    for x in inputs:
        assert all(np.array_equal(v, e) for v, e in zip(x, expected))


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("dtype", ["int32", "float32"])
def test_in_place_over_udp_is_numpys_sum(compiled, dtype, monkeypatch):
    if compiled and compiled_build.library() is None:
        pytest.skip(compiled_build.unavailable())
    monkeypatch.setenv("NETAGG_COMPILED", "1" if compiled else "0")
    rng = np.random.default_rng(5)
    n = 255 * 600 + 17
    arrays = ints(rng, n, 2) if dtype == "int32" else exact_floats(rng, n, 2)
    expected = numpy_sum(arrays)
    session = uuid.uuid4().hex
    with SimServer(make_backend("golden")).start() as server:
        def rank(r):
            with Worker(r, 2, server.url, session=session, timeout=20) as w:
                got = w.allreduce(arrays[r], timeout=30, out=arrays[r])
                return got is arrays[r], w.counters()
        out = in_threads(rank, 2)
    assert all(same for same, _ in out)
    assert all(np.array_equal(x, expected) for x in arrays)
    sent = sum(c.get("compiled_packets", 0) for _, c in out)
    assert (sent > 0) == compiled


@pytest.mark.parametrize("second", ["reads", "writes"])
@pytest.mark.parametrize("udp", [False, True], ids=["in-process", "udp"])
def test_an_allreduce_of_memory_one_in_flight_writes_waits_for_it(second, udp):
    """allreduce_async(x, out=x) then, before its wait, an allreduce that reads x (or one
    of y written into x): the second runs after the first, so it sees the first's sums,
    over lossy, reordering links (results arrive chunk by chunk)."""
    rng = np.random.default_rng(12)
    n = 255 * 6 + 5         # fewer chunks than slots: the second starts beside the first
    xs, ys = ints(rng, n, 2), ints(rng, n, 2)
    first = numpy_sum(xs)
    faults = dict(drop=0.05, reorder=0.2, max_delay=0.01)

    def start(w, r):
        h1 = w.allreduce_async(xs[r], out=xs[r])
        return h1, lambda: w.allreduce_async(xs[r]) if second == "reads" else \
            w.allreduce_async(ys[r], out=xs[r])
    if udp:
        session = uuid.uuid4().hex
        with SimServer(make_backend("golden")).start() as server:
            done = threading.Barrier(2)

            def rank(r):        # (open until both are done: a closed rank's beat stops)
                with Worker(r, 2, server.url, session=session, timeout=20,
                            faults=dict(faults, seed=r)) as w:
                    h1, then = start(w, r)
                    h2 = then()
                    got = h1.wait(30), h2.wait(30)
                    done.wait(30)
                    return got
            out = in_threads(rank, 2)
    else:       # every rank's first allreduce, then every rank's second
        ws = workers(2, timeout=20, faults=dict(faults, seed=3))
        firsts = [start(w, r) for r, w in enumerate(ws)]
        seconds = [then() for _, then in firsts]
        out = [(h1.wait(30), h2.wait(30)) for (h1, _), h2 in zip(firsts, seconds)]
        close(ws)
    expected = 2 * first if second == "reads" else numpy_sum(ys)
    assert all(np.array_equal(got, expected) for _, got in out)
    assert all(np.array_equal(x, first if second == "reads" else expected) for x in xs)


def test_out_into_other_arrays_leaves_the_inputs():
    ws = workers(2)
    rng = np.random.default_rng(8)
    a = ints(rng, 700, 2)
    keep = [x.copy() for x in a]
    outs = [np.full(700, 7, np.int32) for _ in ws]
    got = [h.wait() for h in [w.allreduce_async(x, out=o) for w, x, o in zip(ws, a, outs)]]
    assert all(g is o for g, o in zip(got, outs))
    assert all(np.array_equal(o, keep[0] + keep[1]) for o in outs)
    assert all(np.array_equal(x, k) for x, k in zip(a, keep))
    # a list with None: that tensor's result is a new array
    pair = [[x, x[:5].copy()] for x in a]
    got = [h.wait() for h in [w.allreduce_async(p, out=[p[0], None]) for w, p in zip(ws, pair)]]
    assert got[0][0] is pair[0][0] and got[0][1] is not pair[0][1]
    assert np.array_equal(got[1][1], keep[0][:5] + keep[1][:5])
    close(ws)


def test_a_wrong_out_is_a_value_error_naming_what_is_wrong():
    (w,) = workers(1)
    x = np.arange(600, dtype=np.float32)
    m = np.zeros((20, 30), np.float32)
    y = np.arange(600, dtype=np.float32)
    frozen = np.zeros(600, np.float32)
    frozen.flags.writeable = False
    for out, arrays, match in [
            (np.zeros(599, np.float32), x, r"out for tensor 0 has shape \(599,\)"),
            (np.zeros(600, np.float64), x, "out for tensor 0 has dtype float64"),
            (np.zeros((30, 20), np.float32).T, m, "out for tensor 0 is not C-contiguous"),
            (frozen, x, "out for tensor 0 is read-only"),
            ([x], x, "out must be one array for one tensor"),
            ([x], [x, y], "out must be a list of 2 arrays"),
            ([x.tolist(), y], [x, y], "out for tensor 0 must be a numpy array"),
            ([y, None], [x, y], "out for tensor 0 shares memory with tensor 1's input"),
            ([x, x], [x, y], "out for tensor 1 shares memory with tensor 0's input"),
    ]:
        with pytest.raises(ValueError, match=match):
            w.allreduce(arrays, out=out)
    big = np.arange(1200, dtype=np.float32)
    with pytest.raises(ValueError, match="part of its own input"):
        w.allreduce(big[:600], out=big[100:700])
    o = np.zeros(1200, np.float32)
    with pytest.raises(ValueError, match="shares memory with the out for tensor 0"):
        w.allreduce([x, y], out=[o[:600], o[300:900]])
    assert np.array_equal(x, np.arange(600, dtype=np.float32))     # nothing was sent
    assert w.counters().get("packets_sent", 0) == 0
    w.close()
