"""The "netagg" torch.distributed backend, its DDP hook and `netagg train`.

A torchrun job of 2 processes (tests/torch_job.py) runs `init_process_group("netagg")`
against `netagg sim serve` (golden model), once as one node of 2 (hierarchical) and once as
2 nodes of 1 (two torchrun agents: flat), and checks all_reduce against a gloo group (int32
bit for bit, floats within the fixed-point bound of netagg/host/numerics.py), that what the switch
cannot do is gloo's (right results, no packet sent), the other collectives, Work futures,
DDP with and without the netagg hook beside gloo's DDP, and an inf on one rank reaching
every rank (GradScaler skips the step on every rank alike); the job's all_reduce over a
leaf and spine fabric, 2 nodes of 2. Set-up errors name the rank; `netagg train` runs
small, and its command line hands its options on.
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch", reason="pip install -e .[torch]")
import torch.distributed as dist  # noqa: E402

from netagg.apps import torch_runs  # noqa: E402
from netagg.apps.cli import main  # noqa: E402

pytestmark = pytest.mark.xdist_group("torch")     # one switch; torchrun jobs one at a time
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_TIMEOUT = 120


def run_job(tmp_path, url: str, nodes: int, per_node: int) -> list[dict]:
    """tests/torch_job.py under torchrun; what each rank wrote."""
    torch_runs.torchrun([os.path.join(ROOT, "tests", "torch_job.py"), str(tmp_path)],
                        url=url, nodes=nodes, per_node=per_node, logs=tmp_path,
                        what="tests/torch_job.py", timeout=JOB_TIMEOUT)
    return [json.loads((tmp_path / f"rank{r}.json").read_text())
            for r in range(nodes * per_node)]


@pytest.mark.parametrize("nodes,per_node", [(1, 2), (2, 1)], ids=["hierarchical", "flat"])
def test_torchrun_job_through_the_switch(tmp_path, served_switch, nodes, per_node):
    ranks = run_job(tmp_path, served_switch, nodes, per_node)
    for r in ranks:
        assert r["group"] == "NetaggProcessGroup" and r["backend"] == "netagg"
        assert r["local_size"] == per_node
        for case, got in r["switch_vs_gloo"].items():
            if case.startswith("int32"):
                assert got["equal_to_gloo"] and got["equal_to_exact"], (r["rank"], case)
            else:
                assert got["exact_over_bound"] <= 1.0, (r["rank"], case, got)
                assert got["gloo_over_bound"] <= 1.0, (r["rank"], case, got)
        # 5000 values are 2 exponent blocks: each rank (each leader, hierarchical) sends
        assert all(got["packets"] > 0 for got in r["switch_vs_gloo"].values()), r
        for case, got in r["fallbacks"].items():
            assert got == {"right": True, "packets": 0}, (r["rank"], case, got)
        assert r["collectives"] == {"broadcast": True, "all_gather_object": True,
                                    "work_future": True}
        d = r["ddp"]
        assert d["plain_vs_gloo"] < 1e-5 and d["hook_vs_gloo"] < 1e-5, d
        assert d["droppable_sent"] > 0 and d["droppable_classes"], d
        assert max(d["droppable_classes"]) < 5, d     # below the last layer's class
        assert d["weights"] == ranks[0]["ddp"]["weights"]
        nf = r["nonfinite"]         # an inf on one rank: every rank skips the step alike
        assert nf["inf_everywhere"] and nf["rest_exact"] and nf["skips_step"], nf
        assert nf["nan_from_both_signs"], nf
        assert nf["scaler"] == [{"scale": 512.0, "moved": False},
                                {"scale": 512.0, "moved": True}], nf
        assert nf["weights"] == ranks[0]["nonfinite"]["weights"]
        assert r["shut_down"]


def test_torchrun_job_through_a_leaf_and_spine_fabric(tmp_path, monkeypatch):
    """2 torchrun agents of 2 processes (hierarchical) over `sim serve --topology 2x2`'s
    server: NETAGG_FABRIC names its description and no switch is named, so node 0 joins at
    leaf0 and node 1 at leaf1, local rank i in switch job i; all_reduce as on one switch."""
    from netagg.sim.topology_serve import FabricServer
    with FabricServer(2, 2).start() as server:
        described = tmp_path / "fabric.json"
        described.write_text(json.dumps(server.describe()))
        monkeypatch.setenv("NETAGG_FABRIC", str(described))
        torch_runs.torchrun([os.path.join(ROOT, "tests", "torch_job.py"), str(tmp_path),
                             "--only-switch"], url="", nodes=2, per_node=2, logs=tmp_path,
                            what="tests/torch_job.py over a fabric", timeout=JOB_TIMEOUT)
        partials = server.topology.partials()
    for rank in range(4):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (r["local_size"], r["leaf"], r["switch_job"]) == (2, rank // 2, rank % 2)
        for case, got in r["switch_vs_gloo"].items():
            if case.startswith("int32"):
                assert got["equal_to_gloo"] and got["equal_to_exact"], (rank, case)
            else:
                assert got["exact_over_bound"] <= 1.0, (rank, case, got)
            assert got["packets"] > 0, (rank, case, got)
    assert all(p[0] > 0 and p[1] > 0 for p in partials.values()), partials


def test_a_rank_without_a_switch_is_an_error_naming_it(monkeypatch):
    import netagg.host.torch_backend  # noqa: F401
    monkeypatch.delenv("NETAGG_SWITCH", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(Exception, match=r"netagg rank 0: no switch: set NETAGG_SWITCH"):
        dist.init_process_group("netagg", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()


def test_a_single_process_group_routes_by_dtype_and_op(served_switch, monkeypatch):
    from netagg.host.torch_backend import NetaggOptions
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("netagg", store=dist.HashStore(), rank=0, world_size=1,
                            pg_options=NetaggOptions(switch=served_switch, timeout=10.0))
    try:
        pg = dist.group.WORLD
        x = torch.arange(600, dtype=torch.float32).reshape(20, 30).t()   # not contiguous
        expected = x.clone()
        dist.all_reduce(x)
        through_switch = pg.counters().get("packets_sent", 0)
        assert torch.equal(x, expected) and through_switch >= 600 // 255 + 1
        y = torch.arange(10, dtype=torch.float64)
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        assert torch.equal(y, torch.arange(10.))
        assert pg.counters().get("packets_sent", 0) == through_switch       # gloo's
    finally:
        dist.destroy_process_group()


def test_contiguous_tensors_are_written_in_place_without_a_copy(served_switch, monkeypatch):
    """A contiguous tensor's own memory is the worker's `out`: its data_ptr is unchanged and
    no result is copied in (`store_result` is not called); a non-contiguous one is copied.
    1e-12 beside 1e6 is below the block's fixed-point step: 0 in the result shows that the
    result, not the input, is what the tensor holds."""
    from netagg.host import torch_backend
    from netagg.host.torch_backend import NetaggOptions
    copies = []
    store = torch_backend.store_result
    monkeypatch.setattr(torch_backend, "store_result",
                        lambda t, r: copies.append(t.shape) or store(t, r))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("netagg", store=dist.HashStore(), rank=0, world_size=1,
                            pg_options=NetaggOptions(switch=served_switch, timeout=10.0))
    try:
        x = torch.tensor([1e6, 1e-12] * 300, dtype=torch.float32)
        b = torch.tensor([1e6, 1e-12] * 300, dtype=torch.bfloat16)
        pointers = [x.data_ptr(), b.data_ptr()]
        dist.all_reduce(x)
        dist.all_reduce(b, op=dist.ReduceOp.AVG)
        assert [x.data_ptr(), b.data_ptr()] == pointers and copies == []
        for t in (x, b):
            assert (t[0::2] == 1e6).all() and (t[1::2] == 0).all()
        work = dist.all_reduce(x, async_op=True)
        assert work.get_future().wait()[0] is x     # the future's value is the tensor
        m = torch.arange(600, dtype=torch.float32).reshape(20, 30).t()   # not contiguous
        dist.all_reduce(m)
        assert copies == [m.shape]
        assert torch.equal(m, torch.arange(600, dtype=torch.float32).reshape(20, 30).t())
    finally:
        dist.destroy_process_group()


def test_netagg_train_runs_small(tmp_path):
    pytest.importorskip("sklearn", reason="pip install -e .[torch]")
    report = torch_runs.train_runs(workers=2, nodes=2, epochs=1, quiet=True, timeout=120)
    runs = report["runs"]
    assert list(runs) == ["gloo", "netagg", "netagg_drop"]
    for name, r in runs.items():
        assert r["steps"] == 1347 // 2 // 16 and len(r["loss_per_step"]) == r["steps"]
        assert r["replicas_identical"] and 0.1 < r["test_accuracy"] <= 1.0, (name, r)
        assert r["time_per_step"] > 0
    assert runs["gloo"]["bytes_sent_per_worker"]["switch"] == 0
    assert runs["gloo"]["bytes_sent_per_worker"]["tcp"] > 0
    assert runs["netagg"]["bytes_sent_per_worker"]["switch"] > 0
    assert runs["netagg"]["drop_priority"] == 0 < runs["netagg_drop"]["drop_priority"]
    assert 0 < runs["netagg_drop"]["drop_fraction"] <= 0.05
    assert set(report["accuracy_gap_points"]) == {"netagg", "netagg_drop"}
    if _have("matplotlib"):
        torch_runs.plot(report, tmp_path / "loss.png")
        assert (tmp_path / "loss.png").stat().st_size > 10_000


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def test_netagg_train_command_line(monkeypatch, capsys):
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return {"command": "train", "runs": {}}
    monkeypatch.setattr(torch_runs, "train_runs", fake)
    assert main(["train", "--json", "--workers", "2", "--nodes", "1", "--epochs", "3",
                 "--runs", "gloo,netagg_drop", "--loss-budget", "0.1"]) == 0
    assert seen["workers"] == 2 and seen["nodes"] == 1 and seen["epochs"] == 3
    assert seen["loss_budget"] == 0.1 and [r.name for r in seen["runs"]] == ["gloo",
                                                                            "netagg_drop"]
    assert json.loads(capsys.readouterr().out) == {"command": "train", "runs": {}}
    with pytest.raises(SystemExit):
        main(["train", "--runs", "nccl"])


def test_a_gone_rank_fails_the_torch_work():
    """A rank gone in an allreduce (in process: its engine no longer driven) fails the torch
    Work the group's completer waits on: `Work.wait()` raises, naming the rank and the job."""
    import numpy as np

    from netagg.host import numerics as N
    from netagg.host.torch_work import Completer, NetaggWork, Pending
    from tests.host_workers import workers

    ws = workers(2, timeout=20)
    hub = ws[0].transport.driver
    handles = [w.allreduce_async(np.ones(50 * N.LANES, np.int32)) for w in ws]
    while ws[1].engine.stats["packets_sent"] == 0:
        hub.drive()
    hub.engines.remove(ws[1].engine)                # rank 1 is gone
    completer = Completer("netagg rank 0 (job 0)", timeout=20)
    try:
        work = NetaggWork(completer.submit(Pending(torch.futures.Future(), lambda r: r,
                                                   handles[0])))
        with pytest.raises(Exception, match=r"netagg rank 0 \(job 0\): NetaggRankGone: rank 1 "
                                            r"of job 0 is gone"):
            work.wait()
    finally:
        completer.close()
        for w in ws:
            w.close()
