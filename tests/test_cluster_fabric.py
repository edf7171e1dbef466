"""The emulated leaf and spine fabric (`sim.cluster_fabric`): leaves and spines as routing
namespaces, ECMP hashing a flow onto one spine, netagg's packets sprayed over every spine, a
spine cut mid-run; made and removed by the tests themselves.

Every address these tests send to (10.76-10.79.x.x) exists only inside the namespaces they
make."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from netagg.apps.bench_fabric import _imbalance
from netagg.contract import wire as W
from netagg.sim import cluster as C
from netagg.sim.cluster_fabric import FabricCluster, Topology
from netagg.sim.cluster_spray import SLOT_SHIFT

root = pytest.mark.skipif(os.geteuid() != 0, reason="the fabric needs root")
pytestmark = pytest.mark.xdist_group("cluster")


def _name() -> str:
    return "f" + uuid.uuid4().hex[:8]


def _allreduce(fabric: FabricCluster, url: str, size: int, rounds: int, paths: int,
               session: str) -> list[subprocess.Popen]:
    n = len(fabric.hosts)
    return [fabric.run(h.index, [sys.executable, "-m", "netagg.apps.cluster_allreduce",
                                 "netagg", str(h.index), str(n), "--sizes", str(size),
                                 "--repeat", str(rounds), "--switch", url, "--session", session,
                                 "--paths", str(paths), "--timeout", "30"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for h in fabric.hosts]


def _verified(procs: list[subprocess.Popen]) -> list[dict]:
    import json
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-2000:]
        report = json.loads(stdout)
        assert all(s["verified"] for s in report["sizes"])
        out.append(report)
    return out


def _up_bytes(fabric: FabricCluster, before) -> list[list[int]]:
    return [[(a - b).tx_bytes for a, b in zip(now, then)]
            for now, then in zip(fabric.uplinks(), before)]


def test_a_topology_reads_leaves_by_spines():
    t = Topology.parse("3x2", 4)
    assert (t.leaves, t.spines, t.hosts_per_leaf) == (3, 2, 4)
    for bad in ("3", "ax2", "2x2x2"):
        with pytest.raises(ValueError, match="LEAVESxSPINES"):
            Topology.parse(bad, 2)
    with pytest.raises(ValueError, match="leaves"):
        Topology(0, 2, 2)


def test_uplinks_are_oversubscribed_and_the_slot_is_where_the_wire_has_it():
    f = FabricCluster(Topology(2, 2, 4), "100mbit", name=_name(), oversubscription=2)
    assert f.uplink_shape.rate == 100_000_000       # 4 x 100 Mb/s over 2 spines, halved
    assert f.switch_shape.rate == 200_000_000       # a spine's two uplinks
    assert [f.leaf_of(i) for i in range(8)] == [0] * 4 + [1] * 4
    assert f.hosts[5].ip == "10.78.1.11"
    # the u32 keys find the slot in a contribution's and a result's ImmDt
    for slot in (0, 37, 4095):
        imm = W.pack_imm(W.REQUEST_IMM, job=3, rank=5, slot=slot, exponent=-2)
        assert (imm >> SLOT_SHIFT["request"]) & 0xFFF == slot
        imm = W.pack_imm(W.RESULT_IMM, job=3, count=4, slot=slot, exponent=7)
        assert (imm >> SLOT_SHIFT["result"]) & 0xFFF == slot


@root
def test_ecmp_keeps_a_flow_on_one_spine_and_spraying_spreads_it_then_nothing_is_left():
    name, size = _name(), 1 << 20
    with FabricCluster(Topology(2, 2, 1), "100mbit", name=name) as fabric:
        assert set(C.namespaces(name)) == {f"{name}-{n}" for n in
                                           ("sw", "h0", "h1", "l0", "l1", "s0", "s1")}
        url = fabric.serve("fast")
        assert url == "udp://10.76.0.1:4791"
        before = fabric.uplinks()
        _verified(_allreduce(fabric, url, size, 1, 1, "ecmp"))
        hashed = _up_bytes(fabric, before)
        fabric.spray(True)
        before = fabric.uplinks()
        _verified(_allreduce(fabric, url, size, 1, 2, "spray"))
        sprayed = _up_bytes(fabric, before)
        procs = list(fabric.processes)
    # each leaf's one host: its packets one flow, hashed onto one spine
    for links in hashed:
        assert max(links) > 0.97 * sum(links) and sum(links) > 2 * size
    # sprayed by slot: every uplink carries its share
    assert _imbalance(sprayed) < 0.05
    assert all(min(links) > 0.45 * sum(links) for links in sprayed)
    assert C.namespaces(name) == []
    assert all(p.poll() is not None for p in procs)


@root
def test_a_spine_cut_mid_run_leaves_every_sum_exact():
    """Spraying on, the last spine's links cut once the hosts sent a round and a half: the
    rounds complete on the other spine, every result exact; nothing crosses the cut one."""
    name, size, rounds = _name(), 2 << 20, 3
    with FabricCluster(Topology(2, 2, 1), "100mbit", name=name, spray=True) as fabric:
        url = fabric.serve("fast")
        start = sum(c.tx_bytes for c in fabric.counters())
        procs = _allreduce(fabric, url, size, rounds, 2, "cut")
        cut = threading.Event()

        def cut_when_sent():
            deadline = time.monotonic() + 60
            while sum(c.tx_bytes for c in fabric.counters()) - start < 2.5 * 2 * size:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)
            fabric.cut_spine(1)
            cut.set()

        watcher = threading.Thread(target=cut_when_sent)
        watcher.start()
        watcher.join(90)
        assert cut.is_set(), "the hosts never sent a round and a half"
        after_cut = fabric.uplinks()
        reports = _verified(procs)
        since = [[(a - b).tx_bytes for a, b in zip(now, then)]
                 for now, then in zip(fabric.uplinks(), after_cut)]
    assert all(links[1] == 0 and links[0] > 0 for links in since), since
    assert sum(r["sizes"][0]["retransmissions"] for r in reports) > 0
    assert C.namespaces(name) == []


_SEND = """
import socket, sys
for tos in (0x80, 0x00):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    for _ in range(30):
        s.sendto(bytes(200), (sys.argv[1], 9))
"""


@root
def test_dscp_picks_a_ports_class_the_switch_is_trusted_and_another_job_runs_and_goes():
    """On a fabric whose ports honour DSCP: of 30 datagrams with TOS 0x80 (class 4) and 30
    with TOS 0 a host sends, its NIC's high class sends exactly the first 30; netagg's
    results (DSCP 0, from the switch's address) reach a host through its leaf port's high
    class; another job's long flows and incast carry bytes between the hosts they name and
    leave no process behind."""
    from pyroute2 import NetNS

    from netagg.sim.cluster_classes import class_counters
    from netagg.sim.cross_traffic import CrossTraffic

    def counts(namespace, device):
        with NetNS(namespace) as ns:
            return class_counters(ns, ns.link_lookup(ifname=device)[0])

    with FabricCluster(Topology(2, 1, 2), "200mbit", name=_name(), spray=False,
                       classes=True) as fabric:
        h0 = fabric.hosts[0]
        before = counts(h0.namespace, "eth0")
        sender = fabric.run(0, [sys.executable, "-c", _SEND, fabric.hosts[2].ip])
        assert sender.wait(30) == 0
        after = counts(h0.namespace, "eth0")
        assert after["high"].packets - before["high"].packets == 30
        assert after["low"].packets - before["low"].packets >= 30

        url = fabric.serve("fast")
        port = fabric.port(h0)
        before = counts(*port)
        _verified(_allreduce(fabric, url, 64 << 10, 1, 1, "classes"))
        after = counts(*port)
        results = after["high"].packets - before["high"].packets
        assert results >= 2 * (64 << 10) // W.MAX_PAYLOAD        # two allreduces' results

        other = CrossTraffic.across(fabric, hosts_per_leaf=2)
        with other:
            time.sleep(1.5)
            processes = other.senders + list(other.sinks.values())
            moved = other.stop()
        assert moved["goodput_bps"] > 0
        for a, b in other.flows:
            assert moved["bytes"][fabric.hosts[b].ip].get(fabric.hosts[a].ip, 0) > 0
        into = fabric.hosts[other.incast.into].ip
        assert len(moved["bytes"][into]) == len(fabric.hosts) - 1     # every other host
        assert all(p.poll() is not None for p in processes)
