"""NaN and infinities (`host.nonfinite`): a non-finite value on any worker reaches every
worker as the IEEE sum per element (NaN, +inf or -inf; finite elements within the bound),
bit for bit the same on every rank, through the golden model, the RTL and the echo switch,
in process and over UDP, flat and hierarchical, under loss, with a quorum and priority
drop; int32 tensors beside them are exact."""

from __future__ import annotations

import itertools
import uuid

import numpy as np
import pytest

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import SwitchControl, Worker
from netagg.host import nonfinite as NF
from netagg.host import numerics as N
from netagg.host.window import PlainWindow
from netagg.sim.echo import EchoSwitch
from netagg.sim.golden import GoldenSwitch
from netagg.sim.serve import SimServer, make_backend
from tests.host_workers import RecordingSwitch, allreduce_all, in_threads, switch_counters

PER = N.LANES * N.DEFAULT_BLOCK         # values per exponent block
FORMATS = {"float32": N.FLOAT32, "float16": N.FLOAT16, "bfloat16": N.BFLOAT16}
SLOTS = 16          # one block of lookahead: a block's first chunk carries the next's proposal


def as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return N.from_float64(values, N.BFLOAT16, np.zeros(1, np.uint16))
    return values.astype(dtype)


def scenario(dtype: str, world: int = 3, seed: int = 0, n: int = 3 * PER + 7):
    """Each rank's values: in block 0, NaN on rank 0 alone (element 5), +inf on rank 1 alone
    (300), +inf on rank 1 and -inf on rank 2 (301: NaN), +inf on ranks 0 and 2 (400), -inf
    on rank 0 alone (the block's last element); rank 2's whole block 1 +inf, and -inf on rank
    0 inside it (NaN there); the rest finite."""
    rng = np.random.default_rng(seed)
    v = [rng.standard_normal(n) * 4 for _ in range(world)]
    v[0][5] = np.nan
    v[1][300] = np.inf
    v[1][301], v[2 % world][301] = np.inf, -np.inf
    v[0][400] = v[2 % world][400] = np.inf
    v[0][PER - 1] = -np.inf
    v[2 % world][PER:2 * PER] = np.inf
    v[0][PER + 10] = -np.inf
    return [as_dtype(x, dtype) for x in v]


def check_ieee(results, inputs, fmt, mean: bool = False):
    """Every rank's result the same bits; per element NaN, +inf and -inf where numpy's
    float64 sum of the inputs has them, finite elements within the bound."""
    for r in results:
        assert r.dtype == inputs[0].dtype and r.tobytes() == results[0].tobytes()
    with np.errstate(invalid="ignore"):
        exact = np.sum([N.to_float64(x, fmt) for x in inputs], axis=0)
    if mean:
        exact = exact / len(inputs)
    got = N.to_float64(results[0], fmt)
    assert np.array_equal(np.isnan(got), np.isnan(exact))
    inf = np.isinf(exact)
    assert np.array_equal(np.isinf(got), inf)
    assert np.array_equal(np.sign(got[inf]), np.sign(exact[inf]))
    finite = np.isfinite(exact)
    bound = N.error_bound(got, N.shared_exponents(inputs, fmt), len(inputs), fmt, mean=mean)
    err = np.abs(got[finite] - exact[finite])
    assert np.all(err <= bound[finite]), f"error {err.max()} beyond the bound"
    return exact


def run(switch, inputs, call: dict | None = None, **kw):
    """In-process workers of `switch` (`kw`: the Worker's options) allreduce `inputs` (per
    rank, an array or a list of them; `call`: the allreduce's options; uint16 arrays are
    bfloat16's bits)."""
    first = inputs[0] if isinstance(inputs[0], np.ndarray) else inputs[0][0]
    call = {"dtype": "bfloat16" if first.dtype == np.uint16 else None, **(call or {})}
    session = uuid.uuid4().hex
    ws = [Worker(r, len(inputs), switch, session=session, timeout=20, slots=SLOTS, **kw)
          for r in range(len(inputs))]
    try:
        return allreduce_all(ws, inputs, **call), [w.counters() for w in ws]
    finally:
        for w in ws:
            w.close()


# --- the rule ---------------------------------------------------------------------------

def test_a_block_that_holds_nan_or_inf_proposes_the_flag():
    x = np.zeros(3 * 8, np.float32)
    x[1], x[9], x[17] = np.nan, -np.inf, 3e38
    assert N.block_proposals(x, N.FLOAT32, 8).tolist() == [N.EXP_NONFINITE] * 2 + [N.EXP_MAX]
    assert N.EXP_NONFINITE == 127 == N.EXP_MAX + 1
    bits = np.array([0x7F80, 0xFF80, 0x7FC0, 0x3F80], np.uint16)    # +inf, -inf, NaN, 1.0
    assert NF.finite_mask(bits, N.BFLOAT16).tolist() == [False, False, False, True]
    assert N.block_proposals(bits[3:], N.BFLOAT16, 8).tolist() == [1]
    assert N.block_proposals(bits[:1], N.BFLOAT16, 8).tolist() == [N.EXP_NONFINITE]


def test_summed_kind_bits_give_the_ieee_sum_of_every_combination():
    """For every combination of finite, +inf, -inf and NaN over 3 workers, the kinds the
    switch's sum counts give numpy's float64 sum's kind."""
    kinds = [1.0, np.inf, -np.inf, np.nan]
    combos = np.array(list(itertools.product(kinds, repeat=3)))
    counts = sum(NF.kind_bits(combos[:, r]) for r in range(3))
    got = NF.overlay(np.full(len(combos), 3.0), counts)
    with np.errstate(invalid="ignore"):
        want = combos.sum(axis=1)
    assert np.array_equal(got, want, equal_nan=True)


# --- through the switch -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_every_rank_gets_the_ieee_sum(dtype, op):
    """Golden model, 3 workers: every rank the same bits, the IEEE kind per element, finite
    elements within the bound (at their chunk's finite exponent); an int32 tensor in the
    same step exact; a block's chunks two rounds each, through the message path."""
    rng = np.random.default_rng(1)
    floats = scenario(dtype)
    ints = [rng.integers(-2**20, 2**20, 700, dtype=np.int32) for _ in floats]
    switch, session = GoldenSwitch(), uuid.uuid4().hex
    ws = [Worker(r, 3, switch, session=session, timeout=20, slots=SLOTS) for r in range(3)]
    handles = [(w.allreduce_async(f, op=op, dtype=dtype), w.allreduce_async(i))
               for w, f, i in zip(ws, floats, ints)]
    results = [h.wait() for h, _ in handles]
    assert all(np.array_equal(h.wait(), np.sum(ints, axis=0)) for _, h in handles)
    check_ieee(results, floats, FORMATS[dtype], mean=op == "mean")
    for c in [w.counters() for w in ws]:
        assert c["nonfinite_chunks"] == 2 * N.DEFAULT_BLOCK     # blocks 0 and 1
        assert c["window_fallbacks"] >= 1 and c.get("retransmissions", 0) == 0


def test_a_tensor_wholly_nonfinite_and_a_worker_alone():
    """Every element NaN or inf on one rank of 2; and one worker alone gets its own kinds
    and values back."""
    a = np.full(2 * PER, np.inf, np.float32)
    a[::3] = np.nan
    b = np.arange(2 * PER, dtype=np.float32)
    results, _ = run(GoldenSwitch(), [a, b])
    check_ieee(results, [a, b], N.FLOAT32)
    (alone,), _ = run(GoldenSwitch(), [scenario("float32")[0]])
    check_ieee([alone], [scenario("float32")[0]], N.FLOAT32)


def test_hierarchical_equals_flat():
    inputs = scenario("float32", world=4)
    flat, _ = run(GoldenSwitch(), inputs)
    check_ieee(flat, inputs, N.FLOAT32)
    switch, session = GoldenSwitch(), uuid.uuid4().hex

    def hier(rank):
        with Worker(rank, 4, switch, local_size=2, session=session, timeout=30) as w:
            return w.allreduce(inputs[rank])
    for got in in_threads(hier, 4):
        assert got.tobytes() == flat[0].tobytes()


def test_the_window_hands_over_and_sends_what_the_message_path_sends(monkeypatch):
    inputs = scenario("float16")
    windowed, counters = run(GoldenSwitch(), inputs)
    monkeypatch.setattr(PlainWindow, "takes", staticmethod(lambda engine, work: False))
    reference, reference_counters = run(GoldenSwitch(), inputs)
    assert windowed[0].tobytes() == reference[0].tobytes()
    for c, r in zip(counters, reference_counters):
        assert c["packets_sent"] == r["packets_sent"] and c["window_fallbacks"] == 1
        assert r.get("window_fallbacks", 0) == 0


def test_loss_duplication_and_reordering_give_the_same_result():
    inputs = scenario("bfloat16")
    clean, _ = run(GoldenSwitch(), inputs)
    switch, session = GoldenSwitch(), uuid.uuid4().hex
    ws = [Worker(r, 3, switch, session=session, timeout=20, slots=SLOTS,
                 faults=dict(drop=0.05, duplicate=0.05, reorder=0.05, max_delay=0.02,
                             seed=r + 40)) for r in range(3)]
    for w in ws:            # the in-process round trip is short: retransmit quickly
        w.engine.rto_min = w.engine.rto = 0.005
    lossy = allreduce_all(ws, inputs, dtype="bfloat16")
    for got in lossy:
        assert got.tobytes() == clean[0].tobytes()
    c = [w.counters() for w in ws]
    assert sum(x["injected_dropped"] for x in c) > 0
    assert sum(x.get("retransmissions", 0) for x in c) > 0


def test_a_quorum_fills_the_kinds_in_and_the_result_is_the_same():
    """Quorum 2 of 3, no loss budget: uses close early, the late rank's kinds and values are
    filled in, and the result is bit for bit that without a quorum."""
    inputs = scenario("float32")
    whole, _ = run(GoldenSwitch(), inputs)
    quorum, counters = run(GoldenSwitch(), inputs, quorum=2)
    for got in quorum:
        assert got.tobytes() == whole[0].tobytes()
    assert all(c["fill_rounds"] > 0 for c in counters)


def test_with_a_quorum_and_a_loss_budget_the_kinds_are_still_every_workers():
    """Quorum 2 of 3 with loss_budget 0.3 (a chunk may miss one contribution): the finite
    values of every chunk are two workers' scaled by 3/2, but the kinds round of a
    non-finite block is filled in to every worker's, so each NaN and inf is there (every
    block that holds one holds it on 2 ranks or more of 3, so its flag is among any 2
    proposals)."""
    inputs = scenario("float32")
    results, counters = run(GoldenSwitch(), inputs, quorum=2, call=dict(loss_budget=0.3))
    for r in results:
        assert r.tobytes() == results[0].tobytes()
    with np.errstate(invalid="ignore"):
        exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    assert np.array_equal(np.isnan(results[0]), np.isnan(exact))
    assert np.array_equal(np.where(np.isinf(results[0]), np.sign(results[0]), 0),
                          np.where(np.isinf(exact), np.sign(exact), 0))
    assert all(c["lost_contributions"] > 0 and c["fill_rounds"] >= 2 * N.DEFAULT_BLOCK
               for c in counters)


def test_chunks_of_a_nonfinite_block_are_never_droppable():
    """Every droppable contribution is dropped (thresholds 0). With a loss budget of 0.1,
    each worker marks droppable its 4 smallest chunks: one of block 2 (finite), a different
    one on each rank, and 3 of block 0, which holds NaN and inf: none of block 0's
    contributions leaves droppable, so its kinds and its finite values are every worker's
    (not rescaled), while block 2's chunks lose one contribution each."""
    switch = RecordingSwitch()
    SwitchControl(switch).write([(R.drop_threshold(c), 0) for c in range(4)])
    inputs = [np.asarray(x, np.float64) for x in scenario("float32", n=3 * PER)]
    for r, x in enumerate(inputs):
        x[:PER] *= 1e-3                     # block 0's chunks are small
        x[PER:2 * PER] = np.linspace(1, 2, PER)     # block 1 finite
        x[2 * PER + r * N.LANES:2 * PER + (r + 1) * N.LANES] *= 1e-6    # the smallest
    inputs[1][7] = np.nan
    inputs = [x.astype(np.float32) for x in inputs]
    results, counters = run(switch, inputs, call=dict(loss_budget=0.1))
    for r in results:
        assert r.tobytes() == results[0].tobytes()
    got = results[0]
    block0 = slice(0, PER)
    check_ieee([got[block0]], [x[block0] for x in inputs], N.FLOAT32)
    offsets = {p.va & 0xFFFFFFFF for p in switch.contributions     # (RETH.va's offset)
               if W.unpack_imm(W.REQUEST_IMM, p.imm)["droppable"]}
    assert offsets == {4 * (2 * PER + r * N.LANES) for r in range(3)}
    assert switch_counters(switch)["drop_priority"] > 0
    assert all(c.get("lost_contributions", 0) > 0 for c in counters)


def test_echo_gives_a_worker_alone_its_own_nan_and_inf():
    x = scenario("float32", world=3)[0]
    (got,), counters = run(EchoSwitch(), [x])
    check_ieee([got], [x], N.FLOAT32)
    assert np.isnan(got[5]) and got[PER - 1] == -np.inf
    assert counters[0]["nonfinite_chunks"] == 2 * N.DEFAULT_BLOCK


def test_rtl_in_process_equals_golden():
    """The switch's RTL gives every dtype's non-finite scenario bit for bit as the golden
    model does (its exponent field's maximum carries the flag as the model's)."""
    from netagg.sim.model import make_switch

    inputs = {dtype: scenario(dtype, n=2 * PER + 7) for dtype in FORMATS}
    with make_switch() as rtl:
        got = {dtype: run(rtl, x)[0] for dtype, x in inputs.items()}
    for dtype, x in inputs.items():
        want, _ = run(GoldenSwitch(), x)
        check_ieee(got[dtype], x, FORMATS[dtype])
        assert got[dtype][0].tobytes() == want[0].tobytes()


@pytest.mark.parametrize("backend", ["golden", "rtl"])
def test_over_udp(backend):
    inputs = scenario("float32", n=2 * PER + 7)
    session = uuid.uuid4().hex
    with SimServer(make_backend(backend)).start() as server:
        def worker(rank):
            with Worker(rank, 3, server.url, session=session, slots=SLOTS, timeout=30) as w:
                return w.allreduce(inputs[rank], timeout=60)
        results = in_threads(worker, 3)
    check_ieee(results, inputs, N.FLOAT32)
