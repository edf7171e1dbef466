"""`netagg bench host` at small sizes: every part of the report is there and its figures are
positive numbers; gloo's part is measured when torch is importable and reported as skipped,
with how to install it, when it is not; the command line hands its options on."""

from __future__ import annotations

import json
import numbers
import sys

import pytest

from netagg.apps import bench_host as B
from netagg.apps.cli import main

SIZES = [64 << 10, 256 << 10]
pytestmark = pytest.mark.xdist_group("bench_host")     # one run of the bench for the module


def positive(record: dict, *keys):
    for k in keys:
        assert isinstance(record[k], numbers.Real) and record[k] > 0, (k, record)


@pytest.fixture(scope="module")
def report():
    out = B.bench_host(SIZES, workers=2, quiet=True, timeout=60.0, rate_seconds=0.5)
    return json.loads(json.dumps(out))          # what --json prints


def test_one_worker_against_the_echo_switch(report):
    assert set(report["single_worker"]) == {"float32", "int32"}
    for s in report["single_worker"].values():
        assert s["tensor_bytes"] == max(SIZES)
        positive(s, "seconds", "MBps", "packets", "packets_per_second", "cpu_seconds",
                 "cpu_us_per_packet", "cpu_s_per_MB")
        assert s["packets"] >= max(SIZES) // 1024


def test_allreduce_at_each_size_beside_gloo_or_skipped(report):
    missing = B.torch_missing()
    assert set(report["allreduce"]) == {str(s) for s in SIZES}
    for row in report["allreduce"].values():
        positive(row["netagg"], "seconds", "MBps", "cpu_s_per_MB", "packets")
        if missing:
            assert "gloo" not in row and "ratio" not in row
        else:
            positive(row["gloo"], "seconds", "MBps")
            assert row["gloo"]["cpu_s_per_MB"] >= 0    # a short run may fall below a tick
            positive(row, "ratio")
    cpu = report["cpu_per_MB"]
    positive(cpu, "netagg_s_per_MB")
    if missing:
        assert report["gloo"]["skipped"] == missing and "pip install -e .[bench]" in missing
    else:
        positive(cpu, "gloo_seconds")
        assert cpu["ratio"] > 0 if cpu["gloo_s_per_MB_per_process"] else cpu["ratio"] is None
        assert cpu["gloo_processes"] == 2 and cpu["tensor_bytes"] == max(SIZES)


def test_overlap_and_the_golden_switch_rate(report):
    overlap = report["overlap"]
    assert {s: o["workers"] for s, o in overlap.items()} == {"echo": 1,
                                                             "golden": B.OVERLAP_WORKERS}
    for runs in overlap.values():
        for compute in B.COMPUTE:
            o = runs[compute]
            positive(o, "comm_seconds", "compute_seconds", "both_seconds", "both_cpu_seconds")
            assert 0.0 <= o["hidden"] <= 1.0 and o["tensor_bytes"] == max(SIZES)
            assert len(o["ranks"]) == runs["workers"]
            assert all(0.0 <= r["hidden"] <= 1.0 and r["units"] >= 1 for r in o["ranks"])
    positive(report["golden_switch"], "contributions_per_second")
    assert report["golden_switch"]["errors"] == 0


def test_without_torch_the_reason_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    reason = B.torch_missing()
    assert reason.startswith("torch is not importable") and "pip install -e .[bench]" in reason


def test_the_command_line_hands_its_options_on(monkeypatch, capsys):
    seen = {}

    def fake(sizes, workers):
        seen.update(sizes=sizes, workers=workers)
        return {"bench": "host"}
    monkeypatch.setattr(B, "bench_host", fake)
    assert main(["bench", "host", "--json", "--sizes", "64K,2M", "--workers", "3"]) == 0
    assert seen == {"sizes": [64 << 10, 2 << 20], "workers": 3}
    assert json.loads(capsys.readouterr().out) == {"bench": "host"}
