"""The RTL leaf as far as it is built (`hw.switch.Switch(uplinks=N)`, docs/leafspine.md):
its registers (REG_UPLINKS, REG_UPLINK_DOWN, the uplink table, each job's PARENT,
PARENT_KEY and SPRAY) read and written as the golden leaf's, the manager's and the job
owner's rules included; and a leaf's jobs without a parent served frame for frame as
`GoldenLeaf` serves them (the fuzzer's good traffic, every register and counter read). Its
datapath for a job with a parent (partials up, parent results and pulls) is not built yet."""

import pytest
from netagg.sim import wire as W
from netagg.sim.fuzz import Comparer, stream
from netagg.sim.golden_leaf import GoldenLeaf

from tests.leafspine_net import control

UPLINKS = 2


@pytest.fixture(scope="module")
def rtl_leaf():
    from netagg.sim.model import make_switch

    with make_switch(uplinks=UPLINKS) as rtl:
        yield rtl


@pytest.fixture(params=["golden", "rtl"])
def leaf(request):
    if request.param == "golden":
        return GoldenLeaf(uplinks=UPLINKS)
    rtl = request.getfixturevalue("rtl_leaf")
    rtl.reset()
    return rtl


def test_a_leaf_reads_and_writes_its_registers(leaf):
    addresses = [W.REG_UPLINKS, W.REG_UPLINK_DOWN, W.uplink_reg(0, W.UPLINK_PORT),
                 W.uplink_reg(0, W.UPLINK_MAC_HI), W.uplink_reg(1, W.UPLINK_MAC_LO),
                 W.uplink_reg(0, W.UPLINK_IP), W.uplink_reg(1, W.UPLINK_UDP_PORT),
                 W.uplink_reg(2, W.UPLINK_IP), W.job_reg(0, W.JOB_PARENT),
                 W.job_reg(0, W.JOB_PARENT_KEY), W.job_reg(0, W.JOB_SPRAY)]
    values = [3, 0b111, 0x13, 0x12345, 0xDEADBEEF, 0x0A000002, 0x14791,
              0x0A000003, 0x7FFF_FFE3, 77, 0xE4E4_0001]
    writes = [(W.WRITE | a, v) for a, v in zip(addresses, values)]
    assert control(leaf, writes) == [UPLINKS, 0b11, 0x3, 0x2345, 0xDEADBEEF, 0x0A000002,
                                      0x4791, 0, W.PARENT.pack(enable=0, rank=3), 0,
                                      0xE4E4_0001]
    assert control(leaf, [(a, 0) for a in addresses]) == [
        UPLINKS, 0b11, 0x3, 0x2345, 0xDEADBEEF, 0x0A000002, 0x4791, 0, 3, 0, 0xE4E4_0001]
    config = W.CONFIG.pack(enable=1, partials=1, workers=2)
    assert control(leaf, [(W.WRITE | W.job_reg(1, W.JOB_CONFIG), config),
                          (W.WRITE | W.job_reg(1, W.JOB_PARENT),
                           W.PARENT.pack(enable=1, rank=31))]) == [
        config, W.PARENT.pack(enable=1, rank=31)]
    # a manager set: the uplink table is its alone; another's write is denied and counted
    assert control(leaf, [(W.WRITE | W.REG_MANAGER, 1)]) == [1]
    assert control(leaf, [(W.WRITE | W.REG_UPLINK_DOWN, 0),
                          (W.WRITE | W.uplink_reg(0, W.UPLINK_IP), 5),
                          (W.port_counter(0, "control_denied"), 0)]) == [0b11, 0x0A000002, 2]
    assert control(leaf, [(W.job_counter(0, n), 0) for n in W.FABRIC_COUNTERS]) == \
        [0] * len(W.FABRIC_COUNTERS)


def test_a_leafs_jobs_without_a_parent_are_a_single_switchs(rtl_leaf):
    rtl_leaf.reset()
    s = Comparer(rtl_leaf, GoldenLeaf(uplinks=UPLINKS), seed=31).run(
        stream(31, 2000, mutation_rate=0))
    assert s.differences == 0 and s.wrong_sums == 0, s.text()
    assert s.results > 200 and s.counters > 5000
