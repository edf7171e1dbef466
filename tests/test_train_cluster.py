"""`netagg train --cluster`: DDP through gloo and netagg on an emulated cluster, a process per
host under its own torchrun agent, with each host link's bytes from its NIC's counters."""

import json
import math
import os

import pytest

from netagg.apps import torch_runs, train_cluster
from netagg.apps.cli import main
from netagg.sim.cluster import namespaces

pytestmark = pytest.mark.xdist_group("cluster")      # one cluster at a time, as test_cluster
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root")


def _needs_torch():
    pytest.importorskip("torch", reason="pip install -e .[torch]")
    pytest.importorskip("sklearn", reason="pip install -e .[torch]")


@needs_root
def test_gloo_and_netagg_train_over_the_cluster_links(tmp_path):
    """2 hosts, the fast switch, one epoch of the small CNN."""
    _needs_torch()
    name = "tctrain"
    runs = [r for r in torch_runs.RUNS if r.name in ("gloo", "netagg")]
    report = train_cluster.train_cluster(hosts=2, switch="fast", epochs=1, channels=16,
                                         hidden=128, runs=runs, name=name, quiet=True,
                                         timeout=300)
    assert namespaces(name) == []
    assert list(report["runs"]) == ["gloo", "netagg"]
    for run, r in report["runs"].items():
        assert r["world_size"] == 2 and r["local_world_size"] == 1, run
        assert r["steps"] == 1347 // 2 // 16 == len(r["loss_per_step"]), run
        assert all(math.isfinite(x) for x in r["loss_per_step"]), run
        assert r["replicas_identical"] and 0.1 < r["test_accuracy"] <= 1.0, run
        sent, received = r["host_bytes_per_step"]["sent"], r["host_bytes_per_step"]["received"]
        assert len(sent) == len(received) == 2 and min(sent + received) > 0, (run, sent)
        s = r["step_seconds"]
        assert 0 < s["p50"] <= s["p99"] and len(r["seconds_at_step"]) == r["steps"], run
    gloo, netagg = report["runs"]["gloo"], report["runs"]["netagg"]
    assert gloo["bytes_sent_per_worker"]["switch"] == 0 < gloo["bytes_sent_per_worker"]["tcp"]
    assert netagg["bytes_sent_per_worker"]["switch"] > 0 and netagg["drop_priority"] == 0
    # every host's gradients crossed its own link: at least what its worker sent the switch
    assert min(netagg["host_bytes_per_step"]["sent"]) * netagg["steps"] >= \
        netagg["bytes_sent_per_worker"]["switch"]
    assert set(report["accuracy_gap_points"]) == {"netagg"}
    text = train_cluster.summary(report)
    assert "gloo" in text and "netagg" in text and "22,602 parameters" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    train_cluster.plot(report, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 10_000


@needs_root
def test_a_run_whose_processes_fail_is_an_error_naming_it_and_leaves_nothing():
    _needs_torch()
    name = "tcfail"
    with pytest.raises(RuntimeError, match="run gloo, node 0: torchrun exited") as e:
        train_cluster.train_cluster(hosts=2, switch="fast", epochs=1, channels=0,
                                    runs=torch_runs.RUNS[:1], name=name, quiet=True,
                                    timeout=120)
    assert "channels and hidden >= 1" in str(e.value)
    assert namespaces(name) == []


def test_train_cluster_command_line(monkeypatch, capsys):
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return {"command": "train", "cluster": True, "runs": {}}
    monkeypatch.setattr(train_cluster, "train_cluster", fake)
    assert main(["train", "--cluster", "--json", "--hosts", "3", "--rate", "50mbit",
                 "--switch", "golden", "--runs", "gloo,netagg"]) == 0
    assert (seen["hosts"], seen["rate"], seen["switch"]) == (3, "50mbit", "golden")
    assert [r.name for r in seen["runs"]] == ["gloo", "netagg"]
    assert "epochs" not in seen and "channels" not in seen      # the cluster's defaults
    assert json.loads(capsys.readouterr().out)["cluster"] is True
    main(["train", "--cluster", "--json", "--epochs", "2", "--hidden", "512"])
    assert seen["epochs"] == 2 and seen["hidden"] == 512 and seen["switch"] == "fast"
