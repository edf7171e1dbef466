"""The host driver in process, against the golden model: exact int32 sums, floats within the
fixed-point bound, hierarchical equal to flat, loss, overflow, dead peers and switches."""

from __future__ import annotations

import collections
import threading
import time
import uuid

import numpy as np
import pytest

from host import NetaggError, NetaggTimeout, SwitchControl, Worker
from host import numerics as N
from sim import wire as W
from sim.golden import GoldenSwitch
from sim.serve import SimServer

LENGTHS = [1, 3, N.LANES - 1, N.LANES, N.LANES + 1, 1000, 3 * N.LANES * N.DEFAULT_BLOCK + 7]


def workers(n, switch=None, **kw):
    switch = switch or GoldenSwitch()
    session = kw.pop("session", uuid.uuid4().hex)
    return [Worker(r, n, switch, session=session, **kw) for r in range(n)]


def allreduce_all(ws, inputs, **kw):
    """Cooperative in-process allreduce: start every worker, then wait."""
    handles = [w.allreduce_async(x, **kw) for w, x in zip(ws, inputs)]
    return [h.wait() for h in handles]


def in_threads(fn, n):
    out, errors = [None] * n, []

    def run(i):
        try:
            out[i] = fn(i)
        except BaseException as e:       # re-raised below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


def assert_within_bound(result, inputs, fmt, mean=False, frac=None):
    exact = np.sum([N.to_float64(x, fmt) for x in inputs], axis=0)
    if mean:
        exact = exact / len(inputs)
    got = N.to_float64(result, fmt)
    bound = N.error_bound(got, N.shared_exponents(inputs, fmt), len(inputs), fmt, frac=frac,
                          mean=mean)
    err = np.abs(got - exact)
    assert np.all(err <= bound), f"error {err.max()} beyond the bound at {np.argmax(err - bound)}"
    return err.max()


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
    with pytest.raises(ValueError, match="NaN"):
        w.allreduce(np.array([1.0, np.nan], np.float32))
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
        sent.append(datagram)
        inner_send(datagram, path, dscp)
    ws[0].transport.send = record
    a = [np.arange(N.LANES, dtype=np.int32) * (r + 1) for r in range(2)]
    allreduce_all(ws, a)                       # use 0 of slot 0 (version 0, msn 0)
    b = [np.full(N.LANES, 7 * (r + 1), np.int32) for r in range(2)]
    allreduce_all(ws, b)                       # use 1 (version 1, msn 1)
    ws[0].transport.send = inner_send
    t = ws[0].transport
    assert [W.parse_transport(d, t.local, t.switch).rkey for d in sent] == [0, 1]
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


# --- credits, message sequence numbers, priority drop, quorum --------------------------------

def switch_counters(switch):
    c = GoldenSwitch.counters(switch)
    return {"drop_priority": sum(p["drop_priority"] for p in c["ports"]), **c["jobs"][0]}


@pytest.mark.parametrize("credits", [1, 3, 0])
def test_credits_bound_the_messages_in_flight_and_nothing_is_dropped(credits):
    """With fewer credits than slots, each worker has at most `credits` messages open beyond
    those the job completed: never more in flight, never one the switch drops for credit,
    and the sums are exact. Messages carry msn = use * slots + slot, each once; results carry
    the credit limit COMPLETED + CREDITS in their PSN."""
    rng = np.random.default_rng(21)
    switch = RecordingSwitch()
    ws = workers(3, switch, slots=8, credits=credits)
    ints = [rng.integers(-2**24, 2**24, 25 * N.LANES + 3, dtype=np.int32) for _ in ws]
    floats = [rng.standard_normal(10 * N.LANES).astype(np.float32) for _ in ws]
    results = allreduce_all(ws, [[a, b] for a, b in zip(ints, floats)])
    assert [w.engine.credits for w in ws] == [credits] * 3      # the joiners read it
    expected = np.sum([x.astype(np.int64) for x in ints], axis=0)
    for r in results:
        assert np.array_equal(r[0], expected) and np.array_equal(r[1], results[0][1])
    assert_within_bound(results[0][1], floats, N.FLOAT32)
    sw = switch_counters(switch)
    assert sw["drop_credit"] == 0 and sw["drop_stale"] == 0
    messages = sw["completed"]
    assert messages == 26 + 1 + 10                 # data chunks and one exponent message
    inflight = [w.counters()["max_inflight"] for w in ws]
    if credits:
        assert max(inflight) <= credits and credits in inflight
        assert all(w.counters().get("credit_waits", 0) > 0 for w in ws)
        limits = sorted({p.psn for p in switch.results})
        assert limits == list(range(1 + credits, messages + credits + 1))
    else:
        assert max(inflight) == 8                  # the slots are the only window
    for w in ws:
        msns = [p.rkey for p in switch.contributions if p.src.ip == w.transport.local.ip]
        assert sorted(msns) == list(range(messages))
        slots = [W.unpack_imm(W.REQUEST_IMM, p.imm)["slot"] for p in switch.contributions
                 if p.src.ip == w.transport.local.ip]
        assert all(m % 8 == s for m, s in zip(msns, slots))


def test_droppable_chunks_are_the_smallest_in_the_lowest_classes():
    from host.engine import plan_droppable
    norms = np.array([5.0, 0.1, 3.0, 0.2, 9.0, 0.3, 0.05, 7.0, 1.0, 2.0])
    assert plan_droppable(norms, 0.0, 4) == {}
    assert plan_droppable(norms, 0.09, 4) == {}               # floor(0.9) = 0
    assert plan_droppable(norms, 0.2, 4) == {6: 0, 1: 2}
    assert plan_droppable(norms, 0.4, 4) == {6: 0, 1: 1, 3: 2, 5: 3}
    assert plan_droppable(norms, 0.4, 0) == {6: 0, 1: 0, 3: 0, 5: 0}
    assert plan_droppable(norms, 0.3, 1) == {6: 0, 1: 0, 3: 0}


def test_loss_budget_and_priority_are_checked():
    (w,) = workers(1)
    with pytest.raises(ValueError, match="int32"):
        w.allreduce(np.arange(4, dtype=np.int32), loss_budget=0.1)
    with pytest.raises(ValueError, match="loss_budget"):
        w.allreduce(np.ones(4, np.float32), loss_budget=1.0)
    with pytest.raises(ValueError, match="priority"):
        w.allreduce(np.ones(4, np.float32), priority=8)
    with pytest.raises(ValueError, match="2 tensors"):
        w.allreduce([np.ones(4, np.float32)] * 2, loss_budget=[0.1])
    assert np.array_equal(w.allreduce(np.ones(4, np.float32), loss_budget=0.5), np.ones(4))


def priority_inputs(rng, n_workers, chunks):
    """Float32 tensors whose smallest chunks are chunk 0 on every worker and chunks
    5 + 2r, 6 + 2r on worker r alone."""
    n = chunks * N.LANES - 7
    out = []
    for r in range(n_workers):
        scale = np.ones(chunks)
        scale[0] = 1e-4
        scale[[5 + 2 * r, 6 + 2 * r]] = 1e-3
        out.append((rng.standard_normal(n) * np.repeat(scale, N.LANES)[:n]).astype(np.float32))
    return out


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_priority_drop_stays_within_the_loss_budget(op):
    """The switch drops every droppable contribution of classes 0..3 (threshold 0): each
    worker's 3 smallest chunks of 40 (loss_budget 0.08) become nulls. A chunk that lost one
    contribution (the allowance, ceil(0.08 * 4)) is the sum of the other three scaled by 4/3;
    chunk 0, which every worker let go, is filled in and exact. Only droppable packets are
    dropped; exponent messages, small tensors and int32 tensors are untouched."""
    rng = np.random.default_rng(22)
    switch = RecordingSwitch()
    ctl = SwitchControl(switch)
    ctl.write([(W.drop_threshold(c), 0) for c in range(4)])
    ws = workers(4, switch)
    for w in ws:        # the packet counts below are exact: no retransmission on a busy machine
        w.engine.rto_min = w.engine.rto = 5.0
    big = priority_inputs(rng, 4, 40)
    small = [rng.standard_normal(3 * N.LANES).astype(np.float32) for _ in ws]
    ints = [rng.integers(-2**20, 2**20, 500, dtype=np.int32) for _ in ws]
    handles = [w.allreduce_async([b, s], op=op, loss_budget=[0.08, 0.08], priority=[4, 6])
               for w, b, s in zip(ws, big, small)]
    int_handles = [w.allreduce_async(x) for w, x in zip(ws, ints)]
    results = [h.wait() for h in handles]
    assert all(np.array_equal(h.wait(), np.sum(ints, axis=0)) for h in int_handles)
    for r in results:
        assert np.array_equal(r[0], results[0][0]) and np.array_equal(r[1], results[0][1])
    assert_within_bound(results[0][1], small, N.FLOAT32, mean=op == "mean")

    dropped = [set(h.works[0].droppable) for h in handles]
    assert dropped == [{0, 5 + 2 * r, 6 + 2 * r} for r in range(4)]
    got = results[0][0].astype(np.float64)
    exps = N.shared_exponents(big, N.FLOAT32)
    lost = filled = rescaled = 0
    for c in range(40):
        lo, hi = c * N.LANES, min((c + 1) * N.LANES, len(got))
        out = [r for r in range(4) if c in dropped[r]]
        if len(out) > 1:            # beyond the allowance: filled in, exact
            scale, keep = 1.0, range(4)
            filled += 1
        else:
            scale, keep = 4 / (4 - len(out)), [r for r in range(4) if r not in out]
            lost += len(out)
            rescaled += bool(out)
        want = scale * np.sum([big[r][lo:hi].astype(np.float64) for r in keep], axis=0)
        if op == "mean":
            want /= 4
        bound = scale * N.error_bound(got[lo:hi], exps[lo:hi], 4, N.FLOAT32,
                                      mean=op == "mean")
        assert np.all(np.abs(got[lo:hi] - want) <= bound), c
    for h in handles:
        assert h.stats()[0]["lost_contributions"] == lost == 8
        assert h.stats()[0]["filled_chunks"] == filled == 1
        assert h.stats()[0]["rescaled_chunks"] == rescaled == 8
        assert h.stats()[1]["droppable"] == 0 and h.stats()[1]["lost_contributions"] == 0

    sw = switch_counters(switch)
    sent = [w.counters() for w in ws]
    assert sw["drop_priority"] == sum(c["droppable_sent"] for c in sent) == 12
    assert all(c["droppable_sent_class0"] == c["droppable_sent_class1"]
               == c["droppable_sent_class2"] == 1 for c in sent)
    classes = collections.Counter()         # droppable below 4, the tensors' 4 and 6, exps 7
    for p in switch.contributions:
        droppable = W.unpack_imm(W.REQUEST_IMM, p.imm)["droppable"]
        classes[(p.dscp >> 3, droppable)] += 1
    assert set(classes) == {(0, 1), (1, 1), (2, 1), (4, 0), (6, 0), (7, 0)}
    assert classes[(7, 0)] == 4 * 2                 # one exponent message per float tensor
    assert sw["drop_credit"] == 0


@pytest.mark.parametrize("quorum", [3, 2])
def test_quorum_with_no_loss_budget_stays_exact(quorum):
    """A quorum closes each use early; with loss_budget 0 every chunk the late workers
    missed is filled in (the check lane says whose data is in), so int32 sums are exact and
    floats within the usual bound, for several steps."""
    rng = np.random.default_rng(23)
    switch = GoldenSwitch()
    ws = workers(4, switch, quorum=quorum, slots=8)
    for _ in range(2):
        ints = [rng.integers(-2**24, 2**24, 6 * N.LANES + 1, dtype=np.int32) for _ in ws]
        floats = [rng.standard_normal(2 * N.LANES * N.DEFAULT_BLOCK + 9).astype(np.float32)
                  for _ in ws]
        results = allreduce_all(ws, [[a, b] for a, b in zip(ints, floats)])
        expected = np.sum([x.astype(np.int64) for x in ints], axis=0)
        for r in results:
            assert np.array_equal(r[0], expected) and np.array_equal(r[1], results[0][1])
        assert_within_bound(results[0][1], floats, N.FLOAT32)
    assert [w.engine.needed for w in ws] == [quorum] * 4
    c = [w.counters() for w in ws]
    assert all(x["fill_rounds"] > 0 and x.get("lost_contributions", 0) == 0 for x in c)
    sw = switch_counters(switch)
    assert sw["replays"] > 0 and sw["drop_credit"] == 0 and sw["drop_stale"] == 0


def test_quorum_within_the_loss_budget_is_scaled():
    """Quorum 3 of 4 with loss_budget 0.25 (allowance 1): each data chunk is the sum of the
    three contributions that closed its use, scaled by 4/3."""
    rng = np.random.default_rng(24)
    ws = workers(4, GoldenSwitch(), quorum=3)
    x = [rng.standard_normal(5 * N.LANES).astype(np.float32) for _ in ws]
    results = allreduce_all(ws, x, loss_budget=0.25)
    assert all(np.array_equal(r, results[0]) for r in results)
    got = results[0].astype(np.float64)
    total = np.sum([v.astype(np.float64) for v in x], axis=0)
    for c in range(5):
        part = slice(c * N.LANES, (c + 1) * N.LANES)
        err = min(np.abs(got[part] - 4 / 3 * (total[part] - x[r][part])).max()
                  for r in range(4))
        assert err < 1e-6
    assert all(w.counters()["lost_contributions"] == 5 for w in ws)


def test_quorum_goes_on_without_a_dead_worker_only_within_the_budget():
    """Rank 3 of 4 never comes. With quorum 3 and loss_budget 0.25 the others' sums are
    theirs scaled by 4/3; with loss_budget 0 its data can never be filled in, which is a
    NetaggTimeout in bounded time, not fill rounds forever."""
    switch, session = GoldenSwitch(), uuid.uuid4().hex
    ws = [Worker(r, 4, switch, session=session, quorum=3, timeout=1.5) for r in range(3)]
    x = [np.full(2 * N.LANES, r + 1.0, np.float32) for r in range(3)]
    results = allreduce_all(ws, x, loss_budget=0.25)
    assert all(np.allclose(r, 4 / 3 * 6.0) for r in results)
    handles = [w.allreduce_async(v) for w, v in zip(ws, x)]
    t0 = time.monotonic()
    with pytest.raises(NetaggTimeout, match="a peer of this job stopped contributing"):
        handles[0].wait()
    assert time.monotonic() - t0 < 8


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
    from host import SwitchControl
    switch = GoldenSwitch()
    ws = workers(2, switch)
    allreduce_all(ws, [np.ones(3 * N.LANES, np.int32)] * 2)
    ctl = SwitchControl(switch)
    assert ctl.params["ports"] == 4 and ctl.params["slots"] == 64
    c = ctl.counters(jobs=[0])
    assert c["jobs"][0]["completed"] == 3 and c["jobs"][0]["results"] == 6
    assert c["jobs"][0]["contributions"] == 6
    assert sum(p["control"] for p in c["ports"].values()) > 0
    assert ctl.read(W.REG_MAGIC) == [W.MAGIC]


def test_rtl_in_process_equals_golden():
    """The switch's RTL (Verilator, cycle loop in C++) as an in-process backend: int32 sums
    exact at every length, floats bit for bit those the golden model gives."""
    from sim.model import make_switch

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


# --- spraying -------------------------------------------------------------------------------

class RecordingSwitch(GoldenSwitch):
    """The golden model, noting the switch port and PSN of every contribution, per sender,
    and every contribution and result packet."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen = {}             # source IP -> [(port, psn)] in arrival order
        self.contributions = []    # packets, in arrival order
        self.results = []

    def send(self, port, frame, *args):
        pkt = W.parse_frame(frame)
        if pkt.opcode == W.OP_CONTRIBUTION:
            self.seen.setdefault(pkt.src.ip, []).append((port, pkt.psn))
            self.contributions.append(pkt)
        super().send(port, frame, *args)

    def run(self):
        out = super().run()
        self.results += [W.parse_frame(f) for _, f in out
                         if W.parse_frame(f).opcode == W.OP_RESULT]
        return out


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
    from host.transport import Sprayer
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
    from sim.model import make_switch

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
