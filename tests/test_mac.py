"""The Ethernet MAC (hw/mac.py) in cocotb on Verilator, against cocotbext-eth's GMII models.

One small Verilator build (width 64, the switch's port width on the boards) serves every test.
"""

import pytest

from tests.conftest import run_cocotb


@pytest.mark.parametrize("testcase", [
    "receive_checks_fcs", "transmit_line_rate", "both_directions", "receive_overflow",
])
def test_mac(testcase):
    run_cocotb("cocotb_mac", "mac", testcase, width=64)
