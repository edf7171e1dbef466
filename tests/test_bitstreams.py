"""The bitstream flow's reading of nextpnr's log (netagg.bitstreams.build): when it stops nextpnr,
and what it reports, from log lines in nextpnr's own format; the settings it hands nextpnr in
the netlist; and each board's top level, elaborated without the tools."""

import importlib
import json
import os
import re
import subprocess

import pytest

from netagg.bitstreams.build import (
    _nextpnr_with_settings,
    _reason_to_stop,
    fmax_from_log,
    utilisation_from_log,
)

UTILISATION = """Info: Device utilisation:
Info: \t          TRELLIS_IO:      35/    197    17%
Info: \t              DP16KD:      42/     56    75%
Info: \t          TRELLIS_FF:   14283/  24288    58%
Info: \t        TRELLIS_COMB:   {comb}/  24288    93%
"""
PLACED = (
    "Info: Max frequency for clock       '$glbnet$clk_eth_tx': {tx} MHz ({verdict} at 125.00 MHz)\n"
    "Info: Max frequency for clock         '$glbnet$clk_core': 31.39 MHz (PASS at 25.00 MHz)\n"
)


def _log(tmp_path, text):
    (tmp_path / "top.tim").write_text(text)
    return tmp_path


def test_stops_a_design_that_does_not_fit(tmp_path):
    d = _log(tmp_path, UTILISATION.format(comb=28832))
    assert utilisation_from_log(d)["luts"] == {"used": 28832, "available": 24288}
    assert "does not fit: luts 28832/24288" in _reason_to_stop(d, "nextpnr", 10, 1800, True)
    assert _reason_to_stop(d, "yosys", 10, 1800, True) is None


def test_stops_when_placement_misses_a_clock(tmp_path):
    d = _log(tmp_path, UTILISATION.format(comb=22771) + PLACED.format(tx="97.83", verdict="FAIL"))
    assert fmax_from_log(d) == {"clk_eth_tx": (97.83, 125.0), "clk_core": (31.39, 25.0)}
    reason = _reason_to_stop(d, "nextpnr", 10, 1800, True)
    assert "timing fails after placement: clk_eth_tx 97.8/125.0 MHz" in reason
    assert _reason_to_stop(d, "nextpnr", 10, 1800, False) is None      # --route-anyway


def test_routes_when_placement_meets_every_clock(tmp_path):
    d = _log(tmp_path, UTILISATION.format(comb=24152) + PLACED.format(tx="179.60", verdict="PASS"))
    assert _reason_to_stop(d, "nextpnr", 10, 1800, True) is None
    assert "time limit" in _reason_to_stop(d, "nextpnr", 1801, 1800, True)


def test_nextpnr_finds_its_settings_in_the_netlist(tmp_path):
    """The build script's nextpnr (a shim) writes the target's settings into the top module of
    the netlist named by --json, as strings like nextpnr's own, then runs the tool with the
    same arguments; a netlist with no top module is an error, not a silent run."""
    netlist = {"modules": {
        "top": {"attributes": {"top": "00000000000000000000000000000001"}, "cells": {}},
        "leaf": {"attributes": {}, "cells": {}}}}
    (tmp_path / "top.json").write_text(json.dumps(netlist))
    tool = tmp_path / "tool"
    tool.write_text('#!/bin/sh\necho "$@" > arguments\n')
    tool.chmod(0o755)
    env = {**os.environ, **_nextpnr_with_settings(
        tmp_path, str(tool), {"router2/currCongWeightMult": 0.05})}
    run = [env["NEXTPNR_ECP5"], "--quiet", "--json", "top.json", "--25k"]
    subprocess.run(run, cwd=tmp_path, env=env, check=True)
    written = json.loads((tmp_path / "top.json").read_text())["modules"]
    assert written["top"]["settings"] == {"router2/currCongWeightMult": "0.05"}
    assert "settings" not in written["leaf"]
    assert (tmp_path / "arguments").read_text() == "--quiet --json top.json --25k\n"

    del netlist["modules"]["top"]
    (tmp_path / "top.json").write_text(json.dumps(netlist))
    failed = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert failed.returncode != 0 and "has no top module" in failed.stderr


@pytest.mark.parametrize("board", ["colorlight_5a75b", "versa_ecp5_5g"])
def test_board_top_elaborates_with_every_clock_constrained(board):
    """Each board's top level elaborates (RTLIL, no synthesis), with a frequency constraint
    on each of its four clocks: the core, the transmit clock and both ports' receive
    clocks; and it holds the PLL, both ports' DDR I/O and their MACs."""
    from netagg.bitstreams.top import SwitchBoard

    target = importlib.import_module(f"netagg.bitstreams.{board}").TARGET
    plan = target.platform().prepare(SwitchBoard(target), name="top")
    constraints = dict(re.findall(r'FREQUENCY NET "([^"]+)" ([0-9.]+) HZ;', plan.files["top.lpf"]))
    assert {net: float(hz) for net, hz in constraints.items()} == {
        "pll.clk_eth_tx": 125e6, "pll.clk_core": target.core_hz,
        "phy0.rx_clk": 125e6, "phy1.rx_clk": 125e6,
    }
    rtlil = plan.files["top.il"]
    assert rtlil.count("cell \\EHXPLLL ") == 1
    assert rtlil.count("cell \\IDDRX1F ") == 2 * 5 and rtlil.count("cell \\ODDRX1F ") == 2 * 6
    for port in (0, 1):
        assert f"module \\top.mac{port}" in rtlil and f"module \\top.switch.ingress{port}" in rtlil
