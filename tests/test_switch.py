"""The switch's cocotb testbench (tests/cocotb_switch.py) under pytest."""

import json

import pytest

from tests.conftest import run_cocotb

# The default build: 4 ports of 64 bits, small tables so that Verilator builds it quickly.
SWITCH = {"ports": 4, "width": 64, "jobs": 2, "max_workers": 4, "slots": 16}


def run(testcase, params=SWITCH, **env):
    run_cocotb("cocotb_switch", "switch", testcase,
               env={"NETAGG_SWITCH": json.dumps(params), **env}, **params)


@pytest.mark.parametrize("testcase", [
    "control_path", "aggregate_scenario", "aggregate_idle_backpressure", "egress_pressure",
    "saturation", "line_rate",
])
def test_switch(testcase):
    run(testcase)
