"""Hierarchical workers (`local_size` > 1) across a leaf and spine fabric, in process: 8 workers
in 4 nodes of 2 over two leaves and two spines, several tensors and dtypes exact against numpy
and floats bit for bit the flat fabric's; every switch's jobs (one per local worker) claimed
with slot ranges of their own; a leaf with one job (local worker 0 alone carries the node's
sums); a node gone named by every other node's workers, in each switch job; `slot_base=`; a
quorum and the 63-rank limit counted in nodes; set-up errors that name the rank and its node;
8 worker processes over UDP."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from netagg.contract import regmap as R
from netagg.host import Worker, liveness
from netagg.host import numerics as N
from netagg.host.errors import NetaggError, NetaggRankGone
from netagg.sim.topology import Topology
from tests.host_workers import assert_within_bound, in_threads

WORLD, LOCAL = 8, 2


def _workers(topo, world=WORLD, local_size=LOCAL, **kw):
    session = uuid.uuid4().hex
    return [Worker(r, world, None, local_size=local_size, session=session, fabric=topo,
                   timeout=30, **kw) for r in range(world)]


def _tensors(rank: int) -> list[np.ndarray]:
    """Rank `rank`'s tensors: int32 of several lengths, and floats whose values the fixed
    point holds exactly (so that their sums are numpy's to the bit), in each float dtype."""
    rng = np.random.default_rng(100 + rank)
    per = N.LANES * N.DEFAULT_BLOCK
    return [rng.integers(-2**24, 2**24, n, dtype=np.int32)
            for n in (1, N.LANES + 1, 3 * per + 7)] + [
        (rng.integers(-1000, 1000, 2 * per + 5) / 8).astype(np.float32),
        (rng.integers(-100, 100, 3000) / 4).astype(np.float16),
        N.from_float64(rng.integers(-15, 16, 4000).astype(np.float64), N.BFLOAT16,
                       np.zeros(1, np.uint16))]


def _config(topo, name: str, job: int) -> dict:
    regs = [R.JOB_CONFIG, R.JOB_SLOT_BASE, R.JOB_SLOT_COUNT]
    got = [v for _, v in topo.control(name, [(R.job_reg(job, f), 0) for f in regs])]
    return {"config": R.CONFIG.unpack(got[0]), "slots": range(got[1], got[1] + got[2])}


def test_nodes_over_two_leaves_sum_exactly_in_a_job_per_local_worker():
    topo = Topology(2, 2)
    ws = _workers(topo)
    assert [(w.placement.rank, w.placement.leaf, w.placement.leaf_rank, w.switch_job)
            for w in ws] == [(n, n // 2, n % 2, j) for n in range(4) for j in range(2)]
    inputs = [_tensors(r) for r in range(WORLD)]
    dtypes = ["int32"] * 3 + ["float32", "float16", "bfloat16"]
    for step in range(2):                       # the second step reuses the node's memory
        out = in_threads(lambda r: ws[r].allreduce(inputs[r][:3] + inputs[r][3:5])
                         + [ws[r].allreduce(inputs[r][5], dtype="bfloat16")], WORLD)
        for i, dtype in enumerate(dtypes):
            if dtype == "bfloat16":
                exact = np.sum([N.to_float64(x[i], N.BFLOAT16) for x in inputs], axis=0)
                got = [N.to_float64(o[i], N.BFLOAT16) for o in out]
            else:
                exact = np.sum([x[i].astype(np.float64) for x in inputs], axis=0)
                got = [o[i] for o in out]
            for g in got:
                assert g.dtype == (np.float64 if dtype == "bfloat16" else dtype)
                assert np.array_equal(g, exact), (step, dtype)
    # every switch's jobs 0 and 1 are the fabric's: enabled, slots of their own, the leaves'
    # of their 2 nodes, the spines' of the 2 leaves (partials); each use once, at one spine
    for name in topo.nodes:
        jobs = [_config(topo, name, j) for j in range(LOCAL)]
        assert all(c["config"]["enable"] and c["config"]["workers"] == 2 for c in jobs)
        assert [c["config"]["partials"] for c in jobs] == [int(name.startswith("spine"))] * 2
        assert not set(jobs[0]["slots"]) & set(jobs[1]["slots"])
    for j in range(LOCAL):
        done = {name: topo.control(name, [(R.job_counter(j, "completed"), 0)])[0][1]
                for name in topo.nodes}
        assert done["leaf0"] == done["leaf1"] == done["spine0"] + done["spine1"] > 0
    for w in ws:
        w.close()


def test_floats_equal_the_flat_fabrics_bit_for_bit():
    rng = np.random.default_rng(7)
    inputs = [[(rng.standard_normal(n) * 10.0 ** rng.uniform(-2, 2)).astype(np.float32)
               for n in (5, 3 * N.LANES * N.DEFAULT_BLOCK + 11)] for _ in range(WORLD)]
    flat = _workers(Topology(2, 2), local_size=1)
    expected = [h.wait(60) for h in [w.allreduce_async(x) for w, x in zip(flat, inputs)]]
    ws = _workers(Topology(2, 2))
    out = in_threads(lambda r: ws[r].allreduce(inputs[r], op="sum"), WORLD)
    for o in out:
        for i in range(2):
            assert np.array_equal(o[i], expected[0][i])
    assert_within_bound(out[0][1], [x[1] for x in inputs], N.FLOAT32)
    for w in flat + ws:
        w.close()


def test_a_leaf_with_one_job_takes_each_nodes_local_worker_0_alone():
    topo = Topology(2, 2, jobs=1)
    ws = _workers(topo)
    assert [w.leaders for w in ws] == [1] * WORLD
    assert [w.engine is not None for w in ws] == [r % LOCAL == 0 for r in range(WORLD)]
    xs = [np.full(2 * N.LANES * N.DEFAULT_BLOCK, r + 1, np.int32) for r in range(WORLD)]
    for o in in_threads(lambda r: ws[r].allreduce(xs[r]), WORLD):
        assert np.array_equal(o, np.sum(xs, axis=0))
    assert [w.counters().get("packets_sent", 0) > 0 for w in ws] == \
        [r % LOCAL == 0 for r in range(WORLD)]
    for w in ws:
        w.close()


def die(worker):
    """A worker's process gone for good: closed without its closing beat (`host.liveness`)."""
    worker.engine.liveness.closing = lambda: None
    worker.close()


def test_a_gone_node_is_named_in_each_of_its_jobs_by_every_other_node():
    """Node 3 (ranks 6 and 7, rank 1 at leaf1) gone after a first allreduce: the others'
    next one fails within the one-switch bound, local worker i's naming node 3's worker of
    job i by its world rank, its node, its rank at its leaf and the leaf."""
    topo = Topology(2, 2)
    ws = _workers(topo)
    # two exponent blocks: one per local worker, so that both send
    xs = [np.full(2 * N.LANES * N.DEFAULT_BLOCK, r, np.int32) for r in range(WORLD)]
    in_threads(lambda r: ws[r].allreduce(xs[r]), WORLD)     # every worker has beaten
    die(ws[6])
    die(ws[7])
    gone_at = time.monotonic()

    def named(r):
        with pytest.raises(NetaggRankGone) as e:
            ws[r].allreduce(xs[r], timeout=10)
        return e.value, time.monotonic() - gone_at
    errors = in_threads(named, 6)
    for r, (e, after) in enumerate(errors):
        j = r % LOCAL
        assert e.job == j and e.ranks == (3,), (r, e)
        assert str(e).startswith(f"rank {6 + j} (node 3, rank 1 at leaf1) of job {j} gone: "
                                 f"heartbeats in leaf1 still"), (r, e)
        assert f"; rank {r} (node {r // 2}, rank {r // 2 % 2} at leaf{r // 4}) of 4 waits" \
            in str(e), (r, e)
        assert after < liveness.DEAD_AFTER + 2 * liveness.READ_PERIOD + 1.0, (r, after)
    for w in ws[:6]:
        w.close()


def test_the_63_rank_limit_counts_nodes():
    topo = Topology(2, 2)
    with pytest.raises(NetaggError, match=r"rank 3, job 0: a fabric's job holds at most 63 "
                                          r"ranks .*, not 64 nodes \(switch workers; 128 ranks "
                                          r"in nodes of 2\)"):
        Worker(3, 128, None, local_size=2, session="s", fabric=topo, timeout=2)
    assert topo.control("leaf0", [(R.job_reg(0, R.JOB_CONFIG), 0)])[0][1] == 0    # untouched


def test_set_up_errors_name_the_rank_and_its_node():
    topo = Topology(2, 2)
    with pytest.raises(NetaggError, match=r"rank 5 \(node 2\) of 8 sits on leaf1 .*not on "
                                          r"'leaf0'"):
        Worker(5, 8, "leaf0", local_size=2, session="s", fabric=topo, timeout=2)
    with pytest.raises(NetaggError, match=r"rank 5 \(node 2, rank 0 at leaf1\): waited 1 s for "
                                          r"the spines: spine0's job 1 was not configured for "
                                          r"this run by rank 1 \(node 0\)"):
        Worker(5, 8, None, local_size=2, session="s", fabric=topo, timeout=1)


def test_8_worker_processes_in_4_nodes_over_udp_through_a_fabric_server():
    """`netagg sim serve --topology 2x2`'s server, 8 worker processes (`apps.demo`'s, each at
    its node's leaf over UDP) in 4 nodes of 2: float32 within the bound, every rank's result
    the same bits, both leaves' partials up both uplinks."""
    from netagg.apps.demo import run_workers
    from netagg.sim.topology_serve import FabricServer
    with FabricServer(2, 2).start() as server:
        report = run_workers(None, workers=WORLD, nodes=WORLD // LOCAL, values=30_000, steps=2,
                             timeout=30, fabric=server.describe())
        partials = server.topology.partials()
    assert report["errors"] == [] and report["verified"] and report["results_agree"], report
    assert all(p[0] > 0 and p[1] > 0 for p in partials.values()), partials


def test_slot_base_gives_a_nodes_jobs_consecutive_ranges_at_every_switch():
    topo = Topology(2, 2)
    ws = _workers(topo, slots=6, slot_base=20)
    xs = [np.full(3 * N.LANES * N.DEFAULT_BLOCK, r - 3, np.int32) for r in range(WORLD)]
    for o in in_threads(lambda r: ws[r].allreduce(xs[r]), WORLD):
        assert np.array_equal(o, np.sum(xs, axis=0))
    for name in topo.nodes:
        assert [_config(topo, name, j)["slots"] for j in range(LOCAL)] == \
            [range(20, 26), range(26, 32)], name
    for w in ws:
        w.close()


def test_a_quorum_counts_nodes():
    """quorum=3 of the 4 nodes: the node of slack goes to leaf0 (QUORUM 1 of its 2 nodes,
    leaf1 all of its 2), in both switch jobs; int32 sums stay exact (the fill-in rounds add
    what a use closed without)."""
    topo = Topology(2, 2)
    ws = _workers(topo, quorum=3)
    xs = [np.arange(3 * N.LANES * N.DEFAULT_BLOCK, dtype=np.int32) * (r + 1) for r in range(8)]
    for _ in range(2):
        for o in in_threads(lambda r: ws[r].allreduce(xs[r]), WORLD):
            assert np.array_equal(o, np.sum(xs, axis=0))
    quorums = {name: [topo.control(name, [(R.job_reg(j, R.JOB_QUORUM), 0)])[0][1]
                      for j in range(LOCAL)] for name in ("leaf0", "leaf1")}
    assert quorums == {"leaf0": [1, 1], "leaf1": [0, 0]}
    for w in ws:
        w.close()
