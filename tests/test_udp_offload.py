"""Runs of datagrams through the kernel's UDP segmentation and receive offloads
(`netagg.host.udp_offload`): each segment's ICRC holds, by scapy, for the IPv4 identification the
kernel gives it; a run seen whole on loopback is cut as the kernel cuts it; a worker's runs
through `netagg sim serve` reach the switch with no ICRC drop, whether it reads the headers
as received or builds the canonical ones."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from netagg.contract import wire as W
from netagg.contract.wire_icrc import IcrcCheck
from netagg.host import SwitchControl, Worker
from netagg.host import udp_offload as U
from netagg.host.numerics import LANES as N_LANES
from netagg.host.udp_socket import IP_MTU_DISCOVER, IP_PMTUDISC_DO
from netagg.sim.golden import GoldenSwitch
from netagg.sim.serve import SimServer

SRC = W.Endpoint("10.1.0.2", 40000, 0x020000000002)
DST = W.Endpoint("10.1.0.1", W.ROCEV2_PORT, 0x020000000001)


def _contribution(slot: int) -> bytes:
    lanes = np.arange(slot, slot + 64, dtype="<i4").tobytes()
    return W.contribution(job=0, rank=1, slot=slot, version=0, offset=0, lanes=lanes,
                          psn=slot, src=SRC, dst=DST, msn=slot, key=1).datagram()


def _scapy_icrc(frame: bytes) -> int:
    again = Ether(frame)
    again[BTH].icrc = None
    return Ether(bytes(again))[BTH].icrc


@pytest.mark.parametrize("ident", [1, 2, 31, 63])
def test_the_icrc_of_segment_i_is_scapys_for_identification_i(ident):
    datagram = bytearray(_contribution(3))
    word = np.frombuffer(datagram, "<u4")
    delta = U.ident_deltas(len(datagram))[ident]
    renumbered = bytes(datagram[:-4]) + (int(word[-1]) ^ int(delta)).to_bytes(4, "little")
    frame = W.wrap_datagram(SRC, DST, renumbered)
    frame = frame[:W.IP_OFFSET] + U.renumbered(frame[W.IP_OFFSET:], ident, len(renumbered)) \
        + renumbered
    packet = Ether(frame)
    assert packet[IP].id == ident and packet[IP].flags == "DF"
    assert packet[BTH].icrc == _scapy_icrc(frame)
    # and the datagram as given keeps its ICRC for identification 0
    assert Ether(W.wrap_datagram(SRC, DST, bytes(datagram)))[BTH].icrc == \
        _scapy_icrc(W.wrap_datagram(SRC, DST, bytes(datagram)))


def test_a_run_seen_whole_is_cut_into_the_kernels_segments():
    """A run seen whole (its segment size from the kernel), cut: each segment with the IPv4
    and UDP headers the kernel gives it (identification, lengths, checksum)."""
    run = [_contribution(s) for s in range(5)]
    size = len(run[0])
    whole = W.ip_udp_header(SRC.ip, DST.ip, SRC.port, DST.port, size * 5)
    body = b"".join(run)
    packets = [head + body[at:at + size] for head, at in
               zip(U.segment_headers(whole, size, len(body)), range(0, len(body), size))]
    assert len(packets) == 5
    for i, packet in enumerate(packets):
        ip = IP(packet)
        assert ip.id == i and ip.len == W.IP_LEN + W.UDP_LEN + size
        assert ip[UDP].len == W.UDP_LEN + size and bytes(ip[UDP].payload) == run[i]
        again = IP(packet)
        del again.chksum
        assert IP(bytes(again)).chksum == ip.chksum


def test_gro_hands_a_run_whole_and_segments_cuts_it():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    tx.bind(("127.0.0.1", 0))
    tx.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)     # DF
    rx.settimeout(2.0)
    if not U.enable_gro(rx):
        pytest.skip("this kernel has no UDP_GRO")
    run = [_contribution(s) for s in range(7)]
    sender = U.GsoSender(rx.getsockname())
    sender.send(tx, run)
    assert sender.runs == 1
    got = []
    deadline = time.monotonic() + 2
    while len(got) < 7 and time.monotonic() < deadline:
        data, anc, _, _ = rx.recvmsg(65536, U.gro_ancillary())
        got += [bytes(d) for d in U.segments(data, U.segment_size(anc))]
    rx.close()
    tx.close()
    assert len(got) == 7 and [g[:-4] for g in got] == [r[:-4] for r in run]
    deltas = U.ident_deltas(len(run[0]))
    for i, (g, r) in enumerate(zip(got, run)):
        assert int.from_bytes(g[-4:], "little") == int.from_bytes(r[-4:], "little") ^ deltas[i]


@pytest.mark.parametrize("as_received", [True, False])
def test_a_workers_runs_reach_the_switch_with_no_icrc_drop(as_received):
    if as_received and os.geteuid() != 0:
        pytest.skip("reading IPv4 headers as received needs CAP_NET_RAW (root)")
    with SimServer(GoldenSwitch(), as_received=as_received).start() as server:
        assert server.headers_as_received == as_received
        x = np.arange(200_000, dtype=np.int32) % 1000 - 500
        with Worker(0, 1, server.url, session="runs", timeout=10) as w:
            out = w.allreduce(x)
            counters = w.counters()
        ctl = SwitchControl(server.url)
        ports = ctl.counters(jobs=[])["ports"].values()
        ctl.close()
    np.testing.assert_array_equal(out, x)
    assert counters["gso_runs"] > 0 and counters.get("retransmissions", 0) == 0
    assert counters["bad_packets"] == 0
    assert sum(p["drop_bad_icrc"] for p in ports) == 0


def test_netagg_gso_0_sends_one_datagram_a_call(monkeypatch):
    monkeypatch.setenv("NETAGG_GSO", "0")
    with SimServer(GoldenSwitch(), as_received=False).start() as server:
        x = np.arange(50_000, dtype=np.int32)
        with Worker(0, 1, server.url, session="singly", timeout=10) as w:
            out = w.allreduce(x)
            counters = w.counters()
    np.testing.assert_array_equal(out, x)
    assert counters["gso_runs"] == 0 and counters["packets_sent"] >= 50_000 // N_LANES


def test_a_gro_run_keeps_the_datagrams_whose_icrc_holds_and_counts_the_others():
    """As a worker checks the results a switch sent: the ICRC over the canonical headers
    from the sender to the receiver, whole runs as an array, others one at a time."""
    sender = (DST.ip, 49152)
    receiver = IcrcCheck(SRC)
    results = [W.contribution(job=0, rank=1, slot=s, version=0, offset=0,
                              lanes=np.arange(64, dtype="<i4").tobytes(), psn=s,
                              src=W.Endpoint(*sender), dst=SRC, msn=s, key=1).datagram()
               for s in range(5)]
    corrupted = bytearray(results[2])
    corrupted[40] ^= 1
    run = b"".join(results[:2]) + bytes(corrupted) + b"".join(results[3:])
    good, bad = receiver.run(run, len(results[0]), sender)
    assert [bytes(d) for d in good] == results[:2] + results[3:] and bad == 1
    # a run whose last datagram is shorter (checked one at a time)
    short = results[4][:-8]
    good, bad = receiver.run(b"".join(results[:4]) + short, len(results[0]), sender)
    assert [bytes(d) for d in good] == results[:4] and bad == 1


def test_a_run_the_kernel_refuses_to_segment_leaves_one_by_one_with_the_icrcs_given():
    """Where GSO fails (EINVAL: no GSO on this route), the run's datagrams go one a call,
    each with its ICRC for identification 0, not the ones rewritten for the segments."""
    import errno

    class NoGso:
        def __init__(self):
            self.sent = []

        def sendmsg(self, *args):
            raise OSError(errno.EINVAL, "no GSO")

        def sendto(self, datagram, addr):
            self.sent.append(bytes(datagram))

    datagrams = [_contribution(slot) for slot in range(5)]
    sock, sender = NoGso(), U.GsoSender(("10.1.0.1", W.ROCEV2_PORT), renumber=True)
    sender.send(sock, datagrams)
    assert sock.sent == datagrams and not sender.gso
