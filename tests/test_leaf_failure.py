"""Uplink failure in networks of golden leaves and spines (docs/leafspine.md, "Uplink
failure"; the fabric's network, netagg/sim/topology.py, with tests/leafspine_net.py's job): a spine
that sent a use's result to one leaf only and goes silent, uplinks marked down mid-run (the
spine dead, or alive and marked up again later) or lost with their links, under loss,
duplication and reordering, and every uplink down. Every use completes, each worker's
result checked against numpy's sums."""

import random

import pytest

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.golden_leaf_registers import CopyState
from netagg.sim.topology import Direction, LinkFaults, Notice
from tests.leafspine_net import JOB, Job, Net, away_and_back, away_for_2_16


def counters(sw) -> dict:
    return sw.counters()["jobs"][JOB]


def cut_after_first_result(net: Net, spine: int, leaf: int) -> dict:
    """Arm the network so that `spine`'s first result to `leaf` is lost and the spine goes
    silent at that moment (its frames in flight are lost too); what was cut, once it is."""
    cut = {}

    def lose(link, direction, frame):
        if cut or direction is not Direction.DOWN or link.a != f"leaf{leaf}":
            return False
        if link.b != f"spine{spine}" or not W.parse_frame(frame).payload:
            return False
        pkt = W.parse_frame(frame)
        imm = W.unpack_imm(W.RESULT_IMM, pkt.imm)
        cut.update(slot=imm["slot"], version=imm["version"], msn=W.split_va(pkt.va)[0])
        net.silence(spine)
        return True

    net.topology.tap = lose
    return cut


@pytest.mark.parametrize("leaves", [2, 3])
def test_spine_silent_after_one_leaf_got_the_result(leaves):
    net = Net(leaves=leaves, spines=2)
    job = Job(net, uses=4)
    job.round()                                   # use 0 everywhere
    cut = cut_after_first_result(net, spine=0, leaf=leaves - 1)
    job.round()
    assert cut, "spine 0 sent no result to the last leaf"
    s, v = cut["slot"], cut["version"]
    assert net.leaf[0].state[s][v].state is CopyState.DONE          # the hazard
    assert net.leaf[-1].state[s][v].state is CopyState.UPSTREAM
    job.round()                                   # re-sent up a dead uplink: nothing
    assert net.leaf[-1].state[s][v].state is CopyState.UPSTREAM
    net.mark_down(0b01)
    job.run()
    assert counters(net.leaf[0])["pulled"] >= 1                    # answered with its final
    assert counters(net.spine[1])["finals"] >= 1
    assert counters(net.spine[1])["pulls"] >= 1
    for leaf in net.leaf:
        assert leaf.read(R.job_reg(JOB, R.JOB_COMPLETED)) == 4 * 8


@pytest.mark.parametrize("dies", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_uplink_marked_down_mid_run_under_loss(dies, seed):
    """Spine 0 dies (or is only marked down, and up again later) at a random round; the
    leaves mark it down a round later; loss, duplication and reordering on every link."""
    rng = random.Random(seed)
    net = Net(spines=2, seed=seed)
    net.set_faults(LinkFaults(drop=0.1, duplicate=0.1, reorder=0.3))
    job = Job(net, uses=6, seed=seed)
    fail, back = rng.randrange(1, 4), rng.randrange(5, 8)

    def faults(n):
        if n == fail and dies:
            net.silence(0)
        if n == fail + 1:
            net.mark_down(0b01)
        if n == back and not dies:
            net.mark_down(0)
    job.run(299, each_round=faults)
    for leaf in net.leaf:
        assert leaf.read(R.job_reg(JOB, R.JOB_COMPLETED)) == 6 * 8


@pytest.mark.parametrize("seed", range(3))
def test_a_spine_whose_links_are_lost_mid_run_under_loss(seed):
    """Spine 0's links are cut at a random round and the leaves' MACs report them lost
    (nobody writes REG_UPLINK_DOWN): its slots go to spine 1 at once, the uses in flight on
    it complete; its links back, it takes its slots again. Loss, duplication and reordering
    on every link."""
    rng = random.Random(seed)
    net = Net(spines=2, seed=seed)
    net.set_faults(LinkFaults(drop=0.1, duplicate=0.1, reorder=0.3))
    job = Job(net, uses=8, seed=seed)
    fail, back = rng.randrange(1, 3), rng.randrange(4, 6)
    before = []                         # what went up uplink 0 when its links came back

    def faults(n):
        if n == fail:
            net.topology.cut(0, Notice.LINK)
            assert [leaf.read(R.REG_UPLINK_LOST) for leaf in net.leaf] == [0b01, 0b01]
        if n == back:
            net.topology.restore(0)
            assert [leaf.read(R.REG_UPLINK_LOST) for leaf in net.leaf] == [0, 0]
            before.extend(sent[0] for sent in net.sent_up)
    job.run(299, each_round=faults)
    assert before and all(sent[0] > was for sent, was in zip(net.sent_up, before))
    for leaf in net.leaf:
        assert leaf.read(R.job_reg(JOB, R.JOB_COMPLETED)) == 8 * 8


def test_every_uplink_down_waits_then_completes():
    net = Net(spines=2)
    job = Job(net, uses=2)
    net.mark_down(0b11)
    job.round()
    job.round()
    assert not job.results and net.sent_up == [[0, 0], [0, 0]]
    assert counters(net.leaf[0])["no_uplink"] == 8 + 16    # first sends, then re-sends
    assert net.leaf[0].state[0][0].state is CopyState.UPSTREAM
    net.mark_down(0b10)
    job.run()
    assert net.sent_up[0][1] == 0 and job.results == 2 * 8 * 4


@pytest.mark.parametrize("seed", range(3))
def test_a_spine_back_after_2_16_messages_elsewhere_takes_the_new_uses(seed):
    """Spine 1 marked down while the leaves run more than 2^16 of the job's messages through
    spine 0 (msns driven directly: `away_for_2_16`), then marked up: its copies, far
    behind by 16 bits, take the new uses by their whole msns, and every use completes with
    numpy's sums (seed 0 lossless; the others under loss, duplication and reordering)."""
    net = Net(leaves=3, spines=2, seed=seed)
    if seed:
        net.set_faults(LinkFaults(drop=0.1, duplicate=0.1, reorder=0.3))
    job = Job(net, uses=14, seed=seed, skipped=away_for_2_16())
    assert job.msn(13, 0) - job.msn(1, 0) > 1 << 16
    assert (job.msn(13, 1) - job.msn(1, 1)) & 0xFFFF >= 1 << 15      # behind, by 16 bits
    completed = away_and_back(net, job)
    assert job.results >= 14 * 8 * 6             # every worker's, each checked
    # back, it completed its 4 slots' uses (lossless: every one of the last 4 uses)
    assert completed["after"] == 4 * 4 if not seed else completed["after"] >= 4
