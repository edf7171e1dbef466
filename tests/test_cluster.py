"""The emulated cluster (`sim.cluster`): hosts in network namespaces on shaped links, a
bridge, netagg's switch on the rack's port; made and removed by the tests themselves.

Every address these tests send to (10.77.0.x) exists only inside the namespaces they make."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from netagg.apps.bench_cluster import predicted_ratio
from netagg.sim import cluster as C
from netagg.sim import netns
from netagg.sim.cluster_links import Shape, parse_rate, parse_size

root = pytest.mark.skipif(os.geteuid() != 0, reason="the cluster needs root")
pytestmark = pytest.mark.xdist_group("cluster")
SWITCH = "fast"


def _name() -> str:
    return "t" + uuid.uuid4().hex[:8]


def _allreduce(cluster: C.Cluster, library: str, size: int, url: str | None = None,
               timeout: float = 30.0) -> list[subprocess.Popen]:
    hosts = len(cluster.hosts)
    return [cluster.run(h.index, [sys.executable, "-m", "netagg.apps.cluster_allreduce",
                                  library, str(h.index), str(hosts), "--sizes", str(size),
                                  "--repeat", "1", "--switch", url or "",
                                  "--master", f"{cluster.hosts[0].ip}:29500",
                                  "--session", "test", "--timeout", str(timeout)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for h in cluster.hosts]


def _until_sent(cluster: C.Cluster, nbytes: int, timeout: float):
    """Wait until the hosts' links have carried `nbytes` in all."""
    deadline = time.monotonic() + timeout
    while sum(c.tx_bytes for c in cluster.counters()) < nbytes:
        assert time.monotonic() < deadline, f"the hosts sent less than {nbytes} bytes"
        time.sleep(0.05)


def _reports(procs: list[subprocess.Popen], timeout: float = 120.0) -> list[dict]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stderr[-2000:]
        out.append(json.loads(stdout))
    return out


def test_rates_and_sizes_read_as_tc_writes_them():
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("2.5gbit") == 2_500_000_000
    assert parse_size("256kb") == 256 << 10
    with pytest.raises(ValueError, match="rate"):
        parse_rate("100mbps")
    shape = Shape.of("100mbit")
    assert shape.queue == 125_000 and shape.burst == 12_500
    with pytest.raises(ValueError, match="queue"):
        Shape.of("100mbit", "2kb")


def test_the_frames_predict_the_ring_over_netagg():
    # a ring sends 2(N-1)/N of the data each way, netagg all of it once, each in its frames
    assert 1.40 < predicted_ratio(4) < 1.5
    assert 1.63 < predicted_ratio(8) < 1.75
    assert predicted_ratio(8) / predicted_ratio(4) == pytest.approx(1.75 / 1.5)


def test_without_root_one_line_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(C.NeedsRoot, match="needs root"):
        C.Cluster(2, name=_name()).up()


def test_a_bad_name_or_size_is_refused():
    with pytest.raises(ValueError, match="name"):
        C.Cluster(2, name="Bad-Name")
    with pytest.raises(ValueError, match="hosts"):
        C.Cluster(1)


@root
def test_allreduce_through_netagg_and_gloo_over_the_links_then_nothing_is_left():
    name, size = _name(), 1 << 20
    with C.Cluster(3, "100mbit", name=name) as cluster:
        assert set(C.namespaces(name)) == {f"{name}-sw", f"{name}-h0", f"{name}-h1",
                                           f"{name}-h2"}
        url = cluster.serve(SWITCH)
        assert url == "udp://10.77.0.1:4791"
        before = cluster.counters()
        netagg = _reports(_allreduce(cluster, "netagg", size, url))
        middle = cluster.counters()
        gloo = _reports(_allreduce(cluster, "gloo", size))
        after = cluster.counters()
        switch_pid = cluster.switch.pid
        procs = list(cluster.processes)
    for reports in (netagg, gloo):
        assert all(r["sizes"][0]["verified"] for r in reports)
    # netagg: each host sends its data once, in frames, and receives the sum once
    for moved in (m - b for m, b in zip(middle, before)):
        assert 2 * size < moved.tx_bytes < 2 * 1.2 * size     # the checked run, the timed one
        assert 2 * size < moved.rx_bytes < 2 * 1.2 * size
    # the ring: 2(N-1)/N of it each way, over TCP through the bridge
    for moved in (a - m for a, m in zip(after, middle)):
        assert moved.tx_bytes > 2 * 4 / 3 * size
    assert C.namespaces(name) == []
    assert all(p.poll() is not None for p in procs)
    assert not os.path.exists(f"/proc/{switch_pid}")


@root
def test_a_taken_name_is_refused_with_how_to_remove_it():
    name = _name()
    with C.Cluster(2, name=name):
        t0 = time.monotonic()
        with pytest.raises(C.ClusterError, match=f"netagg cluster down --name {name}"):
            C.Cluster(2, name=name).up()
        assert time.monotonic() - t0 < 5
        assert len(C.namespaces(name)) == 3         # the refused one removed nothing
    assert C.namespaces(name) == []


@root
def test_a_killed_worker_and_a_killed_switch_leave_nothing_behind():
    name = _name()
    with C.Cluster(3, "25mbit", name=name) as cluster:
        url = cluster.serve(SWITCH)
        procs = _allreduce(cluster, "netagg", 8 << 20, url, timeout=5.0)
        _until_sent(cluster, 2 << 20, 60.0)
        procs[2].kill()
        cluster.switch.kill()
        for p in procs[:2]:
            p.communicate(timeout=60)
            assert p.returncode != 0       # the survivors fail: their switch is gone
    assert C.namespaces(name) == []


def _failures(procs: list[subprocess.Popen], timeout: float) -> list[tuple[float, str]]:
    """(seconds until it exited, last line of its standard error) of each process, which
    must fail within `timeout` seconds."""
    t0, out = time.monotonic(), []
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode != 0
        out.append((time.monotonic() - t0, (err.strip().splitlines() or [""])[-1]))
    return out


@root
def test_a_switch_that_dies_is_named_by_every_rank_in_seconds():
    name = _name()
    with C.Cluster(3, "25mbit", name=name) as cluster:
        url = cluster.serve(SWITCH)
        procs = _allreduce(cluster, "netagg", 8 << 20, url, timeout=30.0)
        _until_sent(cluster, 2 << 20, 60.0)     # the allreduce under way
        cluster.switch.kill()
        for seconds, said in _failures(procs, 20):
            assert seconds < 8, said        # the worker's timeout is 30 s
            assert "the switch at 10.77.0.1:4791 is gone" in said, said
    assert C.namespaces(name) == []


@root
def test_a_host_whose_link_is_down_is_told_so_at_once():
    name = _name()
    with C.Cluster(2, name=name) as cluster:
        url = cluster.serve(SWITCH)
        cluster.set_link(1, up=False)
        t0 = time.monotonic()
        proc = _allreduce(cluster, "netagg", 1 << 20, url, timeout=30.0)[1]
        [(seconds, said)] = _failures([proc], 20)
        assert time.monotonic() - t0 < 10 and "rank 1 of job 0 cannot reach the switch at " \
            "10.77.0.1:4791" in said and "link down" in said, said


@root
def test_a_killed_maker_is_cleaned_up_by_its_guard():
    name = _name()
    maker = subprocess.Popen(
        [sys.executable, "-c",
         "import time; from netagg.sim.cluster import Cluster; "
         f"c = Cluster(2, name={name!r}); c.up(); c.serve({SWITCH!r}); "
         "print(c.switch.pid, flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        switch_pid = int(maker.stdout.readline())
        assert len(C.namespaces(name)) == 3
        assert switch_pid in netns.pids(f"{name}-sw")
    finally:
        maker.kill()
        maker.wait()
    deadline = time.monotonic() + 15
    while C.namespaces(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert C.namespaces(name) == []
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{switch_pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{switch_pid}")


@root
def test_cluster_up_holds_it_until_ctrl_c_and_down_removes_leftovers():
    name = _name()
    up = subprocess.Popen([sys.executable, "-m", "netagg.apps.cli", "cluster", "up",
                           "--hosts", "2", "--switch", SWITCH, "--name", name],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or "Ctrl-C" not in lines[-1]:
            line = up.stdout.readline()
            assert line, up.stderr.read()
            lines.append(line)
        text = "".join(lines)
        assert "udp://10.77.0.1:4791" in text and f"ip netns exec {name}-h1" in text
        assert len(C.namespaces(name)) == 3
    finally:
        up.send_signal(signal.SIGINT)
        up.communicate(timeout=90)          # (the switch and every namespace go first)
    assert up.returncode == 0
    assert C.namespaces(name) == []
    # what a crash would leave: a namespace of the cluster's name, and a process in it
    from pyroute2 import netns as pyroute_netns
    pyroute_netns.create(f"{name}-h0")
    sleeper = subprocess.Popen(netns.command(f"{name}-h0", ["sleep", "60"]))
    down = subprocess.run([sys.executable, "-m", "netagg.apps.cli", "cluster", "down",
                           "--name", name], capture_output=True, text=True, timeout=30)
    assert down.returncode == 0 and f"{name}-h0" in down.stdout
    assert sleeper.wait(10) != 0
    assert C.namespaces(name) == []
