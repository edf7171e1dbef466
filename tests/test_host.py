"""The host driver in process, against the golden model: exact int32 sums, floats within the
fixed-point bound, hierarchical equal to flat, loss, overflow, dead peers and switches."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import NetaggError, NetaggTimeout, SwitchControl, Worker
from netagg.host import numerics as N
from netagg.sim.golden import GoldenSwitch
from netagg.sim.serve import SimServer
from tests.host_workers import (
    allreduce_all,
    assert_within_bound,
    in_threads,
    workers,
)

LENGTHS = [1, 3, N.LANES - 1, N.LANES, N.LANES + 1, 1000, 3 * N.LANES * N.DEFAULT_BLOCK + 7]


# --- number formats -----------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 31, 32])
def test_fraction_bits_cannot_overflow(world):
    f = N.fraction_bits(world)
    assert world * 2 ** f <= 2 ** 31 - 1 < world * 2 ** (f + 1)


def test_bfloat16_bits_round_trip():
    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    values = N.to_float64(bits, N.BFLOAT16)
    finite = np.isfinite(values)
    back = N.from_float64(values, N.BFLOAT16, bits)
    assert np.array_equal(back[finite], bits[finite])


def test_bad_input_is_a_clear_error():
    (w,) = workers(1)
    with pytest.raises(TypeError, match="int32"):
        w.allreduce(np.arange(4, dtype=np.int32), op="mean")
    with pytest.raises(TypeError, match="float64"):
        w.allreduce(np.arange(4, dtype=np.float64))
    with pytest.raises(ValueError, match="op"):
        w.allreduce(np.arange(4, dtype=np.int32), op="max")
    # the worker still works after refusing them
    assert np.array_equal(w.allreduce(np.arange(4, dtype=np.int32)), np.arange(4))


# --- exact and bounded sums -----------------------------------------------------------------

def test_int32_exact_any_length_several_tensors_per_step():
    rng = np.random.default_rng(1)
    ws = workers(4)
    inputs = [[rng.integers(-2**28, 2**28, n, dtype=np.int32) for n in LENGTHS]
              for _ in ws]
    results = allreduce_all(ws, inputs)
    for i, n in enumerate(LENGTHS):
        expected = np.sum([x[i].astype(np.int64) for x in inputs], axis=0)
        for r in results:
            assert r[i].dtype == np.int32 and r[i].shape == (n,)
            assert np.array_equal(r[i], expected)
    c = ws[0].counters()
    assert c["packets_sent"] == sum(-(-n // N.LANES) for n in LENGTHS)
    assert c.get("retransmissions", 0) == 0


@pytest.mark.parametrize("local_size", [1, 2])
def test_arrays_in_any_memory_order(local_size):
    """A transposed (Fortran-order) or strided array is summed as its values, and the result
    has its shape, flat or hierarchical."""
    rng = np.random.default_rng(2)
    ws = workers(2, local_size=local_size)
    inputs = [[rng.integers(-1000, 1000, (300, 7), dtype=np.int32).T,
               rng.integers(-1000, 1000, 2 * N.LANES, dtype=np.int32)[::2]] for _ in ws]
    if local_size == 1:
        results = allreduce_all(ws, inputs)
    else:
        results = in_threads(lambda r: ws[r].allreduce(inputs[r]), 2)
    for i in range(2):
        expected = inputs[0][i].astype(np.int64) + inputs[1][i]
        for r in results:
            assert r[i].shape == expected.shape and np.array_equal(r[i], expected)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_floats_within_the_bound(dtype, op):
    rng = np.random.default_rng(2)
    n = 2 * N.LANES * N.DEFAULT_BLOCK + 100
    fmt = {"float32": N.FLOAT32, "float16": N.FLOAT16, "bfloat16": N.BFLOAT16}[dtype]
    scale = np.repeat(10.0 ** rng.uniform(-3, 2, 3), N.LANES * N.DEFAULT_BLOCK)[:n]
    values = [rng.standard_normal(n) * scale for _ in range(3)]
    if dtype == "bfloat16":
        inputs = [N.from_float64(v, fmt, np.zeros(1, np.uint16)) for v in values]
    else:
        inputs = [v.astype(dtype) for v in values]
    ws = workers(3)
    results = allreduce_all(ws, inputs, op=op, dtype=dtype)
    for r in results:
        assert r.dtype == inputs[0].dtype and np.array_equal(r, results[0])
    assert_within_bound(results[0], inputs, fmt, mean=op == "mean")


def test_float32_zeros_tiny_and_huge():
    inputs = [np.array([0.0, 1e-40, 1.5e38, -1.5e38, 1.0, 0.0], np.float32) for _ in range(2)]
    inputs[1][2] = 1e38
    ws = workers(2)
    results = allreduce_all(ws, inputs)
    assert results[0][0] == 0 and np.isfinite(results[0]).all()
    assert_within_bound(results[0], inputs, N.FLOAT32)


def test_overflow_is_redone_not_returned():
    """With more fraction bits than safe, sums saturate: the engine redoes the chunks with a
    larger exponent until they fit, and the answer is still right."""
    rng = np.random.default_rng(3)
    inputs = [(2 + 1.9 * rng.random(600)).astype(np.float32) for _ in range(4)]   # E = 2
    ws = workers(4, fraction_bits=30)
    results = allreduce_all(ws, inputs)
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    assert ws[0].counters()["overflows"] > 0
    assert np.allclose(results[0], exact, rtol=1e-6)


def test_int32_saturation_raises():
    ws = workers(2)
    inputs = [np.array([2**30, 2**31 - 1, 5], np.int32), np.array([2**30, 1, 5], np.int32)]
    for h in [w.allreduce_async(x) for w, x in zip(ws, inputs)]:
        with pytest.raises(OverflowError, match="saturated"):
            h.wait()


# --- hierarchical -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,jobs", [("int32", 4), ("float32", 4), ("float32", 1)])
def test_hierarchical_equals_flat(dtype, jobs):
    """With a job per local worker every local worker carries a shard; with one job (a
    board's), local worker 0 of each node alone carries the node's sums."""
    rng = np.random.default_rng(4)
    sizes = [5, 3 * N.LANES * N.DEFAULT_BLOCK + 11]
    if dtype == "int32":
        inputs = [[rng.integers(-2**20, 2**20, n, dtype=np.int32) for n in sizes]
                  for _ in range(4)]
    else:
        inputs = [[(rng.standard_normal(n) * 10.0 ** rng.uniform(-2, 2)).astype(np.float32)
                   for n in sizes] for _ in range(4)]
    flat = allreduce_all(workers(4), inputs)
    switch, session = GoldenSwitch(jobs=jobs), uuid.uuid4().hex

    def hier(rank):
        with Worker(rank, 4, switch, local_size=2, session=session, timeout=30) as w:
            first = w.allreduce(inputs[rank])
            again = w.allreduce(inputs[rank])      # a second step reuses the shared memory
            return first, again, w.counters()
    out = in_threads(hier, 4)
    for rank in range(4):
        for i in range(len(sizes)):
            assert np.array_equal(out[rank][0][i], flat[0][i])
            assert np.array_equal(out[rank][1][i], flat[0][i])
    # every local worker used the network (its shard), or the leaders alone
    leaders = [rank % 2 < jobs for rank in range(4)]
    assert [o[2].get("packets_sent", 0) > 0 for o in out] == leaders
    if dtype == "int32":
        expected = np.sum([x[1].astype(np.int64) for x in inputs], axis=0)
        assert np.array_equal(flat[0][1], expected)


def test_hierarchical_slot_base_gives_each_local_worker_the_range_after_the_ones_before():
    switch, session = GoldenSwitch(jobs=4), uuid.uuid4().hex
    xs = [np.full(2 * N.LANES * N.DEFAULT_BLOCK, r + 1, np.int32) for r in range(4)]

    def hier(rank):
        with Worker(rank, 4, switch, local_size=2, session=session, timeout=30, slots=8,
                    slot_base=32) as w:
            return w.allreduce(xs[rank])
    for out in in_threads(hier, 4):
        assert np.array_equal(out, np.full(len(xs[0]), 10))
    regs = [R.job_reg(j, f) for j in (0, 1) for f in (R.JOB_SLOT_BASE, R.JOB_SLOT_COUNT)]
    assert SwitchControl(switch).read(*regs) == [32, 8, 40, 8]


# --- loss ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rate", [0.01, 0.05])
def test_lossy_path_still_exact(rate):
    """Drop, duplicate and delay (reorder) `rate` of the packets in each direction."""
    rng = np.random.default_rng(5)
    ints = [rng.integers(-2**24, 2**24, 20 * N.LANES + 3, dtype=np.int32) for _ in range(3)]
    floats = [rng.standard_normal(10 * N.LANES).astype(np.float32) for _ in range(3)]
    switch, session = GoldenSwitch(), uuid.uuid4().hex
    ws = [Worker(r, 3, switch, session=session, timeout=20,
                 faults=dict(drop=rate, duplicate=rate, reorder=rate, max_delay=0.02,
                             seed=r + int(rate * 1000)))
          for r in range(3)]
    for w in ws:            # the in-process round trip is short: retransmit quickly
        w.engine.rto_min = w.engine.rto = 0.005
    t0 = time.monotonic()
    for _ in range(2):
        results = allreduce_all(ws, [[a, b] for a, b in zip(ints, floats)])
        expected = np.sum([x.astype(np.int64) for x in ints], axis=0)
        for r in results:
            assert np.array_equal(r[0], expected)
            assert np.array_equal(r[1], results[0][1])
        assert_within_bound(results[0][1], floats, N.FLOAT32)
    assert time.monotonic() - t0 < 60
    c = [w.counters() for w in ws]
    assert sum(x["injected_dropped"] for x in c) > 0
    assert sum(x.get("retransmissions", 0) for x in c) > 0


def test_stray_contribution_from_an_earlier_use_is_refused_by_its_msn():
    """A contribution the network delivers late carries its message sequence number: while
    its slot copy still holds its use, the switch replays that use's result (the worker
    ignores it: it has moved on); once the copy holds a later use, it is `drop_stale`. It is
    never added to another use, so the sums stay exact and nothing is redone."""
    switch = GoldenSwitch()
    ws = workers(2, switch, slots=1)
    sent = []
    inner_send = ws[0].transport.send

    def record(datagram, path=0, dscp=0):
        if datagram[0] == W.OP_CONTRIBUTION:      # (not the heartbeats' control requests)
            sent.append(datagram)
        inner_send(datagram, path, dscp)
    ws[0].transport.send = record
    a = [np.arange(N.LANES, dtype=np.int32) * (r + 1) for r in range(2)]
    allreduce_all(ws, a)                       # use 0 of slot 0 (version 0, msn 0)
    b = [np.full(N.LANES, 7 * (r + 1), np.int32) for r in range(2)]
    allreduce_all(ws, b)                       # use 1 (version 1, msn 1)
    ws[0].transport.send = inner_send
    t = ws[0].transport
    assert [W.split_va(W.parse_transport(d, t.local, t.switch).va)[0] for d in sent] == [0, 1]
    inner_send(sent[0])                        # use 0 again, late: its result again
    c = [np.full(N.LANES, 100 * (r + 1), np.int32) for r in range(2)]
    results = allreduce_all(ws, c)             # use 2 (version 0, msn 2)
    inner_send(sent[0])                        # use 0, later still: older than use 2
    d = [np.full(N.LANES, 1000 * (r + 1), np.int32) for r in range(2)]
    later = allreduce_all(ws, d)
    assert all(np.array_equal(r, np.full(N.LANES, 300)) for r in results)
    assert all(np.array_equal(r, np.full(N.LANES, 3000)) for r in later)
    job = GoldenSwitch.counters(switch)["jobs"][0]
    assert job["replays"] == 1 and job["drop_stale"] == 1
    assert ws[0].counters()["stale_results"] == 1
    assert all("mixed_results" not in w.counters() and "redone" not in w.counters()
               for w in ws)


# --- bounded waiting ------------------------------------------------------------------------

def test_dead_peer_is_a_clear_error_in_bounded_time():
    switch, session = GoldenSwitch(), uuid.uuid4().hex
    ws = [Worker(r, 3, switch, session=session, timeout=1.0) for r in range(2)]   # rank 2 never
    handles = [w.allreduce_async(np.ones(10, np.int32)) for w in ws]
    t0 = time.monotonic()
    with pytest.raises(NetaggTimeout, match="a peer of this job stopped contributing"):
        handles[0].wait()
    assert time.monotonic() - t0 < 5


def test_rank_that_never_gets_configured_times_out():
    switch = GoldenSwitch()
    w = Worker(1, 2, switch, session="nobody-else", timeout=0.5)     # rank 0 never comes
    t0 = time.monotonic()
    with pytest.raises(NetaggTimeout, match="not configured for this run by its rank 0"):
        w.allreduce(np.ones(3, np.int32))
    assert time.monotonic() - t0 < 5


def test_no_switch_is_a_clear_error_in_bounded_time():
    with SimServer(GoldenSwitch()) as server:
        url = server.url
    t0 = time.monotonic()
    with pytest.raises(NetaggTimeout, match="did not answer a control request"):
        Worker(0, 1, url, timeout=1.0)
    assert time.monotonic() - t0 < 5


def test_switch_dying_mid_run_is_a_clear_error():
    server = SimServer(GoldenSwitch()).start()
    w = Worker(0, 2, server.url, session=uuid.uuid4().hex, timeout=1.0)
    server.stop()
    t0 = time.monotonic()
    with pytest.raises(NetaggTimeout, match="does not answer control requests either"):
        w.allreduce(np.ones(10, np.int32))
    assert time.monotonic() - t0 < 5
    w.close()


def test_earlier_run_left_in_the_switch_does_not_mix():
    """A run that died half-way leaves contributions in the slots; the next session's rank 0
    resets the job and the others wait for it, so the sums are exact."""
    switch = GoldenSwitch()
    old = [Worker(r, 3, switch, session="old", timeout=0.5) for r in range(2)]
    handles = [w.allreduce_async(np.full(50, 1000, np.int32)) for w in old]
    with pytest.raises(NetaggTimeout):
        handles[0].wait()
    assert GoldenSwitch.counters(switch)["jobs"][0]["contributions"] > 0   # left behind
    for w in old:
        w.close()
    new = [Worker(r, 3, switch, session="new", timeout=5) for r in (1, 2, 0)]   # 0 comes last
    new.sort(key=lambda w: w.rank)
    results = allreduce_all(new, [np.full(50, r + 1, np.int32) for r in range(3)])
    for r in results:
        assert np.array_equal(r, np.full(50, 6))


def test_misconfiguration_is_refused():
    switch = GoldenSwitch(jobs=2, max_workers=4)
    with pytest.raises(NetaggError, match="at most 4 workers"):
        Worker(0, 5, switch)
    with pytest.raises(NetaggError, match="jobs 0..1"):
        Worker(0, 4, switch, job=2)


def test_switch_counters_through_control():
    switch = GoldenSwitch()
    ws = workers(2, switch)
    allreduce_all(ws, [np.ones(3 * N.LANES, np.int32)] * 2)
    ctl = SwitchControl(switch)
    assert ctl.params["ports"] == 4 and ctl.params["slots"] == 64
    c = ctl.counters(jobs=[0])
    assert c["jobs"][0]["completed"] == 3 and c["jobs"][0]["results"] == 6
    assert c["jobs"][0]["contributions"] == 6
    assert sum(p["control"] for p in c["ports"].values()) > 0
    assert ctl.read(R.REG_MAGIC) == [R.MAGIC]


def test_rtl_in_process_equals_golden():
    """The switch's RTL (Verilator, cycle loop in C++) as an in-process backend: int32 sums
    exact at every length, floats bit for bit those the golden model gives."""
    from netagg.sim.model import make_switch

    rng = np.random.default_rng(7)
    ints = [[rng.integers(-2**28, 2**28, n, dtype=np.int32) for n in LENGTHS[:5]]
            for _ in range(3)]
    floats = [rng.standard_normal(3000).astype(np.float32) for _ in range(3)]
    def run(switch, inputs):
        ws = workers(3, switch)
        try:
            return allreduce_all(ws, inputs)
        finally:
            for w in ws:
                w.close()

    with make_switch() as rtl:
        got, got_floats = run(rtl, ints), run(rtl, floats)
    want_floats = run(GoldenSwitch(), floats)
    for i in range(5):
        expected = np.sum([x[i].astype(np.int64) for x in ints], axis=0)
        for r in got:
            assert np.array_equal(r[i], expected)
    for r, w in zip(got_floats, want_floats):
        assert np.array_equal(r, w)
