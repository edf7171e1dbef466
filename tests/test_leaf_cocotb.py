"""The RTL leaf under cocotb (tests/cocotb_leaf.py): against the golden model, in a world of
golden spines and a golden second leaf; and the leaf's line-rate benchmark and the second
level's latency (sim/bench_leaf.py) under pytest."""

import json

import pytest

from tests.conftest import run_cocotb

# One build of the leaf: 2 downlinks (ports 0, 1) and 2 uplinks (ports 2, 3), test_switch's
# tables; its spine and single switch alike (the single switch is test_switch's build).
SWITCH = {"ports": 4, "width": 64, "jobs": 2, "max_workers": 4, "slots": 16}
LEAF = {**SWITCH, "uplinks": 2}


def run(testcase, params=LEAF, module="tests.cocotb_leaf", **env):
    run_cocotb(module, "switch", testcase,
               env={"NETAGG_SWITCH": json.dumps(params), **env}, **params)


def test_line_rate():
    """Both downlinks at line rate: with one local worker per job (1:1) both uplinks carry
    one beat per cycle out and in, and every result comes back."""
    run("line_rate", module="netagg.sim.bench_leaf")


@pytest.mark.parametrize("hop, params", [("spine", {**SWITCH, "spine": True}),
                                         ("single", SWITCH)])
def test_hop_latency(hop, params):
    """One use through a spine and through a single switch completes."""
    run("hop_latency", params=params, module="netagg.sim.bench_leaf", NETAGG_HOP=hop)


@pytest.mark.parametrize("testcase", ["upstream_downstream", "spraying", "uplink_failure",
                                      "loss"])
def test_leaf(testcase):
    run(testcase)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [31, 32, 33, 34])
def test_leaf_loss_long(seed):
    """More seeds and uses of loss, duplication and reordering at both levels (20 %)."""
    run("loss", NETAGG_SEED=str(seed), NETAGG_USES="8", NETAGG_LOSS="0.2")
