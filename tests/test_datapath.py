"""The datapath of one port, in cocotb on Verilator (and Icarus when installed)."""

import pytest

from tests.conftest import SIMULATORS, run_cocotb


@pytest.mark.parametrize("mode", ["none", "both"])
def test_roundtrip(width, mode):
    run_cocotb("tests.cocotb_datapath", "datapath", "roundtrip", width=width,
               env={"NETAGG_MODE": mode})


@pytest.mark.parametrize("mode", ["idle", "backpressure"])
def test_parser_output(width, mode):
    run_cocotb("tests.cocotb_datapath", "datapath", "parser_output", width=width,
               env={"NETAGG_MODE": mode})


@pytest.mark.parametrize("mode", ["idle", "backpressure"])
def test_deparser_output(width, mode):
    run_cocotb("tests.cocotb_datapath", "datapath", "deparser_output", width=width,
               env={"NETAGG_MODE": mode})


def test_corrupted_frames(width):
    run_cocotb("tests.cocotb_datapath", "datapath", "corrupted_frames", width=width)


def test_runt_behind_each_size(width):
    run_cocotb("tests.cocotb_datapath", "datapath", "runt_behind_each_size", width=width)


def test_line_rate(width):
    run_cocotb("netagg.sim.bench_datapath", "datapath", "line_rate", width=width)


@pytest.mark.parametrize("simulator", SIMULATORS)
def test_roundtrip_on_each_simulator(simulator):
    run_cocotb("tests.cocotb_datapath", "datapath", "roundtrip", simulator=simulator, width=64,
               env={"NETAGG_MODE": "both"})


def test_icrc_engine(width):
    run_cocotb("tests.cocotb_icrc", "icrc", "icrc_matches_scapy,crc_of_random_bytes", width=width)
