"""The host driver in process, against the golden model: credits bound the messages in flight,
message sequence numbers, priority drop within the loss budget, quorums."""

from __future__ import annotations

import collections
import time
import uuid

import numpy as np
import pytest

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import NetaggTimeout, SwitchControl, Worker
from netagg.host import numerics as N
from netagg.sim.golden import GoldenSwitch
from tests.host_workers import (
    RecordingSwitch,
    allreduce_all,
    assert_within_bound,
    switch_counters,
    workers,
)


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
        msns = [W.split_va(p.va)[0] for p in switch.contributions
                if p.src.ip == w.transport.local.ip]
        assert sorted(msns) == list(range(messages))
        slots = [W.unpack_imm(W.REQUEST_IMM, p.imm)["slot"] for p in switch.contributions
                 if p.src.ip == w.transport.local.ip]
        assert all(m % 8 == s for m, s in zip(msns, slots))


def test_droppable_chunks_are_the_smallest_in_the_lowest_classes():
    from netagg.host.engine import plan_droppable
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
    ctl.write([(R.drop_threshold(c), 0) for c in range(4)])
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
    with pytest.raises(NetaggTimeout, match="a fill-in round that lacks the data of rank 3; "
                                            ".*a peer of this job stopped contributing"):
        handles[0].wait()
    assert time.monotonic() - t0 < 8


class LowClassLost(RecordingSwitch):
    """A network queue in front of the golden model that loses every droppable contribution
    below class 7 (a low class a fabric drops under congestion), and passes the rest."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.lost = 0

    def send(self, port, frame, *args):
        pkt = W.parse_frame(frame)
        if pkt.opcode == W.OP_CONTRIBUTION and pkt.dscp >> 3 < 7 \
                and W.unpack_imm(W.REQUEST_IMM, pkt.imm)["droppable"]:
            self.lost += 1
            return
        super().send(port, frame, *args)


def test_a_lost_droppable_contribution_is_given_up_as_zeros_in_class_7():
    """Every first sending of a droppable contribution is lost on the way (classes 0..3);
    each worker gives up its data and sends zeros in class 7, not droppable, instead. Every
    use completes with every worker counted: a chunk's sum is the sum of the workers whose
    data arrived (the others' taken as zero), not scaled, not filled in, and every other
    chunk is the whole sum; no switch drops anything by priority."""
    rng = np.random.default_rng(23)
    switch = LowClassLost()
    ws = workers(4, switch)
    for w in ws:        # retransmissions are found by later answers, not by the clock
        w.engine.rto_min = w.engine.rto = 5.0
    big = priority_inputs(rng, 4, 40)
    handles = [w.allreduce_async([b], loss_budget=0.08, priority=4) for w, b in zip(ws, big)]
    results = [h.wait() for h in handles]
    assert all(np.array_equal(r[0], results[0][0]) for r in results)
    assert switch.lost == 12                        # 3 droppable chunks a worker
    dropped = [set(h.works[0].droppable) for h in handles]
    assert dropped == [{0, 5 + 2 * r, 6 + 2 * r} for r in range(4)]
    given = [p for p in switch.contributions if p.dscp >> 3 == 7]
    assert len(given) == 12 + 4                     # the zeros, and one exponent message each
    assert not any(W.unpack_imm(W.REQUEST_IMM, p.imm)["droppable"] for p in given)
    assert [w.counters()["given_up"] for w in ws] == [3] * 4
    got, exps = results[0][0].astype(np.float64), N.shared_exponents(big, N.FLOAT32)
    for c in range(40):
        lo, hi = c * N.LANES, min((c + 1) * N.LANES, len(got))
        arrived = [r for r in range(4) if c not in dropped[r]]
        want = np.sum([big[r][lo:hi].astype(np.float64) for r in arrived], axis=0) \
            if arrived else np.zeros(hi - lo)
        bound = N.error_bound(got[lo:hi], exps[lo:hi], 4, N.FLOAT32)
        assert np.all(np.abs(got[lo:hi] - want) <= bound), c
    for h in handles:
        assert h.stats()[0]["filled_chunks"] == h.stats()[0]["rescaled_chunks"] == 0
    sw = switch_counters(switch)
    assert sw["drop_priority"] == 0 and sw["drop_credit"] == 0
