"""The RTL leaf under cocotb (tests/cocotb_leaf.py): against the golden model, in a world of
golden spines and a golden second leaf; and the leaf's line-rate benchmark and the second
level's latency (netagg/sim/bench_leaf.py) under pytest."""

import json

import pytest

from netagg.apps.bench_leafspine import LEAF, SINGLE, SPINE, rtl_figures
from tests.conftest import run_cocotb

# The builds are the bench's: the leaf of 2 downlinks (ports 0, 1) and 2 uplinks (ports 2,
# 3), the spine, and the single switch (tests/test_switch.py's tables, so its build). The
# spine's build serves only its hop and the bench's figures: both are in the slow set (the
# RTL spine is checked against the golden spine in tests/test_spine_rtl.py).


def run(testcase, params=LEAF, module="tests.cocotb_leaf", **env):
    run_cocotb(module, "switch", testcase,
               env={"NETAGG_SWITCH": json.dumps(params), **env}, **params)


def test_line_rate():
    """Both downlinks at line rate: with one local worker per job (1:1) both uplinks carry
    one beat per cycle out and in, and every result comes back."""
    run("line_rate", module="netagg.sim.bench_leaf")


@pytest.mark.parametrize("hop, params", [pytest.param("spine", SPINE, marks=pytest.mark.slow),
                                         ("single", SINGLE)])
def test_hop_latency(hop, params):
    """One use through a spine and through a single switch completes."""
    run("hop_latency", params=params, module="netagg.sim.bench_leaf", NETAGG_HOP=hop)


@pytest.mark.parametrize("testcase", ["upstream_downstream", "spraying", "uplink_failure",
                                      "every_uplink_down", "spine_dies_under_loss", "loss"])
def test_leaf(testcase):
    run(testcase)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [31, 32, 33, 34])
def test_leaf_loss_long(seed):
    """More seeds and uses of loss, duplication and reordering at both levels (20 %)."""
    run("loss", NETAGG_SEED=str(seed), NETAGG_USES="8", NETAGG_LOSS="0.2")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [41, 42, 43, 44, 45, 46])
def test_leaf_spine_dies_under_loss_long(seed):
    """More seeds of a spine dying mid-run under loss at both levels (20 %)."""
    run("spine_dies_under_loss", NETAGG_SEED=str(seed), NETAGG_USES="6", NETAGG_LOSS="0.2")


@pytest.mark.slow
def test_bench_leafspine_rtl_figures():
    """`netagg bench leafspine`'s RTL figures: every uplink took beats out and in, in both
    cases, the 1:1 uplinks about one a cycle and the 2:1 about half; every latency positive,
    the second level adding at least the spine's."""
    rtl = rtl_figures(rounds=2)
    for uplinks in rtl["uplink_beats_per_cycle"].values():
        assert sorted(uplinks) == ["uplink0", "uplink1"]
        for v in uplinks.values():
            assert v["out"] > 0 and v["in"] > 0
    assert all(v["out"] >= 0.95 for v in rtl["uplink_beats_per_cycle"]["1:1"].values())
    assert all(0.4 <= v["out"] <= 0.6 for v in rtl["uplink_beats_per_cycle"]["2:1"].values())
    c = rtl["latency_cycles"]
    assert all(c[k] > 0 for k in ("leaf_up", "spine", "leaf_down", "single_switch"))
    assert c["two_levels"] == c["leaf_up"] + c["spine"] + c["leaf_down"]
    assert c["added"] == c["two_levels"] - c["single_switch"] >= c["spine"] - c["single_switch"]
    assert rtl["ports"]["1:1"]["downlink0"]["in_beats_per_cycle"] > 0.95
