"""A world quorum across a leaf and spine fabric (`host.fabric_quorum`): the leaves' quorums
add up to at least the world's, a fill-in round has its leaf's quorum of senders at every
leaf, and in-process workers over a golden (and an RTL) 2x2 topology, one rank's
contributions dropped heavily, or one rank absent, complete every allreduce as the check
lane says: each result's sums hold exactly the data of the ranks its bitmap names, at least
the needed count of them, and the fill-in rounds make the int32 sums exact."""

from __future__ import annotations

import random
import threading
import time
import uuid

import numpy as np
import pytest

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import Worker
from netagg.host import numerics as N
from netagg.host.checklane import CheckLane
from netagg.host.errors import NetaggError, NetaggTimeout
from netagg.host.fabric import Placement
from netagg.host.fabric_quorum import FabricQuorum
from netagg.host.messages import Send
from netagg.sim.codec import decode
from netagg.sim.topology import Topology
from tests.host_workers import assert_within_bound


@pytest.mark.parametrize("world,leaves", [(8, 2), (7, 3), (12, 4), (2, 2)])
def test_the_leaves_quorums_add_up_to_at_least_the_worlds(world, leaves):
    for quorum in range(0, world + 2):
        q = FabricQuorum.of(quorum, world, leaves)
        sizes = [len(Placement.ranks_of(lf, world, leaves)) for lf in range(leaves)]
        assert list(q.sizes) == sizes
        closing = [q.closing(lf) for lf in range(leaves)]
        assert all(1 <= c <= n for c, n in zip(closing, sizes))
        assert all(q.local[lf] in (0, closing[lf]) and (q.local[lf] == 0) == (c == n)
                   for lf, (c, n) in enumerate(zip(closing, sizes)))
        if not 0 < quorum < world:
            assert q.local == (0,) * leaves and q.needed == world
        else:
            assert q.needed == sum(closing) == max(quorum, leaves)    # one rank a leaf at least
            # dealt to the leaf with the most ranks still needed: a leaf that got slack
            # needs at most one rank fewer than any other
            assert all(c >= max(closing) - 1 for c, n in zip(closing, sizes) if c < n)


def test_the_slack_goes_to_the_leaf_with_the_most_ranks_still_needed():
    assert FabricQuorum.of(7, 8, 2).local == (3, 0)       # leaf1 waits for all of its 4
    assert FabricQuorum.of(6, 8, 2).local == (3, 3)
    assert FabricQuorum.of(5, 8, 2).local == (2, 3)
    assert FabricQuorum.of(1, 8, 2).local == (1, 1) and FabricQuorum.of(1, 8, 2).needed == 2
    assert FabricQuorum.of(5, 7, 3).local == (1, 0, 2)    # leaves of 2, 2 and 3 ranks


@pytest.mark.parametrize("quorum", [0, 5, 6, 7])
def test_a_fill_in_round_has_its_leafs_quorum_of_senders_at_every_leaf(quorum):
    world, leaves = 8, 2
    q = FabricQuorum.of(quorum, world, leaves)
    lane = CheckLane(0x1234, 0, world)
    rng = random.Random(quorum)
    for _ in range(200):
        members = rng.getrandbits(world) or 1
        sends = {r: q.fill_in(lane, members, Placement.of(r, world, leaves))
                 for r in range(world)}
        for lf in range(leaves):
            ranks = Placement.ranks_of(lf, world, leaves)
            senders = [r for r in ranks if sends[r] is not Send.NOTHING]
            missing = [r for r in ranks if not members >> r & 1]
            assert all(sends[r] is Send.DATA for r in missing)
            assert all(sends[r] is not Send.DATA for r in ranks if members >> r & 1)
            assert len(senders) == max(len(missing), q.closing(lf))
    one, lane = FabricQuorum.of(3, 4, 1), CheckLane(1, 0, 4)   # one leaf: one switch's rule
    for members in range(1, 16):
        assert [one.fill_in(lane, members, Placement.of(r, 4, 1)) for r in range(4)] == \
            [lane.fill_in(members, r, 3) for r in range(4)]


# --- in-process workers over a 2x2 topology ------------------------------------------------

def drop_contributions(topo: Topology, share: float, seed: int = 0) -> dict:
    """From now on, `share` of the contributions (opcode 0x2B) from the IPv4 addresses put in
    the returned dict's "from" set are lost before their leaf (seeded); "lost" counts them."""
    rng, send = random.Random(seed), topo.send
    lossy = {"from": set(), "lost": 0}

    def lossy_send(port: int, frame: bytes):
        _, header = decode(frame)
        if header is not None and header.opcode == W.OP_RESULT and \
                header.src_ip in lossy["from"] and rng.random() < share:
            lossy["lost"] += 1
            return
        send(port, frame)
    topo.send = lossy_send
    return lossy


class Rounds:
    """Every result the workers' engines take by their check lane (`Taking.take`), with
    what the round's message held before it."""

    def __init__(self, workers):
        self.taken = []
        for w in workers:
            self._watch(w.engine)

    def _watch(self, engine):
        take = engine.take

        def watched(st, m, res):
            members = res.members
            if members is None and not res.overflow:
                members = engine.check_lane.members(res.check, res.count, m.tag)
            self.taken.append((m.work, m.index, m.acc is None, m.members, members, res.count,
                               np.array(res.sums)))
            return take(st, m, res)
        engine.take = watched

    def check(self, inputs: dict, needed: int) -> int:
        """Each result holds exactly the data of the ranks its bitmap shows (in a fill-in
        round: the ranks it adds; the others sent zeros) and at least `needed` ranks in a
        first round; the number of fill-in rounds' results."""
        fills = 0
        for work, index, first, before, members, count, sums in self.taken:
            assert members is not None and members.bit_count() == count
            part = work.values(index)
            adds = members if first else members & ~before
            xs = inputs[id(work)]
            expected = np.zeros(part.stop - part.start, np.int64)
            for r in range(len(xs)):
                if adds >> r & 1:
                    expected += xs[r][part]
            np.testing.assert_array_equal(sums[:len(expected)], expected)
            if first:
                assert count >= needed
            else:
                fills += 1
        return fills


def _workers(topo, world=8, ranks=None, **kw):
    session = uuid.uuid4().hex
    return [Worker(r, world, None, session=session, fabric=topo, timeout=30, **kw)
            for r in (range(world) if ranks is None else ranks)]


def _run(ws, steps: int, values: int, seed: int):
    """`steps` int32 allreduces; each one's inputs by id of every worker's work."""
    rng = np.random.default_rng(seed)
    inputs, world = {}, ws[0].world_size
    for _ in range(steps):
        xs = [rng.integers(-(1 << 20), 1 << 20, values, dtype=np.int32) for _ in range(world)]
        handles = [w.allreduce_async(xs[w.rank]) for w in ws]
        for h in handles:
            for work in h.works:
                inputs[id(work)] = xs
        for out in [h.wait(60) for h in handles]:
            assert np.array_equal(out, np.sum(xs, axis=0))
    return inputs


COUNTERS = ("completed", "closed_late", "drop_credit", "overflows", "resends", "pulls",
            "drop_parent")


def _job_counters(topo) -> dict:
    """Job 0's counters the tests read, at every switch, through its control path."""
    return {name: {c: v for c, (_, v) in zip(COUNTERS, topo.control(
                name, [(R.job_counter(0, c), 0) for c in COUNTERS]))}
            for name in topo.nodes}


@pytest.mark.parametrize("quorum,lossy,backend,steps,values",
                         [(6, 1, "golden", 2, 12_000), (7, 1, "golden", 2, 12_000),
                          (7, 5, "golden", 1, 12_000), (6, 1, "rtl", 2, 12_000)])
def test_a_world_quorum_with_a_lossy_rank_sums_as_the_check_lane_says(quorum, lossy, backend,
                                                                      steps, values):
    """Rank `lossy` loses half of its contributions before its leaf. Quorum 6 closes each
    leaf's uses at 3 of its 4 ranks; 7 at 3 at leaf0 and all 4 at leaf1 (rank 5 there is
    waited for). Every result holds exactly the bitmap's ranks' data, at least the needed
    count in a first round, fill-in rounds complete at both leaves, the sums are exact; the
    same through RTL leaves and spines."""
    topo = Topology(2, 2, backend)
    lost = drop_contributions(topo, 0.5, seed=quorum)
    ws = _workers(topo, quorum=quorum)
    lost["from"].add(W.ip_to_int(ws[lossy].transport.local.ip))
    rounds = Rounds(ws)
    inputs = _run(ws, steps=steps, values=values, seed=quorum)
    q = FabricQuorum.of(quorum, 8, 2)
    assert [w.engine.needed for w in ws] == [quorum] * 8
    assert rounds.check(inputs, q.needed) > 0 and lost["lost"] > 0
    counters = [w.counters() for w in ws]
    assert all(c["fill_rounds"] > 0 for c in counters)         # every rank, both leaves
    assert len({c["fill_rounds"] for c in counters}) == 1      # every rank decides alike
    jobs = _job_counters(topo)
    assert jobs["leaf0"]["completed"] == jobs["leaf1"]["completed"] == \
        jobs["spine0"]["completed"] + jobs["spine1"]["completed"]
    for leaf in ("leaf0", "leaf1"):
        assert jobs[leaf]["drop_credit"] == 0 and jobs[leaf]["overflows"] == 0
    # a contribution into a use its leaf sent up (late, or a retransmission while the other
    # leaf waits for the lossy rank) sends the partial again, resent: the spine pulls the
    # leaf missing from the use, at most one for each
    resends = sum(jobs[f"leaf{lf}"]["resends"] for lf in range(2))
    assert 0 < sum(jobs[s]["pulls"] for s in ("spine0", "spine1")) <= resends
    for w in ws:
        w.close()


def test_float32_with_a_quorum_and_a_lossy_rank_is_within_the_bound():
    """Quorum 6 with rank 6 losing half its contributions, float32 (exponent messages, whose
    proposals a quorum may close without, then the fill-in rounds): the same result on every
    rank, within the fixed-point bound of the world's sum."""
    topo = Topology(2, 2)
    lost = drop_contributions(topo, 0.5, seed=11)
    ws = _workers(topo, quorum=6)
    lost["from"].add(W.ip_to_int(ws[6].transport.local.ip))
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal(2 * N.LANES * N.DEFAULT_BLOCK + 7).astype(np.float32)
          for _ in ws]
    outs = [h.wait(60) for h in [w.allreduce_async(x) for w, x in zip(ws, xs)]]
    assert all(np.array_equal(o, outs[0]) for o in outs)
    assert_within_bound(outs[0], xs, N.FLOAT32)
    assert lost["lost"] > 0 and all(w.counters()["fill_rounds"] > 0 for w in ws)
    for w in ws:
        w.close()


def test_an_absent_rank_is_left_out_within_the_loss_budget():
    """Rank 2 never comes; quorum 7 lets leaf0 close at 3 of its 4: with a loss budget of one
    rank in 8, each float32 chunk is the other seven's sum scaled by 8/7, the same on every
    rank, and every result names the seven."""
    topo = Topology(2, 2)
    ws = _workers(topo, ranks=[r for r in range(8) if r != 2], quorum=7)
    rng = np.random.default_rng(5)
    xs = {w.rank: rng.standard_normal(3 * N.LANES).astype(np.float32) for w in ws}
    handles = [w.allreduce_async(xs[w.rank], loss_budget=1 / 8) for w in ws]
    outs = [h.wait(60) for h in handles]
    assert all(np.array_equal(o, outs[0]) for o in outs)
    total = np.sum([x.astype(np.float64) for x in xs.values()], axis=0)
    np.testing.assert_allclose(outs[0], total * 8 / 7, atol=1e-5)
    assert all(w.counters()["lost_contributions"] == 3 for w in ws)      # 3 chunks, 1 each
    assert _job_counters(topo)["leaf0"]["completed"] > 0
    for w in ws:
        w.close()


def test_an_absent_rank_without_a_loss_budget_is_named_in_bounded_time():
    """Rank 6 never comes, quorum 6, loss_budget 0: its data can never be filled in, which is
    a NetaggTimeout within the timeout that names the rank and its leaf, not rounds of zeros
    forever. On a loaded machine a slow rank can be left out of a round too (the quorum lets
    its leaf close without it), so rank 6 is one of the ranks the round lacks."""
    topo = Topology(2, 2)
    session = uuid.uuid4().hex
    ws = [Worker(r, 8, None, session=session, fabric=topo, timeout=2, quorum=6)
          for r in range(8) if r != 6]
    handles = [w.allreduce_async(np.ones(600, np.int32)) for w in ws]
    t0 = time.monotonic()
    with pytest.raises(NetaggTimeout, match=r"in job 0 \(rank 0 of 8\): .* a fill-in round "
                                            r"that lacks the data of ranks? (\d+ \(rank \d at "
                                            r"leaf\d\), )*6 \(rank 2 at leaf1\)"):
        handles[0].wait(30)
    assert time.monotonic() - t0 < 8
    for w in ws:
        w.close()


def test_deadline_and_quorum_together_close_the_leaf_without_slack():
    """Quorum 7 leaves leaf1 without slack; a deadline closes its uses without rank 5, whose
    contributions are all lost for a while: the fill-in rounds wait for rank 5 until it
    comes back, and the sums are exact."""
    topo = Topology(2, 2)
    lost = drop_contributions(topo, 1.0)
    ws = _workers(topo, quorum=7, deadline=1 / 64)
    for w in ws:
        w.engine.rto = w.engine.rto_min
    rank5 = W.ip_to_int(ws[5].transport.local.ip)
    lost["from"].add(rank5)
    rounds = Rounds(ws)
    rng = np.random.default_rng(9)
    xs = [rng.integers(-1000, 1000, 2 * N.LANES, dtype=np.int32) for _ in range(8)]
    handles = [w.allreduce_async(xs[w.rank]) for w in ws]
    give_up = time.monotonic() + 20
    while _job_counters(topo)["leaf1"]["closed_late"] == 0:
        assert time.monotonic() < give_up
        ws[0].advance(0.01)
    lost["from"].discard(rank5)                 # rank 5 is back: its data fills the chunks in
    for out in [h.wait(60) for h in handles]:
        assert np.array_equal(out, np.sum(xs, axis=0))
    inputs = {id(work): xs for h in handles for work in h.works}
    assert rounds.check(inputs, 0) > 0
    # a first round closed short: leaf1's by its deadline, without rank 5
    assert any(first and count < 7 for _, _, first, _, _, count, _ in rounds.taken)
    assert all(w.counters()["fill_rounds"] > 0 for w in ws)
    for w in ws:
        w.close()


def test_udp_workers_of_a_fabric_server_with_a_quorum():
    """`sim serve --topology 2x2`'s server, 8 UDP workers in threads with quorum 6: the fill-in
    rounds run over UDP as in process, every rank alike, and the int32 sums are exact."""
    from netagg.sim.topology_serve import FabricServer
    session = uuid.uuid4().hex
    rng = np.random.default_rng(3)
    xs = [rng.integers(-999, 999, 5_000, dtype=np.int32) for _ in range(8)]
    outs, fills, errors = {}, {}, []

    def run(rank, fabric):
        try:
            leaf = fabric["leaves"][rank // 4]["url"]
            with Worker(rank, 8, leaf, session=session, fabric=fabric, timeout=30,
                        quorum=6) as w:
                outs[rank] = [w.allreduce(xs[rank]) for _ in range(2)]
                fills[rank] = w.counters()["fill_rounds"]
        except Exception as e:          # (named in the assertion below)
            errors.append(f"rank {rank}: {e}")

    with FabricServer(2, 2).start() as server:
        threads = [threading.Thread(target=run, args=(r, server.describe())) for r in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    assert errors == [] and len(outs) == 8
    assert all(np.array_equal(o, np.sum(xs, axis=0)) for got in outs.values() for o in got)
    assert len(set(fills.values())) == 1 and fills[0] > 0


def test_every_rank_of_a_fabric_passes_the_same_quorum():
    """Leaf1's first rank configures it for quorum 6 (3 of its 4); rank 5, which asks for
    quorum 7 (all of leaf1's), is refused when it joins, with its rank, job and leaf."""
    topo = Topology(2, 2)
    session = uuid.uuid4().hex
    ws = [Worker(r, 8, None, session=session, fabric=topo, timeout=10,
                 quorum=7 if r == 5 else 6) for r in range(8)]
    handles = [w.allreduce_async(np.ones(100, np.int32)) for w in ws]
    with pytest.raises(NetaggError, match=r"rank 5 \(rank 1 at leaf1\) of job 0: leaf1 closes "
                                          r"a use at QUORUM 3, this rank's quorum=7 of 8"):
        handles[5].wait(20)
    for w in ws:
        w.close()
