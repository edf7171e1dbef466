"""The golden leaf and spine (netagg/sim/golden_leaf.py, docs/leafspine.md) in networks of golden
switches (the fabric's network, netagg/sim/topology.py, with tests/leafspine_net.py's job): sums
exact against numpy through one and two spines, partials' counts and overflow carried and
added, the frames between switches as scapy reads them, parent results refused when late or
foreign, a local retransmission re-sending the partial (UPSTREAM) or replaying the final
(DONE), a spine's finals and given-up uses, loss, duplication and reordering on every link,
SPRAY's balance, and the registers of switches with and without uplinks. Uplink failure:
tests/test_leaf_failure.py."""

import random

import numpy as np
import pytest
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.golden import GoldenSwitch
from netagg.sim.golden_leaf import GoldenLeaf
from netagg.sim.golden_leaf_registers import CopyState
from netagg.sim.golden_spine import GoldenSpine
from netagg.sim.scapy_frames import RETH, ImmDt
from netagg.sim.topology import Direction, LinkFaults
from tests.frames import scapy_frame
from tests.leafspine_net import (
    CHUNK,
    JOB,
    SPINE_KEY,
    Job,
    Net,
    control,
    leaf_ip,
    leaf_mac,
    spine_ip,
    spine_mac,
)
from tests.switch_traffic import dissect, run_rounds, scenario

INT32_MAX = (1 << 31) - 1


def read(frame: bytes):
    """scapy's reading of a frame between switches: (packet, RETH, ImmDt, int32 lanes)."""
    pkt = dissect(frame)
    body = bytes(pkt[BTH].payload)
    return pkt, RETH(body[:16]), ImmDt(body[16:20]).data, np.frombuffer(body[20:], "<i4")


def one_use(net: Net, values, use: int = 0, slot: int = 0, exponent: int = 0) -> list:
    """Every worker's contribution of `values[leaf][rank]` to `use` of `slot`, delivered;
    the frames the workers got, as (leaf, rank, frame)."""
    for l, ranks in enumerate(values):
        for r, lanes in enumerate(ranks):
            msn = use * net.slots + slot
            w = net.hosts[l][r]
            net.send(l, r, w.contribution(slot, use % 2, CHUNK * msn,
                                          np.array(lanes, np.int32), 0, msn=msn,
                                          exponent=exponent))
    net.drain()
    inbox, net.inbox = net.inbox, []
    return inbox


def leaf_of(link) -> int:
    """The leaf at a link's end between switches (its `a`)."""
    return int(link.a.removeprefix("leaf"))


def job_counters(sw) -> dict:
    return sw.counters()["jobs"][JOB]


@pytest.mark.parametrize("spines", [1, 2])
def test_sums_exact_through_spines(spines):
    net = Net(spines=spines, workers=[2, 3])
    job = Job(net, uses=4)
    assert job.run() == 4                      # a use a round: nothing lost, nothing waits
    assert job.results == 4 * 8 * 5            # each checked: numpy's sums, count 5
    for leaf in net.leaf:
        c = job_counters(leaf)
        assert c["upstream"] == c["parent_results"] == c["completed"] == 32
        assert c["drop_parent"] == c["resends"] == c["replays"] == 0
        assert leaf.read(R.job_reg(JOB, R.JOB_COMPLETED)) == 32
        assert leaf.read(R.job_counter(JOB, "parent_results")) == 32
    assert sum(job_counters(s)["completed"] for s in net.spine) == 32


def test_partials_count_overflow_and_msn():
    net = Net(workers=[2, 3], lanes=4)
    seen = net.tap()
    half = 1 << 29
    leaf0 = [[INT32_MAX, half, 1, -1], [1, half, 2, -2]]      # lane 0 saturates at the leaf
    leaf1 = [[0, half, 3, 0]] * 3                             # lane 1 saturates at the spine
    inbox = one_use(net, [leaf0, leaf1], use=1, slot=5)
    expected = [INT32_MAX, INT32_MAX, 12, -3]
    msn = 1 * net.slots + 5
    up = [(link, f) for link, d, f in seen if d is Direction.UP]
    down = [(link, f) for link, d, f in seen if d is Direction.DOWN]
    assert len(up) == 2 and len(down) == 2
    for link, frame in up:
        l = leaf_of(link)
        pkt, reth, imm, lanes = read(frame)
        part = W.unpack_imm(W.PARTIAL, pkt[BTH].psn)
        assert (part["count"], part["overflow"], part["resent"], part["final"]) == \
            ((2, 1, 0, 0) if l == 0 else (3, 0, 0, 0))
        assert pkt[IP].src == leaf_ip(l) and pkt[IP].dst == spine_ip(0)
        assert pkt[IP].tos >> 2 == W.PARTIAL_DSCP and pkt[UDP].dport == W.ROCEV2_PORT
        assert pkt.src == ":".join(f"{leaf_mac(l):012x}"[i:i + 2] for i in range(0, 12, 2))
        assert pkt[BTH].opcode == W.OP_CONTRIBUTION and reth.rkey == SPINE_KEY
        assert W.split_va(reth.va) == (msn, CHUNK * msn)
        req = W.unpack_imm(W.REQUEST_IMM, imm)
        assert (req["job"], req["rank"], req["slot"], req["version"], req["droppable"]) == \
            (JOB, l, 5, 1, 0)
        sums = np.sum(np.array(leaf0 if l == 0 else leaf1, np.int64), axis=0)
        np.testing.assert_array_equal(lanes, np.clip(sums, -INT32_MAX - 1, INT32_MAX))
    for link, frame in down:
        pkt, reth, imm, lanes = read(frame)
        res = W.unpack_imm(W.RESULT_IMM, imm)
        assert pkt[BTH].dqpn == W.UPLINK_QPN and reth.rkey == SPINE_KEY
        assert W.split_va(reth.va) == (msn, CHUNK * msn)         # the use's msn, not an address
        assert pkt[IP].src == spine_ip(0) and pkt[IP].dst == leaf_ip(leaf_of(link))
        assert (res["count"], res["overflow"], res["slot"], res["version"]) == (5, 1, 5, 1)
        np.testing.assert_array_equal(lanes, expected)
    assert len(inbox) == 5
    for l, r, frame in inbox:
        pkt, reth, imm, lanes = read(frame)
        res = W.unpack_imm(W.RESULT_IMM, imm)
        assert (res["count"], res["overflow"]) == (5, 1)
        assert reth.va == net.hosts[l][r].va + CHUNK * msn
        assert pkt[BTH].psn == 1                  # the leaf's credit limit: COMPLETED 1
        np.testing.assert_array_equal(lanes, expected)
    assert job_counters(net.leaf[0])["overflows"] == job_counters(net.spine[0])["overflows"] == 1


def test_null_at_a_leaf_counts_out_of_the_partial():
    net = Net(lanes=2)
    values = {(0, 0): [7, 7], (0, 1): [5, 6], (1, 0): [1, 2], (1, 1): [3, 4]}
    for (l, r), lanes in values.items():
        frame = net.hosts[l][r].contribution(0, 0, 0, np.array(lanes, np.int32), 0, msn=0,
                                             droppable=True)
        if (l, r) == (0, 0):            # its payload dropped by priority at the leaf
            net.leaf[0].send(0, frame, null=True)
        else:
            net.send(l, r, frame)
    net.drain()
    assert len(net.inbox) == 4
    for _, _, frame in net.inbox:
        _, _, imm, lanes = read(frame)
        assert W.unpack_imm(W.RESULT_IMM, imm)["count"] == 3      # the null's data is not in
        np.testing.assert_array_equal(lanes, [9, 12])


def test_quorum_and_deadline_at_a_leaf_count_its_local_contributions():
    net = Net(lanes=2, quorum=1)                    # a use of each leaf closes at one
    inbox = one_use(net, [[[1, 2]], [[10, 20]]])
    assert sorted((l, r) for l, r, _ in inbox) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for _, _, frame in inbox:
        _, _, imm, lanes = read(frame)
        assert W.unpack_imm(W.RESULT_IMM, imm)["count"] == 2
        np.testing.assert_array_equal(lanes, [11, 22])
    net.send(0, 1, net.hosts[0][1].contribution(0, 0, 0, np.array([5, 5], np.int32), 0, msn=0))
    net.drain()                                        # the late one: the final, replayed
    assert [(l, r) for l, r, _ in net.inbox] == [(0, 1)]
    np.testing.assert_array_equal(read(net.inbox[0][2])[3], [11, 22])

    net = Net(lanes=2)
    net.topology.control("leaf0", [(R.WRITE | R.job_reg(JOB, R.JOB_DEADLINE), 1)], check=True)
    first = net.hosts[0][0].contribution(0, 0, 0, np.array([1, 2], np.int32), 0, msn=0)
    inbox = one_use(net, [[], [[10, 20], [30, 40]]])
    net.send(0, 0, first)
    net.drain()
    assert not inbox and not net.inbox
    net.leaf[0].tick()
    net.send(0, 0, first)                              # a retransmission past the deadline
    net.drain()
    assert len(net.inbox) == 4
    for _, _, frame in net.inbox:
        _, _, imm, lanes = read(frame)
        assert W.unpack_imm(W.RESULT_IMM, imm)["count"] == 3
        np.testing.assert_array_equal(lanes, [41, 62])
    assert job_counters(net.leaf[0])["closed_late"] == 1


def test_parent_results_are_never_dropped_by_priority():
    net = Net(lanes=2)
    for leaf in net.leaf:                 # every droppable frame would lose its payload
        control(leaf, [(R.WRITE | R.drop_threshold(c), 0) for c in range(R.PRIORITY_CLASSES)])
    seen = net.tap()
    inbox = one_use(net, [[[1, 2], [3, 4]], [[5, 6], [7, 8]]], exponent=1)
    down = [f for _, d, f in seen if d is Direction.DOWN]
    # a result's exponent 1 sets the bit a contribution's ImmDt calls droppable
    assert all(W.unpack_imm(W.REQUEST_IMM, read(f)[2])["droppable"] for f in down)
    assert not any(net.leaf[0].drops_payload(f, 1 << 20) for f in down)
    assert len(inbox) == 4
    for _, _, frame in inbox:
        np.testing.assert_array_equal(read(frame)[3], [16, 20])
    assert job_counters(net.leaf[0])["parent_results"] == 1


def test_late_and_foreign_parent_results_refused():
    net = Net()
    seen = net.tap()
    job = Job(net, uses=3)
    job.run()
    down = [(link, f) for link, d, f in seen
            if d is Direction.DOWN and leaf_of(link) == 0 and link.a_port == 2]
    first, last = down[0][1], down[-1][1]
    leaf = net.leaf[0]
    assert leaf.receive(2, first) == []               # use 0's: the copy has moved on
    assert leaf.receive(2, last) == []                # the copy is DONE with it already
    assert leaf.receive(0, last) == []                # the spine's IP, not its port
    assert job_counters(leaf)["drop_parent"] == 3
    pkt, reth, imm, lanes = read(last)
    forged = scapy_frame(W.OP_RESULT, W.UPLINK_QPN, 0, lanes.tobytes(),
                         W.Endpoint(spine_ip(0), 0xC000, spine_mac(0)),
                         W.Endpoint(leaf_ip(0), W.ROCEV2_PORT, leaf_mac(0)),
                         reth=(reth.va, SPINE_KEY ^ 1, len(lanes) * 4), imm=imm)
    assert leaf.receive(2, forged) == []              # another R_Key than PARENT_KEY
    assert job_counters(leaf)["drop_parent"] == 4
    stranger = scapy_frame(W.OP_RESULT, W.UPLINK_QPN, 0, lanes.tobytes(),
                           W.Endpoint("10.0.3.3", 0xC000, spine_mac(0)),
                           W.Endpoint(leaf_ip(0), W.ROCEV2_PORT, leaf_mac(0)),
                           reth=(reth.va, SPINE_KEY, len(lanes) * 4), imm=imm)
    assert leaf.receive(2, stranger) == []            # no uplink's: a contribution, refused
    assert job_counters(leaf)["drop_parent"] == 4
    assert job_counters(leaf)["drop_bad_worker"] + job_counters(leaf)["drop_bad_key"] == 1


def test_retransmission_resends_upstream_and_replays_done():
    net = Net()
    net.silence(0)
    job = Job(net, uses=1)
    job.round()
    assert net.sent_up == [[8], [8]] and not job.results
    assert all(leaf.state[s][0].state is CopyState.UPSTREAM
               for leaf in net.leaf for s in range(8))
    seen = net.tap()
    job.round()                                     # every worker's retransmission
    up = [f for _, d, f in seen if d is Direction.UP]
    assert len(up) == 32 and job_counters(net.leaf[0])["resends"] == 16
    for frame in up:
        assert W.unpack_imm(W.PARTIAL, read(frame)[0][BTH].psn)["resent"] == 1
    net.silence(0, False)
    job.run()
    spine = job_counters(net.spine[0])
    assert spine["pulls"] > 0 and spine["completed"] == 8
    assert sum(job_counters(leaf)["pulled"] for leaf in net.leaf) > 0
    seen = net.tap()
    net.send(0, 1, job.contribution(0, 1, 0, 3))          # a retransmission in DONE
    net.drain()
    assert [(l, r) for l, r, _ in net.inbox] == [(0, 1)]
    job.check(0, 1, net.inbox[0][2])
    assert not [f for _, d, f in seen if d is Direction.UP]
    assert job_counters(net.leaf[0])["replays"] == 1


def partial(l: int, msn: int, lanes, *, count: int, final: int = 0, resent: int = 0,
            version: int = 0, slot: int = 0) -> bytes:
    """Leaf l's partial of use `msn` of `slot`, built by scapy."""
    payload = np.array(lanes, np.int32).tobytes()
    imm = W.pack_imm(W.REQUEST_IMM, job=JOB, rank=l, version=version, slot=slot)
    psn = W.pack_imm(W.PARTIAL, count=count, final=final, resent=resent)
    return scapy_frame(W.OP_CONTRIBUTION, 0, psn, payload,
                       W.Endpoint(leaf_ip(l), 0xC000, leaf_mac(l)),
                       W.Endpoint(spine_ip(0), W.ROCEV2_PORT, spine_mac(0)),
                       reth=(W.contribution_va(msn, 0), SPINE_KEY, len(payload)), imm=imm,
                       dscp=W.PARTIAL_DSCP)


def test_spine_final_completes_as_it_is_and_later_use_replaces_older():
    spine = Net(leaves=3).spine[0]
    assert spine.receive(0, partial(0, 0, [1, 2], count=2)) == []
    out = spine.receive(2, partial(2, 0, [100, 200], count=7, final=1))
    assert sorted(port for port, _ in out) == [0, 1, 2]
    for _, frame in out:
        _, _, imm, lanes = read(frame)
        assert W.unpack_imm(W.RESULT_IMM, imm)["count"] == 7
        np.testing.assert_array_equal(lanes, [100, 200])       # the final, not 101, 202
    assert job_counters(spine)["finals"] == 1
    assert spine.receive(0, partial(0, 2, [1, 1], count=1)) == []
    assert spine.receive(1, partial(1, 4, [5, 5], count=1)) == []     # a later use of the copy
    c = job_counters(spine)
    assert c["abandoned"] == 1 and c["drop_stale"] == 0
    assert spine.state[0][0].msn16 == 4 and spine.state[0][0].bitmap == 0b010
    assert spine.receive(0, partial(0, 2, [1, 1], count=1)) == []
    assert job_counters(spine)["drop_stale"] == 1
    pulls = spine.receive(1, partial(1, 4, [5, 5], count=1, resent=1))
    assert sorted(port for port, _ in pulls) == [0, 2]              # the leaves missing
    for _, frame in pulls:
        pkt, reth, imm, lanes = read(frame)
        assert pkt[BTH].dqpn == W.UPLINK_QPN and reth.dma_length == 0 and not len(lanes)
        assert W.split_va(reth.va)[0] == 4
    assert job_counters(spine)["pulls"] == 2


def test_a_spine_use_data_count_wraps_modulo_64_as_the_rtl_spine():
    spine = Net(leaves=3).spine[0]
    assert spine.receive(0, partial(0, 0, [1, 2], count=30)) == []
    assert spine.receive(1, partial(1, 0, [1, 2], count=30)) == []
    out = spine.receive(2, partial(2, 0, [1, 2], count=30))
    assert sorted(port for port, _ in out) == [0, 1, 2]
    for _, frame in out:
        _, _, imm, lanes = read(frame)
        assert W.unpack_imm(W.RESULT_IMM, imm)["count"] == 90 % 64       # 6 bits: no error
        np.testing.assert_array_equal(lanes, [3, 6])


@pytest.mark.parametrize("spines", [1, 2])
@pytest.mark.parametrize("seed", range(12))
def test_loss_duplication_reordering(spines, seed):
    net = Net(spines=spines, seed=seed)
    net.set_faults(LinkFaults(drop=0.1, duplicate=0.1, reorder=0.3))
    job = Job(net, uses=4, seed=seed)
    job.run()
    assert job.results >= 4 * 8 * 4
    assert sum(job_counters(leaf)["resends"] for leaf in net.leaf) > 0


@pytest.mark.parametrize("uplinks", [2, 4])
def test_spray_balance(uplinks):
    net = Net(spines=uplinks, slots=64)
    Job(net, uses=2).run()
    for counts in net.sent_up:
        mean = sum(counts) / uplinks
        assert all(abs(c - mean) <= 0.05 * mean for c in counts), counts
    assert [job_counters(s)["contributions"] for s in net.spine] == [2 * 64 * 2 // uplinks] * \
        uplinks
    net = Net(spines=uplinks, slots=64)
    net.mark_down(0b10)                       # uplink 1's slots go to uplink 2 (or 0)
    Job(net, uses=2).run()
    share = 2 * 64 // uplinks
    assert net.sent_up[0] == ([2 * share, 0] if uplinks == 2 else [share, 0, 2 * share, share])


def test_a_lost_link_takes_its_uplink_down_until_it_is_back():
    """Uplink 1's port on every leaf loses its link (its MAC says so; nobody writes
    REG_UPLINK_DOWN): its slots go up uplink 0, REG_UPLINK_LOST reads the bit, and once the
    link is back the slots spread over both again."""
    net = Net(spines=2, slots=64)
    port = net.topology.downlinks + 1
    for leaf in net.leaf:
        leaf.set_link(port, False)
    job = Job(net, uses=4)
    job.round()
    job.round()
    assert net.sent_up == [[128, 0], [128, 0]]
    assert [leaf.read(R.REG_UPLINK_LOST) for leaf in net.leaf] == [0b10, 0b10]
    for leaf in net.leaf:
        leaf.set_link(port, True)
    job.run()
    assert net.sent_up == [[192, 64], [192, 64]]
    assert [leaf.read(R.REG_UPLINK_LOST) for leaf in net.leaf] == [0, 0]


def test_registers_with_and_without_uplinks():
    addresses = [R.REG_UPLINKS, R.REG_UPLINK_DOWN, R.uplink_reg(0, R.UPLINK_IP),
                 R.uplink_reg(1, R.UPLINK_UDP_PORT), R.job_reg(0, R.JOB_PARENT),
                 R.job_reg(0, R.JOB_PARENT_KEY), R.job_reg(0, R.JOB_SPRAY)]
    values = [3, 0b11, 0x0A000002, 4791, R.PARENT.pack(enable=1, rank=3), 77, 0xE4]
    writes = [(R.WRITE | a, v) for a, v in zip(addresses, values)]
    config = (R.WRITE | R.job_reg(1, R.JOB_CONFIG), R.CONFIG.pack(partials=1, workers=2))
    for sw in (GoldenSwitch(), GoldenSpine()):
        assert control(sw, [*writes, config]) == [0] * len(writes) + \
            [R.CONFIG.pack(partials=int(isinstance(sw, GoldenSpine)), workers=2)]
        assert control(sw, [(R.job_counter(0, n), 0) for n in R.FABRIC_COUNTERS]) == \
            [0] * len(R.FABRIC_COUNTERS)
    leaf = GoldenLeaf(uplinks=2)
    assert control(leaf, writes) == [2, 0b11, 0x0A000002, 4791, values[4], 0, 0xE4]
    assert control(leaf, [(R.uplink_reg(2, R.UPLINK_IP), 0), (R.REG_MANAGER | R.WRITE, 1)]) \
        == [0, 1]
    assert control(leaf, [(R.WRITE | R.REG_UPLINK_DOWN, 0)]) == [0b11]     # not the manager
    assert leaf.read(R.port_counter(0, "control_denied")) == 1


@pytest.mark.parametrize("seed", range(3))
def test_a_job_without_parent_or_partials_is_served_as_by_one_switch(seed):
    sc = scenario(random.Random(seed), ports=4, jobs=2, workers=3, slots=8, rounds=3,
                  credits=8 * (seed % 2), stale=0.15, droppable=0.3, bad_keys=0.1,
                  saturate=seed == 2)
    one = GoldenSwitch(ports=4, jobs=2, max_workers=4, slots=32)
    leaf = GoldenLeaf(ports=4, jobs=2, max_workers=4, slots=32, uplinks=2)
    for sw in (one, leaf):
        for frame in sc.config:
            sw.receive(0, frame)
    assert run_rounds(leaf, sc) == run_rounds(one, sc)
    theirs = leaf.counters()
    assert theirs["ports"] == one.counters()["ports"]
    assert [{n: c[n] for n in R.JOB_COUNTERS} for c in theirs["jobs"]] == one.counters()["jobs"]
    assert not any(c[n] for c in theirs["jobs"] for n in R.FABRIC_COUNTERS)
