"""The RTL leaf as far as it is built (`hw.switch.Switch(uplinks=N)`, docs/leafspine.md):
its registers (REG_UPLINKS, REG_UPLINK_DOWN, the uplink table, each job's PARENT,
PARENT_KEY and SPRAY) read and written as the golden leaf's, the manager's and the job
owner's rules included, and a lost link's uplink in REG_UPLINK_LOST; a leaf's jobs without a parent
served frame for frame as `GoldenLeaf` serves them (the fuzzer's good traffic, every
register and counter read); its upward half against the golden leaf (the fuzzer's leaf
mode: uses that complete locally go up as partials, re-sent on retransmissions, held back
with every uplink down or its link lost) and its
downward half (a fake spine's results and pulls, and their mutations) with no difference; a
use's partial as scapy reads it, from both leaves; and a leaf (golden or RTL) beside a
golden leaf under two golden spines, whose lost partial a spine pulls: every worker's
result exact; and a spine's result under every drop threshold 0 taken whole."""

import collections

import numpy as np
import pytest
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.fuzz import Comparer, stream
from netagg.sim.golden_leaf import GoldenLeaf
from tests.leafspine_net import CHUNK, JOB, SPINE_KEY, Job, Net, control, leaf_ip, spine_ip
from tests.switch_traffic import dissect
from tests.test_fuzz import InOrderGolden
from tests.test_spine_rtl import _read

UPLINKS = 2
PORTS = 6       # the 2x2 fabric's leaf (`Topology(2, 2, backend="rtl")`): one build for both


@pytest.fixture(scope="module")
def rtl_leaf():
    from netagg.sim.model import make_switch

    with make_switch(uplinks=UPLINKS, ports=PORTS) as rtl:
        yield rtl


@pytest.fixture(params=["golden", "rtl"])
def leaf(request):
    if request.param == "golden":
        return GoldenLeaf(ports=PORTS, uplinks=UPLINKS)
    rtl = request.getfixturevalue("rtl_leaf")
    rtl.reset()
    return rtl


def test_a_leaf_reads_and_writes_its_registers(leaf):
    addresses = [R.REG_UPLINKS, R.REG_UPLINK_DOWN, R.uplink_reg(0, R.UPLINK_PORT),
                 R.uplink_reg(0, R.UPLINK_MAC_HI), R.uplink_reg(1, R.UPLINK_MAC_LO),
                 R.uplink_reg(0, R.UPLINK_IP), R.uplink_reg(1, R.UPLINK_UDP_PORT),
                 R.uplink_reg(2, R.UPLINK_IP), R.job_reg(0, R.JOB_PARENT),
                 R.job_reg(0, R.JOB_PARENT_KEY), R.job_reg(0, R.JOB_SPRAY)]
    values = [3, 0b111, 0x13, 0x12345, 0xDEADBEEF, 0x0A000002, 0x14791,
              0x0A000003, 0x7FFF_FFE3, 77, 0xE4E4_0001]
    writes = [(R.WRITE | a, v) for a, v in zip(addresses, values)]
    assert control(leaf, writes) == [UPLINKS, 0b11, 0x3, 0x2345, 0xDEADBEEF, 0x0A000002,
                                      0x4791, 0, R.PARENT.pack(enable=0, rank=3), 0,
                                      0xE4E4_0001]
    assert control(leaf, [(a, 0) for a in addresses]) == [
        UPLINKS, 0b11, 0x3, 0x2345, 0xDEADBEEF, 0x0A000002, 0x4791, 0, 3, 0, 0xE4E4_0001]
    config = R.CONFIG.pack(enable=1, partials=1, workers=2)
    assert control(leaf, [(R.WRITE | R.job_reg(1, R.JOB_CONFIG), config),
                          (R.WRITE | R.job_reg(1, R.JOB_PARENT),
                           R.PARENT.pack(enable=1, rank=31))]) == [
        config, R.PARENT.pack(enable=1, rank=31)]
    # a manager set: the uplink table is its alone; another's write is denied and counted
    assert control(leaf, [(R.WRITE | R.REG_MANAGER, 1)]) == [1]
    assert control(leaf, [(R.WRITE | R.REG_UPLINK_DOWN, 0),
                          (R.WRITE | R.uplink_reg(0, R.UPLINK_IP), 5),
                          (R.port_counter(0, "control_denied"), 0)]) == [0b11, 0x0A000002, 2]
    assert control(leaf, [(R.job_counter(0, n), 0) for n in R.FABRIC_COUNTERS]) == \
        [0] * len(R.FABRIC_COUNTERS)


def test_a_leafs_jobs_without_a_parent_are_a_single_switchs(rtl_leaf):
    rtl_leaf.reset()
    s = Comparer(rtl_leaf, GoldenLeaf(ports=PORTS, uplinks=UPLINKS), seed=31).run(
        stream(31, 2000, ports=PORTS, mutation_rate=0))
    assert s.differences == 0 and s.wrong_sums == 0, s.text()
    assert s.results > 200 and s.counters > 5000


class InOrderLeaf(InOrderGolden, GoldenLeaf):
    """The golden leaf in the RTL's place (frames applied in the switch's commit order)."""


def _totals(golden) -> collections.Counter:
    total = collections.Counter()
    for counters in golden.counters()["jobs"]:
        total.update(counters)
    return total


def test_a_lost_link_reads_as_its_uplink_lost(leaf):
    """An uplink whose port's MAC reports the link lost reads in REG_UPLINK_LOST (read only),
    and REG_UPLINK_DOWN keeps what was written; the link back, it reads 0 again."""
    table = [(R.WRITE | R.uplink_reg(0, R.UPLINK_PORT), 3),
             (R.WRITE | R.uplink_reg(1, R.UPLINK_PORT), 2)]
    assert control(leaf, table) == [3, 2]
    leaf.set_link(2, False)
    leaf.set_link(1, False)                         # no uplink's port
    assert control(leaf, [(R.REG_UPLINK_LOST, 0), (R.REG_UPLINK_DOWN, 0)]) == [0b10, 0]
    assert control(leaf, [(R.WRITE | R.REG_UPLINK_DOWN, 0b01),
                          (R.WRITE | R.REG_UPLINK_LOST, 0)]) == [0b01, 0b10]
    leaf.set_link(2, True)
    assert control(leaf, [(R.REG_UPLINK_LOST, 0), (R.REG_UPLINK_DOWN, 0)]) == [0, 0b01]


def test_the_golden_leaf_against_itself_goes_up_and_down():
    golden = GoldenLeaf(uplinks=UPLINKS)
    s = Comparer(InOrderLeaf(uplinks=UPLINKS), golden, seed=5).run(stream(5, 4000, leaf=True))
    assert (s.differences, s.wrong_sums) == (0, 0)
    total = _totals(golden)
    assert total["upstream"] > 50 and total["resends"] > 20 and total["no_uplink"] > 10
    assert total["parent_results"] > 5 and total["pulled"] > 2 and total["drop_parent"] > 50


def test_rtl_leaf_equals_golden_leaf_going_up_and_down(rtl_leaf):
    rtl_leaf.reset()
    golden = GoldenLeaf(ports=PORTS, uplinks=UPLINKS)
    s = Comparer(rtl_leaf, golden, seed=32).run(stream(32, 4000, ports=PORTS, leaf=True))
    assert s.differences == 0 and s.wrong_sums == 0, s.text()
    assert s.counters > 10000
    total = _totals(golden)             # and the RTL's: every counter was read and compared
    assert total["upstream"] > 50 and total["resends"] > 20 and total["no_uplink"] > 10
    assert total["parent_results"] > 5 and total["pulled"] > 2 and total["drop_parent"] > 50


@pytest.mark.slow
def test_rtl_leaf_equals_golden_leaf_going_up_and_down_long(rtl_leaf):
    rtl_leaf.reset()
    s = Comparer(rtl_leaf, GoldenLeaf(ports=PORTS, uplinks=UPLINKS), seed=33).run(
        stream(33, 100_000, ports=PORTS, leaf=True))
    assert s.differences == 0 and s.wrong_sums == 0, s.text()


@pytest.fixture(params=["golden", "rtl"])
def fabric_leaf(request):
    """A fabric of one leaf of two workers and two (golden) spines (`Net`); its leaf golden
    or the RTL's (the fuzzer's build, its addresses written: its job 0 is the fabric's)."""
    if request.param == "golden":
        return Net(leaves=1, spines=UPLINKS)
    from netagg.sim.golden_spine import GoldenSpine
    from netagg.sim.topology import Role, default_ip, default_mac

    rtl = request.getfixturevalue("rtl_leaf")
    rtl.reset()
    mac = default_mac(Role.LEAF, 0)
    control(rtl, [(R.WRITE | R.REG_MAC_HI, mac >> 32), (R.WRITE | R.REG_MAC_LO, mac & 0xFFFFFFFF),
                  (R.WRITE | R.REG_IP, W.ip_to_int(default_ip(Role.LEAF, 0)))])

    def make(uplinks=0, **params):
        return rtl if uplinks else GoldenSpine(**params)
    return Net(leaves=1, spines=UPLINKS, make=make)


def test_a_leafs_partial_as_scapy_reads_it(fabric_leaf):
    net = fabric_leaf
    up = []     # (spine, frame) of every frame up a link, taken off it (no spine answers)
    net.topology.tap = lambda link, direction, frame: not up.append((int(link.b[5:]), frame))
    values = [np.array([1, -2, 3, 4], np.int32), np.array([10, 20, 30, (1 << 31) - 1], np.int32)]
    for slot in (0, 1):
        for r, w in enumerate(net.hosts[0]):
            net.send(0, r, w.contribution(slot, 0, CHUNK * slot, values[r], 0, msn=slot,
                                          exponent=r - 1))
    net.drain()
    assert net.inbox == [] and [spine for spine, _ in up] == [0, 1]   # SPRAY e % 2
    for (spine, frame), slot in zip(up, (0, 1)):
        pkt, reth, imm, lanes = _read(frame)
        assert pkt[IP].src == leaf_ip(0) and pkt[IP].dst == spine_ip(spine)
        assert pkt[IP].tos >> 2 == W.PARTIAL_DSCP and pkt[UDP].dport == W.ROCEV2_PORT
        assert pkt[BTH].opcode == W.OP_CONTRIBUTION and pkt[BTH].dqpn == 0
        assert W.unpack_imm(W.PARTIAL, pkt[BTH].psn) == {
            "reserved": 0, "final": 0, "resent": 0, "overflow": 1, "count": 2}
        assert reth.rkey == SPINE_KEY and reth.dma_length == 16
        assert W.split_va(reth.va) == (slot, CHUNK * slot)
        assert W.unpack_imm(W.REQUEST_IMM, imm) == {
            "job": JOB, "rank": 0, "version": 0, "slot": slot, "exponent": 0,
            "droppable": 0, "reserved": 0}
        np.testing.assert_array_equal(lanes, [11, 18, 33, (1 << 31) - 1])
    up.clear()
    w = net.hosts[0][1]
    net.send(0, 1, w.contribution(0, 0, 0, values[1], 0, msn=0, exponent=0))   # a retransmission
    net.drain()
    [(spine, frame)] = up
    assert spine == 0 and W.unpack_imm(W.PARTIAL, dissect(frame)[BTH].psn)["resent"] == 1
    counters = control(net.leaf[0], [(R.job_counter(JOB, n), 0)
                                     for n in ("upstream", "resends", "completed", "results")])
    assert counters == [3, 1, 0, 0]


@pytest.fixture(params=["golden", "rtl"])
def two_leaves(request):
    """Two leaves of two workers under two golden spines (`Net`, two slots): leaf 0 golden
    or the RTL's (its addresses written), leaf 1 golden."""
    if request.param == "golden":
        return Net(leaves=2, spines=UPLINKS, slots=2)
    from netagg.sim.golden_spine import GoldenSpine
    from netagg.sim.topology import Role, default_ip, default_mac

    rtl = request.getfixturevalue("rtl_leaf")
    rtl.reset()
    mac = default_mac(Role.LEAF, 0)
    control(rtl, [(R.WRITE | R.REG_MAC_HI, mac >> 32), (R.WRITE | R.REG_MAC_LO, mac & 0xFFFFFFFF),
                  (R.WRITE | R.REG_IP, W.ip_to_int(default_ip(Role.LEAF, 0)))])
    made = []

    def make(uplinks=0, **params):
        if uplinks and not made:
            made.append(rtl)
            return rtl
        return GoldenLeaf(uplinks=uplinks, **params) if uplinks else GoldenSpine(**params)
    return Net(leaves=2, spines=UPLINKS, slots=2, make=make)


def test_a_leaf_takes_its_spines_results_and_answers_its_pull(two_leaves):
    net = two_leaves
    job = Job(net, uses=1)
    lost = []       # leaf 0's partial of slot 0, taken off its uplink

    def tap(link, direction, frame):
        pkt = W.parse_frame(frame)
        lose = (not lost and pkt.src.ip == leaf_ip(0) and pkt.dqpn == 0
                and W.unpack_imm(W.REQUEST_IMM, pkt.imm)["slot"] == 0)
        if lose:
            lost.append(frame)
        return lose
    net.topology.tap = tap
    job.round()     # slot 1 completes at its spine; slot 0 waits there for leaf 0
    assert len(lost) == 1 and job.results == 4 and job.pending() == {
        (0, 0, 0): 0, (0, 1, 0): 0, (1, 0, 0): 0, (1, 1, 0): 0}
    # a worker of leaf 1 retransmits: leaf 1 re-sends its partial, the spine pulls leaf 0,
    # which answers with its partial; the spine's results reach every worker
    net.send(1, 0, job.contribution(1, 0, 0, 0))
    net.drain()
    for l, r, frame in net.inbox:
        job.check(l, r, frame)          # the sums, count and flags of the use
    assert sorted((l, r) for l, r, _ in net.inbox) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    names = ("pulled", "parent_results", "upstream", "drop_parent", "completed", "results")
    assert control(net.leaf[0], [(R.job_counter(JOB, n), 0) for n in names]) == \
        [1, 2, 3, 0, 2, 4]


def test_a_spines_result_is_never_dropped_by_priority(leaf):
    """Every class's drop threshold 0 (every droppable contribution nulled): a spine's
    result whose ImmDt reads as a droppable REQUEST_IMM (RESULT_IMM's exponent 1) is still
    taken whole, and its sums reach the worker."""
    from tests.frames import scapy_frame
    from tests.switch_traffic import Worker, job_config_records

    me = W.Endpoint("10.0.0.1", W.ROCEV2_PORT, 0x02AA00000001)
    spine = W.Endpoint(spine_ip(0), W.ROCEV2_PORT, 0x02DD00000000)
    w = Worker(job=JOB, rank=0, ip="10.1.0.10", mac=0x020000000100, udp_port=0xC100, port=0,
               qpn=0x100, rkey=0xAB00, va=1 << 40, key=0x1234)
    assert W.unpack_imm(W.REQUEST_IMM, W.pack_imm(W.RESULT_IMM, job=JOB, count=1, version=0,
                                                  slot=0, exponent=1, overflow=0))["droppable"]
    control(leaf, [(R.WRITE | R.REG_IP, W.ip_to_int(me.ip)),
                   (R.WRITE | R.REG_MAC_HI, me.mac >> 32),
                   (R.WRITE | R.REG_MAC_LO, me.mac & 0xFFFFFFFF),
                   (R.WRITE | R.uplink_reg(0, R.UPLINK_PORT), 2),
                   (R.WRITE | R.uplink_reg(0, R.UPLINK_IP), W.ip_to_int(spine.ip))]
            + [(R.WRITE | R.drop_threshold(c), 0) for c in range(8)])
    control(leaf, job_config_records(JOB, [w], 0, 1) + [
        (R.WRITE | R.job_reg(JOB, R.JOB_PARENT_KEY), SPINE_KEY),
        (R.WRITE | R.job_reg(JOB, R.JOB_PARENT), R.PARENT.pack(enable=1, rank=0))])
    [(port, _)] = leaf.receive(0, w.contribution(0, 0, 0, np.array([1, 2], np.int32), 0))
    assert port == 2                    # the partial went up uplink 0
    sums = np.array([7, -9], "<i4")
    imm = W.pack_imm(W.RESULT_IMM, job=JOB, count=3, version=0, slot=0, exponent=1,
                     overflow=0)
    result = scapy_frame(W.OP_RESULT, W.UPLINK_QPN, 5, sums.tobytes(), spine, me,
                         reth=(W.contribution_va(0, 0), SPINE_KEY, 8), imm=imm)
    [(port, frame)] = leaf.receive(2, result)
    pkt = W.parse_frame(frame)
    assert port == 0 and pkt.dst.ip == w.ip and pkt.payload == sums.tobytes()
    assert W.unpack_imm(W.RESULT_IMM, pkt.imm)["count"] == 3
    assert control(leaf, [(R.port_counter(2, "drop_priority"), 0),
                          (R.job_counter(JOB, "parent_results"), 0)]) == [0, 1]
