"""The switch's cocotb testbench (tests/cocotb_switch.py) and its line-rate benchmark
(netagg/sim/bench_switch.py) under pytest."""

import json

import pytest

from tests.conftest import SIMULATORS, run_cocotb

# The default build: 4 ports of 64 bits, small tables so that Verilator builds it quickly.
SWITCH = {"ports": 4, "width": 64, "jobs": 2, "max_workers": 4, "slots": 16}


def run(testcase, params=SWITCH, simulator="verilator", module="tests.cocotb_switch", **env):
    run_cocotb(module, "switch", testcase, simulator=simulator,
               env={"NETAGG_SWITCH": json.dumps(params), **env}, **params)


@pytest.mark.parametrize("testcase", [
    "control_path", "aggregate_scenario", "aggregate_idle_backpressure", "egress_pressure",
    "saturation", "priority_drop", "credits_saturation", "sprayed_reordered",
    "early_close",
])
def test_switch(testcase):
    run(testcase)


def test_line_rate():
    """The benchmark's testcase: every port takes one beat per cycle, every result comes out."""
    run("line_rate", module="netagg.sim.bench_switch")


@pytest.mark.parametrize("simulator", SIMULATORS[1:])
def test_switch_second_simulator(simulator):
    """The aggregation scenario on the second simulator, when it is installed."""
    run("aggregate_scenario", simulator=simulator)
