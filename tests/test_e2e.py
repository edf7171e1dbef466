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

from host import NetaggTimeout, Worker
from host.demo import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def serve(tmp_path, request):
    """`netagg sim serve` with the golden model, or the RTL when the test asks for it."""
    backend = getattr(request, "param", "golden")
    pcap = tmp_path / "switch.pcap"
    proc = subprocess.Popen(
        [sys.executable, "-m", "host.cli", "sim", "serve", "--host", "127.0.0.1", "--port", "0",
         "--pcap", str(pcap), "--backend", backend],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": ROOT, "COLUMNS": "200"})
    url = None
    t0 = time.monotonic()
    while url is None and time.monotonic() - t0 < 900:     # the RTL may be built first
        line = proc.stderr.readline()
        m = re.search(r"udp://[\d.]+:(\d+)", line)
        if m:
            url = f"udp://127.0.0.1:{m.group(1)}"
    assert url, "netagg sim serve did not say where it listens"
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
