"""End to end: `netagg sim serve` in its own process, worker processes over UDP, as deployed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from netagg.apps.demo import run_workers
from netagg.contract import regmap as R
from netagg.host import NetaggTimeout, Worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def serve(tmp_path, request):
    """`netagg sim serve` with the golden model, or the RTL when the test asks for it."""
    backend = getattr(request, "param", "golden")
    pcap = tmp_path / "switch.pcap"
    proc = subprocess.Popen(
        [sys.executable, "-m", "netagg.apps.cli", "sim", "serve", "--pcap", str(pcap),
         "--backend", backend],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": ROOT, "COLUMNS": "200"})
    line = proc.stdout.readline()       # the RTL may be built first
    assert re.fullmatch(r"udp://127\.[\d.]+:4791\n", line), \
        f"netagg sim serve did not say where it listens: {line!r}"
    url = line.strip()
    yield url, pcap, proc
    proc.terminate()
    proc.wait(10)


@pytest.mark.parametrize("serve,nodes", [("golden", 4), ("golden", 2), ("rtl", 2)],
                         indirect=["serve"])
def test_worker_processes_over_udp(serve, nodes):
    url, pcap, _ = serve
    report = run_workers(url, workers=4, nodes=nodes, values=30_000, steps=3, timeout=30)
    assert report["errors"] == []
    assert report["verified"] and report["results_agree"]
    assert report["packets_sent"] >= 4 * 30_000 // 255 // (4 // nodes)


def test_int32_over_a_lossy_udp_path(serve):
    url, _, _ = serve
    faults = dict(drop=0.05, duplicate=0.05, reorder=0.05, max_delay=0.02, seed=3)
    report = run_workers(url, workers=3, nodes=3, values=20_000, steps=2, dtype="int32",
                         faults=faults, timeout=30)
    assert report["errors"] == [] and report["verified"]
    assert report["retransmissions"] > 0


def test_pcap_is_rocev2(serve):
    url, pcap, proc = serve
    session = uuid.uuid4().hex
    with Worker(0, 1, url, session=session, timeout=10) as w:
        assert np.array_equal(w.allreduce(np.arange(300, dtype=np.int32)), np.arange(300))
    proc.terminate()
    proc.wait(10)
    from scapy.contrib.roce import BTH
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether
    from scapy.utils import rdpcap
    frames = [bytes(p) for p in rdpcap(str(pcap))]
    contributions = [f for f in frames if BTH in Ether(f) and Ether(f)[BTH].opcode == 0x2B]
    assert len(contributions) == 2                 # 300 values: two packets
    for raw in contributions:                      # scapy recomputes the same ICRC
        pkt = Ether(raw)
        del pkt[IP].len, pkt[IP].chksum, pkt[UDP].len, pkt[BTH].icrc
        assert bytes(pkt) == raw


def test_dead_peer_over_udp_is_a_clear_error(serve):
    url, _, _ = serve
    w = Worker(0, 2, url, session=uuid.uuid4().hex, timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(NetaggTimeout, match="peer"):
        w.allreduce(np.ones(5, np.int32))
    assert time.monotonic() - t0 < 5
    w.close()


def test_spraying_over_udp_source_ports(serve):
    """Workers spray over 4 UDP source sockets, which `netagg sim serve` maps to its 4 switch
    ports (its own rx counters, read through the control path, show it), over paths of
    different delays: int32 sums exact, floats bit for bit the single path's, no
    retransmission, no duplicate at the switch."""
    import threading

    from netagg.host import SwitchControl
    from netagg.host import numerics as N

    url, _, _ = serve
    rng = np.random.default_rng(4)
    ints = [rng.integers(-2**24, 2**24, 12 * N.LANES + 1, dtype=np.int32) for _ in range(3)]
    floats = [rng.standard_normal(8 * N.LANES).astype(np.float32) for _ in range(3)]
    ctl = SwitchControl(url)

    def contributions():
        ports = ctl.counters(jobs=[])["ports"]
        return [ports[p]["rx"] - ports[p]["control"] for p in sorted(ports)]

    def run(paths, spray, faults=None):
        session = uuid.uuid4().hex
        ws = [Worker(r, 3, url, session=session, timeout=10, paths=paths, spray=spray,
                     faults=faults) for r in range(3)]
        for w in ws:        # threads start apart: no retransmission for their skew alone
            w.engine.rto_min, w.engine.rto = 0.5, 1.0
        out = [None] * 3

        def one(r):
            out[r] = ws[r].allreduce([ints[r], floats[r]])
        threads = [threading.Thread(target=one, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        counters = [w.counters() for w in ws]
        for w in ws:
            w.close()
        return out, counters

    single, _ = run(1, "round_robin")
    before = contributions()
    for spray in ("round_robin", "least_loaded"):
        got, counters = run(4, spray, faults=dict(path_delay=0.003))
        expected = np.sum([x.astype(np.int64) for x in ints], axis=0)
        for r in got:
            assert np.array_equal(r[0], expected)
            assert np.array_equal(r[1], single[0][1])
        assert all(c.get("retransmissions", 0) == 0 for c in counters)
        assert all(c[f"packets_sent_path{i}"] > 0 for c in counters for i in range(4))
    after = contributions()
    per_port = [a - b for a, b in zip(after, before)]
    least = min(c[f"packets_sent_path{i}"] for c in counters for i in range(4))
    assert all(n >= 3 * least for n in per_port), per_port     # every worker on every port
    assert ctl.counters(jobs=[0])["jobs"][0]["duplicates"] == 0
    ctl.close()


def test_priority_classes_survive_the_udp_path(serve):
    """Priority drop over UDP: the workers' DSCP travels in the IPv4 TOS byte and `netagg sim
    serve` gives it to the switch, whose threshold 0 on class 0 alone makes nulls of exactly
    the droppable packets sent in class 0 (each worker's smallest chunk of each tensor), not
    of those in classes 1..3. With 4 credits for 8 slots, nothing is dropped for credit."""
    import threading

    from netagg.host import SwitchControl
    from netagg.host import numerics as N

    url, _, _ = serve
    ctl = SwitchControl(url)
    ctl.write([(R.drop_threshold(0), 0)])
    rng = np.random.default_rng(6)
    session = uuid.uuid4().hex
    x = [(rng.standard_normal(40 * N.LANES)
          * np.repeat(rng.uniform(0.01, 1.0, 40), N.LANES)).astype(np.float32) for _ in range(3)]
    ws = [Worker(r, 3, url, session=session, timeout=10, slots=8, credits=4) for r in range(3)]
    out, errors = [None] * 3, []

    def one(r):
        try:
            out[r] = ws[r].allreduce(x[r], loss_budget=0.1)     # 4 droppable, classes 0..3
        except Exception as e:          # re-raised below
            errors.append(e)
    threads = [threading.Thread(target=one, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    counters = [w.counters() for w in ws]
    for w in ws:
        w.close()
    assert all(np.array_equal(o, out[0]) for o in out)
    c = ctl.counters(jobs=[0])
    ctl.close()
    dropped = sum(p["drop_priority"] for p in c["ports"].values())
    assert [k["droppable_sent"] for k in counters] == [4, 4, 4]
    assert dropped == sum(k["droppable_sent_class0"] for k in counters) == 3
    assert c["jobs"][0]["drop_credit"] == 0
    assert all(k["max_inflight"] <= 4 for k in counters)
