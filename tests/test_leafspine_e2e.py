"""Workers across a leaf and spine fabric, end to end: 8 in-process workers over two leaves
and two spines, int32 exact and float32 within the fixed-point bound, with loss at both
levels (the workers' links and the links between switches), with one spine's uplinks marked
down mid-run; `netagg sim serve --topology 2x2` in its own process with 8 UDP workers; the
errors of a fabric's set-up name the rank, the job and the switch."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
import weakref

import numpy as np
import pytest

from netagg.apps.demo_fabric import demo_described, demo_fabric
from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import Worker, liveness
from netagg.host.errors import NetaggError
from netagg.host.fabric import Fabric
from netagg.sim.topology import LinkFaults, Topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _workers(topo, n=8, session=None, **kw):
    session = session or uuid.uuid4().hex
    return [Worker(r, n, None, session=session, fabric=topo, timeout=30, **kw)
            for r in range(n)]


def _allreduce(ws, xs):
    handles = [w.allreduce_async(x) for w, x in zip(ws, xs)]
    return [h.wait(60) for h in handles]


def test_int32_sums_are_exact_over_two_leaves_and_the_spines_share_the_uses():
    topo = Topology(2, 2)
    ws = _workers(topo)
    rng = np.random.default_rng(1)
    xs = [rng.integers(-(1 << 20), 1 << 20, 30_000, dtype=np.int32) for _ in ws]
    for out in _allreduce(ws, xs):
        assert out.dtype == np.int32 and np.array_equal(out, np.sum(xs, axis=0))
    assert [w.placement.leaf for w in ws] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [w.switch_rank for w in ws] == [0, 1, 2, 3, 0, 1, 2, 3]   # ImmDt rank: the leaf's
    completed = {name: topo.control(name, [(R.job_counter(0, "completed"), 0)])[0][1]
                 for name in topo.nodes}
    assert completed["leaf0"] == completed["leaf1"] == \
        completed["spine0"] + completed["spine1"] > 0      # every use once, at one spine
    partials = topo.partials()
    assert partials["leaf0"] == partials["leaf1"]
    assert abs(partials["leaf0"][0] - partials["leaf0"][1]) <= 1       # slots round robin
    for w in ws:
        w.close()


def test_a_second_run_reconfigures_every_switch_and_sums_exactly():
    topo = Topology(2, 2)
    xs = [np.full(3000, r + 1, np.int32) for r in range(8)]
    for run in range(2):                # the second run's message numbers start again at 0
        ws = _workers(topo, session=f"run-{run}")
        for _ in range(3):
            for out in _allreduce(ws, xs):
                assert np.array_equal(out, np.sum(xs, axis=0))
        for w in ws:
            w.close()
    epochs = {name: topo.control(name, [(R.job_reg(0, R.JOB_EPOCH), 0)])[0][1]
              for name in topo.nodes}
    assert len(set(epochs.values())) == 1           # one epoch across the fabric


def test_a_one_switch_run_after_a_fabric_run_on_the_same_leaf_has_no_parent():
    topo = Topology(2, 2)
    xs = [np.full(3000, r + 1, np.int32) for r in range(8)]
    ws = _workers(topo)
    for out in _allreduce(ws, xs):
        assert np.array_equal(out, np.sum(xs, axis=0))
    for w in ws:
        w.close()
    leaf = topo.nodes["leaf0"].switch
    parent = (R.job_reg(0, R.JOB_PARENT), 0)
    assert R.PARENT.unpack(topo.control("leaf0", [parent])[0][1])["enable"]    # the fabric's
    session = uuid.uuid4().hex          # the same job, one switch: the leaf alone
    ws = [Worker(r, 4, leaf, session=session, timeout=10) for r in range(4)]
    for out in _allreduce(ws, xs[:4]):
        assert np.array_equal(out, np.sum(xs[:4], axis=0))
    assert topo.control("leaf0", [parent])[0][1] == 0
    assert leaf.counters()["jobs"][0]["upstream"] == sum(topo.partials()["leaf0"])  # none new
    for w in ws:
        w.close()


def test_a_topology_and_its_hub_go_with_their_last_worker():
    topo = Topology(2, 1)
    ws = _workers(topo, n=4)
    for out in _allreduce(ws, [np.ones(100, np.int32)] * 4):
        assert np.array_equal(out, np.full(100, 4))
    for w in ws:
        w.close()
    gone = weakref.ref(topo)
    del ws, w, topo
    gc.collect()
    assert gone() is None               # no table of hubs holds it


def test_the_demo_reports_a_set_up_error_and_closes_what_it_made():
    report = demo_fabric("2x1", workers=64, values=1000, steps=1, quiet=True, timeout=2)
    assert not report["verified"]
    assert any("at most 63 ranks" in e for e in report["errors"])


def test_float32_is_within_the_fixed_point_bound():
    report = demo_fabric("2x2", workers=8, values=40_000, steps=4,
                         quiet=True)
    assert report["errors"] == [] and report["verified"] and report["results_agree"]
    assert report["max_error"] > 0                     # fixed point, not exact
    assert report["frames_between_switches"] >= 2 * sum(map(sum, report["partials"].values()))


def test_loss_at_both_levels_changes_nothing():
    topo = Topology(2, 2, seed=5,
                    faults=LinkFaults(drop=0.05, duplicate=0.05, reorder=0.1))
    faults = dict(drop=0.05, duplicate=0.05, reorder=0.05, max_delay=0.005, seed=3)
    ws = _workers(topo, faults=faults)
    for w in ws:                        # no waiting out a lost first packet's 0.2 s
        w.engine.rto = w.engine.rto_min
    rng = np.random.default_rng(2)
    xs = [rng.integers(-1000, 1000, 20_000, dtype=np.int32) for _ in ws]
    for out in _allreduce(ws, xs):
        assert np.array_equal(out, np.sum(xs, axis=0))
    assert sum(link.lost for link in topo.link_list) > 0
    assert sum(w.counters()["retransmissions"] for w in ws) > 0
    for w in ws:
        w.close()


def test_one_spine_marked_down_mid_run_still_sums_exactly():
    report = demo_fabric("2x2", workers=8, values=60_000, steps=6, dtype="int32",
                         uplink_down_at=0.5, quiet=True)
    assert report["errors"] == [] and report["verified"]
    assert report["cut_after_tensors"] == 3 and report["cut"]["uses_in_flight"] >= 1
    partials = report["partials"]
    assert all(p[0] > p[1] for p in partials.values())  # spine0 took the rest of the run
    counters = report["fabric_counters"]
    assert counters["leaf0"]["completed"] == counters["leaf1"]["completed"]


def test_a_spine_cut_with_loss_completes_through_pulls():
    report = demo_fabric("2x2", workers=8, values=60_000, steps=6, dtype="int32",
                         uplink_down_at=0.5, quiet=True,
                         faults=LinkFaults(drop=0.05, duplicate=0.02, reorder=0.05))
    assert report["errors"] == [] and report["verified"]


def die(worker):
    """A worker's process gone for good: closed without the closing beat a worker that
    closes sends (`host.liveness`), as a crashed process would."""
    worker.engine.liveness.closing = lambda: None
    worker.close()


def test_a_gone_rank_is_named_by_every_rank_of_every_leaf_within_the_bound():
    from netagg.host.errors import NetaggRankGone
    topo = Topology(2, 2)
    ws = _workers(topo)
    xs = [np.full(1000, r, np.int32) for r in range(8)]
    _allreduce(ws, xs)                  # every rank has beaten in this run
    die(ws[5])                          # rank 1 at leaf1: its process gone for good
    gone_at = time.monotonic()
    handles = {r: w.allreduce_async(xs[r]) for r, w in enumerate(ws) if r != 5}
    named = {}
    for r, h in handles.items():        # leaf0's ranks included: the heartbeats are leaf1's
        with pytest.raises(NetaggRankGone, match=r"rank 5 \(rank 1 at leaf1\) of job 0 gone: "
                                              r"heartbeats in leaf1 still") as e:
            h.wait(10)
        named[r] = time.monotonic() - gone_at
        assert e.value.ranks == (5,) and f"rank {r} (rank {r % 4} at leaf{r // 4})" in str(e.value)
    assert max(named.values()) < liveness.DEAD_AFTER + 2 * liveness.READ_PERIOD + 1.0
    for r, w in enumerate(ws):
        if r != 5:
            w.close()


def test_a_second_run_of_the_same_session_waits_for_its_own_rank_0():
    """The first run's spines stay configured with its epoch; the second run's leaf1 first
    rank comes before its rank 0 and does not take that epoch: it waits for rank 0's."""
    topo = Topology(2, 2)
    xs = [np.full(2000, r + 1, np.int32) for r in range(8)]
    first = _workers(topo, session="same")
    _allreduce(first, xs)
    old = topo.control("spine0", [(R.job_reg(0, R.JOB_EPOCH), 0)])[0][1]
    for w in first:
        w.close()
    early = {}
    thread = threading.Thread(target=lambda: early.update(
        w=Worker(4, 8, None, session="same", fabric=topo, timeout=30)))
    thread.start()
    time.sleep(0.5)                                 # leaf1's first rank reads the old spines
    assert thread.is_alive()                        # and waits
    ws = [Worker(r, 8, None, session="same", fabric=topo, timeout=30) for r in range(4)]
    thread.join(30)
    ws += [early["w"]] + [Worker(r, 8, None, session="same", fabric=topo, timeout=30)
                          for r in range(5, 8)]
    epochs = {name: topo.control(name, [(R.job_reg(0, R.JOB_EPOCH), 0)])[0][1]
              for name in topo.nodes}
    assert len(set(epochs.values())) == 1 and old not in epochs.values()
    for out in _allreduce(ws, xs):
        assert np.array_equal(out, np.sum(xs, axis=0))
    for w in ws:
        w.close()


def test_a_switch_without_uplinks_is_no_leaf():
    from netagg.sim.golden import GoldenSwitch
    from netagg.sim.serve import SimServer
    fabric = Topology(2, 2).describe()
    with SimServer(GoldenSwitch()).start() as plain:
        fabric["leaves"][0]["url"] = plain.url
        with pytest.raises(NetaggError, match=r"rank 0 \(rank 0 at leaf0\): leaf0 .* has 0 "
                                              r"uplinks, the fabric 2 spines: it is not a leaf"):
            Worker(0, 8, plain.url, session="s", fabric=fabric, timeout=2)


def test_set_up_errors_name_the_rank_the_job_and_the_switch():
    topo = Topology(2, 2)
    with pytest.raises(NetaggError, match=r"rank 5 of 8 sits on leaf1 .*not on 'leaf0'"):
        Worker(5, 8, "leaf0", session="s", fabric=topo, timeout=2)
    other = [(R.job_reg(0, R.JOB_SLOT_BASE), 0), (R.job_reg(0, R.JOB_SLOT_COUNT), 4),
             (R.job_reg(0, R.JOB_CONFIG), R.CONFIG.pack(enable=1, workers=2))]
    topo.control("spine1", [(a | R.WRITE, v) for a, v in other])     # someone else's job
    with pytest.raises(NetaggError, match=r"rank 0: job 0 at spine1 is enabled by "
                                          r"10\.250\.255\.254.*; the jobs it had claimed at "
                                          r"spine0 are disabled again"):
        Worker(0, 8, None, session="s", fabric=topo, timeout=2)
    config = {name: topo.control(name, [(R.job_reg(0, R.JOB_CONFIG), 0)])[0][1]
              for name in ("spine0", "spine1")}
    assert config["spine0"] == 0 and config["spine1"] >> 31     # no half-claimed fabric
    with pytest.raises(NetaggError, match=r"rank 4 \(rank 0 at leaf1\): waited 1 s for the "
                                          r"spines: spine0's job 0 was not configured"):
        Worker(4, 8, None, session="s", fabric=topo, timeout=1)


@pytest.mark.parametrize("where, field, value, error", [
    ("leaf", "uplinks", (1, "ip", "10.250.2.9"), r"rank 4 \(rank 0 at leaf1\): leaf1 \(sim://"
     r"leaf1\) holds UPLINK_IP 10\.250\.2\.2 of uplink 1 \(to spine1\), the fabric's "
     r"description 10\.250\.2\.9"),
    ("leaf", "uplinks", (0, "port", 7), r"leaf1 .* holds UPLINK_PORT 0x4 of uplink 0"),
    ("leaf", "uplinks", (0, "udp_port", 0xC000), r"leaf1 .* holds UPLINK_UDP_PORT 0x12b7"),
    ("leaf", "uplinks", (1, "mac", "024e410002ff"), r"holds UPLINK_MAC_LO 0x41000201"),
    ("leaf", "ip", "127.0.0.8", r"rank 4 \(rank 0 at leaf1\): leaf1 \(sim://leaf1\) holds "
     r"REG_IP 10\.250\.1\.2, the fabric's description 127\.0\.0\.8"),
    ("spine", "ip", "127.0.0.9", r"rank 0: spine1 \(sim://spine1\) holds REG_IP 10\.250\.2"
     r"\.2, the fabric's description 127\.0\.0\.9; the jobs it had claimed at spine0"),
])
def test_set_up_compares_the_switches_with_the_description(where, field, value, error):
    topo = Topology(2, 2)
    d = topo.describe()
    if where == "leaf" and field == "uplinks":
        i, key, v = value
        d["leaves"][1]["uplinks"][i][key] = v
        rank = 4
    elif where == "leaf":
        d["leaves"][1]["ip"], rank = value, 4
    else:
        d["spines"][1]["ip"] = value
        rank = 0
    with pytest.raises(NetaggError, match=error):
        Worker(rank, 8, None, session="s", fabric=Fabric.from_dict(d, backend=topo), timeout=2)


@pytest.mark.parametrize("change, error", [
    (lambda d: d["spines"][0].update(uplinks=d["leaves"][0]["uplinks"][:1]),
     r"spine spine0 has uplinks \(to \['spine0'\]\): three-level fabrics are not supported"),
    (lambda d: d["leaves"][1].update(leaf_ports=[0, 1]),
     r"leaf leaf1 has leaf ports \[0, 1\] \(switches under it\): three-level"),
    (lambda d: d["spines"][1].update(ip=d["leaves"][0]["ip"]),
     r"spine1 is both a spine and a leaf \(leaf0, .*\): three-level"),
    (lambda d: d.update(cores=[dict(d["spines"][0], name="core0")]),
     r"two levels, 'leaves' and 'spines', not \['cores'\]: three-level"),
])
def test_a_description_of_more_than_two_levels_is_refused(change, error):
    """A middle level would send a child's final up as an ordinary partial: a description
    of three levels is refused when a worker sets up, before any switch is written."""
    topo = Topology(2, 2)
    d = topo.describe()
    change(d)
    with pytest.raises(NetaggError, match=error):
        Worker(0, 8, None, session="s", fabric=d, timeout=2)
    assert topo.control("spine0", [(R.job_reg(0, R.JOB_CONFIG), 0)])[0][1] == 0   # untouched


def test_a_fabric_of_more_than_63_ranks_is_refused_at_set_up():
    topo = Topology(2, 2)
    with pytest.raises(NetaggError, match=r"rank 3, job 0: a fabric's job holds at most 63 "
                                          r"ranks .*, not 64"):
        Worker(3, 64, None, session="s", fabric=topo, timeout=2)
    assert topo.control("leaf0", [(R.job_reg(0, R.JOB_CONFIG), 0)])[0][1] == 0    # untouched


def _udp_workers(fabric: dict, xs: list, ints: list) -> tuple[dict, list]:
    """8 UDP workers in threads, each naming its leaf's URL: their (float, int) results."""
    session = uuid.uuid4().hex
    outs, errors = {}, []

    def run(rank):
        try:
            leaf = fabric["leaves"][rank // 4]["url"]
            with Worker(rank, 8, leaf, session=session, fabric=fabric, timeout=30) as w:
                outs[rank] = (w.allreduce(xs[rank]), w.allreduce(ints[rank]))
        except Exception as e:
            errors.append(f"rank {rank}: {e}")

    threads = [threading.Thread(target=run, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return outs, errors


def _check_udp_run(fabric: dict):
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(20_000).astype(np.float32) for _ in range(8)]
    ints = [rng.integers(-999, 999, 5_000, dtype=np.int32) for _ in range(8)]
    outs, errors = _udp_workers(fabric, xs, ints)
    assert errors == [] and len(outs) == 8
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for f, i in outs.values():
        assert np.abs(f - exact).max() < 1e-3 and np.array_equal(i, np.sum(ints, axis=0))
        assert np.array_equal(f, outs[0][0])


def test_a_fabric_server_serves_8_udp_workers_one_endpoint_per_switch():
    from netagg.sim.topology_serve import FabricServer
    with FabricServer(2, 2).start() as server:
        fabric = server.describe()
        _check_udp_run(fabric)
        partials = server.topology.partials()
        assert partials["leaf0"][0] > 0 and partials["leaf1"][1] > 0


def test_a_gone_rank_on_leaf1_is_named_by_leaf0s_udp_workers():
    """`sim serve --topology 2x2`'s server, 8 UDP workers in threads: rank 6 (rank 2 at
    leaf1) closes after a first allreduce; the others' next one fails naming it in ~2 s."""
    from netagg.host.errors import NetaggRankGone
    from netagg.sim.topology_serve import FabricServer
    session, gone = uuid.uuid4().hex, 6
    first, closed = threading.Barrier(8), threading.Event()
    errors, named = {}, {}

    def run(rank, fabric):
        leaf = fabric["leaves"][rank // 4]["url"]
        with Worker(rank, 8, leaf, session=session, fabric=fabric, timeout=30) as w:
            x = np.full(4000, rank, np.int32)
            w.allreduce(x)
            first.wait(30)
            if rank == gone:
                die(w)
                closed.set()
                return
            closed.wait(30)
            start = time.monotonic()
            try:
                w.allreduce(x, timeout=20)
            except NetaggRankGone as e:
                named[rank] = (str(e), e.ranks, time.monotonic() - start)
            except Exception as e:
                errors[rank] = repr(e)

    with FabricServer(2, 2).start() as server:
        fabric = server.describe()
        threads = [threading.Thread(target=run, args=(r, fabric)) for r in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert errors == {} and sorted(named) == [0, 1, 2, 3, 4, 5, 7]
    for rank, (text, ranks, after) in named.items():
        assert ranks == (gone,) and "rank 6 (rank 2 at leaf1) of job 0 gone" in text
        assert after < liveness.DEAD_AFTER + 2 * liveness.READ_PERIOD + 1.0, (rank, after)


def test_sim_serve_topology_in_its_own_process_with_8_udp_workers_and_processes(tmp_path):
    describe = tmp_path / "fabric.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "netagg.apps.cli", "sim", "serve", "--topology", "2x2",
         "--describe", str(describe)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": ROOT, "COLUMNS": "200"})
    try:
        fabric = json.loads(proc.stdout.readline())
        assert json.loads(describe.read_text()) == fabric
        urls = [s["url"] for s in fabric["leaves"] + fabric["spines"]]
        assert len(set(urls)) == 4 and all(re.fullmatch(r"udp://127\.[\d.]+:4791", u)
                                           for u in urls)
        assert fabric["leaves"][1]["uplinks"][0]["ip"] == fabric["spines"][0]["ip"]
        _check_udp_run(fabric)
        report = demo_described(str(describe), workers=8, values=30_000, steps=2, quiet=True,
                                timeout=30)         # worker processes, `demo --fabric`
        assert report["errors"] == [] and report["verified"] and report["results_agree"]
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("down", [pytest.param(None, marks=pytest.mark.slow), 0.5],
                         ids=["all-up", "spine1-down-halfway"])
def test_8_workers_through_rtl_leaves_and_spines(capsys, down):
    """`netagg demo --topology 2x2 --backend rtl`: two RTL leaves and two RTL spines (one
    Verilator build per role), 8 workers, verified against numpy; with the last spine's
    links cut halfway as it answers a use it holds (that use in flight) and its uplinks
    marked down, the rest goes through spine 0."""
    from netagg.apps.cli import main
    args = ["demo", "--topology", "2x2", "--workers", "8", "--backend", "rtl",
            "--values", "40000", "--json"]
    assert main(args + (["--uplink-down-at", str(down)] if down else [])) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == []       # (a cut that found no use in flight says so here)
    assert report["verified"] and report["results_agree"] and report["backend"] == "rtl"
    partials, counters = report["partials"], report["fabric_counters"]
    again = {leaf: counters[leaf].get("resends", 0) + counters[leaf].get("pulled", 0)
             for leaf in partials}                  # partials sent again (retransmissions)
    firsts = {leaf: sum(up) - again[leaf] for leaf, up in partials.items()}
    assert firsts["leaf0"] == firsts["leaf1"] == counters["leaf0"]["completed"] > 0
    up = partials["leaf0"]
    if down is None:                                # the slots round robin over the spines
        assert abs(up[0] - up[1]) <= again["leaf0"]
    else:
        assert up[0] > up[1] > 0 and report["cut"]["uses_in_flight"] >= 1


@pytest.mark.slow
def test_16_workers_over_4_leaves_and_4_spines_with_loss_and_two_spines_cut():
    topo = Topology(4, 4, seed=9, faults=LinkFaults(drop=0.03, duplicate=0.03, reorder=0.1))
    ws = _workers(topo, 16, faults=dict(drop=0.02, duplicate=0.02, seed=4))
    rng = np.random.default_rng(4)
    xs = [rng.integers(-1000, 1000, 200_000, dtype=np.int32) for _ in ws]
    pieces = [np.array_split(x, 6) for x in xs]
    handles = [[w.allreduce_async(p) for p in ps] for w, ps in zip(ws, pieces)]
    for step in range(6):
        for r in range(len(ws)):
            assert np.array_equal(handles[r][step].wait(120),
                                  np.sum([ps[step] for ps in pieces], axis=0))
        if step in (1, 3):
            topo.cut(3 if step == 1 else 1)
    partials = topo.partials()
    assert all(p[0] > 0 and p[2] > 0 for p in partials.values())
    for w in ws:
        w.close()


def test_a_spine_of_8_leaves_is_set_up_in_two_requests_and_sums_exactly(monkeypatch):
    from netagg.host.control import ControlChannel
    sizes = []
    send = ControlChannel.request_async

    def counted(self, records, callback, *args, **kwargs):
        sizes.append(len(records))
        return send(self, records, callback, *args, **kwargs)
    monkeypatch.setattr(ControlChannel, "request_async", counted)
    topo = Topology(8, 1, max_workers=8)
    ws = _workers(topo, n=8)
    # the spine's claim: its set-up, 16 + 8 records and 7 x 7 more, in two requests, then
    # the 8 R_Keys and a read
    setup = 16 + 8 + 7 * 7
    at = sizes.index(W.MAX_CONTROL_RECORDS)
    assert sizes[at:at + 3] == [W.MAX_CONTROL_RECORDS, setup - W.MAX_CONTROL_RECORDS, 8 + 1]
    xs = [np.full(500, r + 1, np.int32) for r in range(8)]
    for out in _allreduce(ws, xs):
        assert np.array_equal(out, np.full(500, 36))
    [(_, config)] = topo.control("spine0", [(R.job_reg(0, R.JOB_CONFIG), 0)])
    assert R.CONFIG.unpack(config)["workers"] == 8 and R.CONFIG.unpack(config)["partials"]
    for w in ws:
        w.close()
