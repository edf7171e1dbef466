"""The host on a real UDP socket, as a board sees it: the IPv4 header Linux sends is the one
the ICRC covers (checked by scapy on frames captured on loopback), results are taken from the
switch's own UDP source port, datagrams from anywhere else are counted, not taken, and
`netagg sim serve` checks the ICRC over the headers as received, as a board does."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP
from scapy.layers.l2 import Ether

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import SwitchControl, Worker
from netagg.host.transport import UdpTransport
from netagg.sim.golden import GoldenSwitch
from netagg.sim.serve import SimServer
from netagg.sim.udp import attach_filter, datagrams_to

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="capturing on loopback and reading IPv4 "
                                "headers as received need CAP_NET_RAW (root)")


def _capture(dst_ip: str):
    """An AF_PACKET socket on lo and a function returning the next frame to `dst_ip`."""
    sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)     # nothing until bound
    # the kernel keeps only this test's frames: other tests' traffic on lo would fill the
    # socket's buffer and crowd them out
    assert attach_filter(sniffer, datagrams_to(socket.inet_aton(dst_ip), 4791, offset=14))
    sniffer.bind(("lo", 0x0003))           # ETH_P_ALL (Python byte-swaps it here)
    sniffer.settimeout(2.0)
    want = socket.inet_aton(dst_ip)

    def next_frame() -> bytes:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            frame = sniffer.recv(65536)
            if frame[12:14] == b"\x08\x00" and frame[30:34] == want:
                return frame
        raise AssertionError(f"nothing to {dst_ip} seen on lo")
    return sniffer, next_frame


def _icrc_holds(frame: bytes) -> bool:
    """Whether scapy computes, over the frame's own headers, the ICRC the frame carries."""
    sent = Ether(frame)
    again = Ether(frame)
    again[BTH].icrc = None
    return Ether(bytes(again))[BTH].icrc == sent[BTH].icrc


def _contribution(t: UdpTransport) -> W.Packet:
    return W.contribution(job=0, rank=0, slot=1, version=0, offset=0, lanes=bytes(64), psn=7,
                          src=t.local, dst=t.switch, msn=1, key=1)


@needs_root
def test_kernel_sends_the_ipv4_header_the_icrc_covers():
    """scapy, over the IPv4/UDP headers Linux really put on the wire (identification 0, DF),
    finds the ICRC the host computed; a connected socket's headers (an identification from
    its counter) would not carry it."""
    dst = f"127.77.{os.getpid() % 250}.{random.randrange(1, 250)}"     # this test's own
    sniffer, next_frame = _capture(dst)
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)    # no ICMP back
    listener.bind((dst, 4791))
    t = UdpTransport(f"udp://{dst}:4791")
    try:
        for pkt in (_contribution(t), W.control_request([(R.REG_MAGIC, 0)], 3, t.local,
                                                        t.switch)):
            t.send(pkt.datagram())
            frame = next_frame()
            ip = Ether(frame)[IP]
            assert ip.id == 0 and ip.flags.DF
            assert _icrc_holds(frame)
        # the same datagrams from a connected socket: Linux numbers them, the ICRC breaks
        connected = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        connected.bind((t.local.ip, 0))
        connected.connect((dst, 4791))
        src = W.Endpoint(*connected.getsockname())
        pkt = W.contribution(job=0, rank=0, slot=1, version=0, offset=0, lanes=bytes(64),
                             psn=7, src=src, dst=t.switch, msn=1, key=1)
        held = []
        for _ in range(3):
            connected.send(pkt.datagram())
            held.append(_icrc_holds(next_frame()))
        assert not all(held)
        connected.close()
    finally:
        t.close()
        sniffer.close()
        listener.close()


def test_results_come_from_the_switch_udp_port_not_4791():
    """The switch's results leave from REG_UDP_SPORT (here not even the default); a worker
    takes them, and counts a datagram from any other address as stray."""
    with SimServer(GoldenSwitch()).start() as server:
        ctl = SwitchControl(server.url)
        ctl.write([(R.REG_UDP_SPORT, 0xD0D0)])
        ctl.close()
        session = uuid.uuid4().hex
        ws = [Worker(r, 2, server.url, session=session, timeout=10) for r in range(2)]
        assert all(w.transport.result_source.port == 0xD0D0 for w in ws)
        stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        stranger.sendto(b"\x2b" + bytes(80), (ws[0].transport.local.ip,
                                              ws[0].transport.local.port))
        xs = [np.arange(1000, dtype=np.int32) * (r + 1) for r in range(2)]
        with ThreadPoolExecutor(2) as pool:      # each worker drives its own sockets
            outs = list(pool.map(lambda w, x: w.allreduce(x, timeout=20), ws, xs))
        for out in outs:
            assert np.array_equal(out, xs[0] + xs[1])
        assert ws[0].counters()["stray_packets"] == 1
        assert all(w.counters()["packets_received"] >= 4 for w in ws)
        stranger.close()
        for w in ws:
            w.close()


@needs_root
@pytest.mark.parametrize("as_received", [True, False])
def test_sim_serve_checks_the_icrc_over_the_header_as_received(as_received):
    """A request from a connected socket (an IPv4 identification the ICRC was not computed
    over) is dropped as BAD_ICRC when the server sees the headers as received, as a board
    does; with canonical headers it cannot tell. The unconnected one is answered either way."""
    with SimServer(GoldenSwitch(), as_received=as_received).start() as server:
        assert server.headers_as_received == as_received
        connected = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        connected.connect(server.address)
        connected.settimeout(0.5)
        src = W.Endpoint(*connected.getsockname())
        dst = W.Endpoint(*server.address)
        answered = 0
        for psn in range(3):
            request = W.control_request([(R.REG_PORT, 0)], psn, src, dst)
            connected.send(request.datagram())
            try:
                connected.recv(2048)
                answered += 1
            except TimeoutError:
                pass
        connected.close()
        ctl = SwitchControl(server.url)
        drops = sum(c["drop_bad_icrc"] for c in ctl.counters(jobs=[])["ports"].values())
        ctl.close()
        if as_received:
            assert answered < 3 and drops == 3 - answered
        else:
            assert answered == 3 and drops == 0


@pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark is not installed")
def test_wireshark_dissects_control_and_results(tmp_path):
    """Control packets dissect as UC SEND Only to the control QP (not as GSI management
    datagrams); results, from the switch's UDP source port, with one Decode As rule."""
    pcap = tmp_path / "switch.pcap"
    with SimServer(GoldenSwitch(), pcap=str(pcap)).start() as server:
        session = uuid.uuid4().hex
        ws = [Worker(r, 2, server.url, session=session, timeout=10) for r in range(2)]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda w: w.allreduce(np.ones(300, np.int32), timeout=20), ws))
    # 300 values: 2 packets per worker, each answered to both workers
        for w in ws:
            w.close()

    def fields(*extra):
        out = subprocess.run(["tshark", "-r", str(pcap), *extra, "-T", "fields", "-e",
                              "infiniband.bth.opcode", "-e", "infiniband.bth.destqp",
                              "-e", "udp.srcport"], capture_output=True, text=True, check=True)
        return [line.split("\t") for line in out.stdout.splitlines()]
    plain = fields()
    control = [f for f in plain if f[0] == str(W.OP_CONTROL)]
    assert control and all(int(f[1], 16) == W.CONTROL_QPN for f in control)
    assert not any(f[0] == str(W.OP_RESULT) and f[2] == "49152" for f in plain)
    decoded = fields("-d", "udp.port==49152,infiniband")
    results = [f for f in decoded if f[2] == "49152"]
    assert len(results) == 2 * 2 and all(f[0] == str(W.OP_RESULT) for f in results)


def test_allreduce_async_over_udp_completes_while_the_caller_computes():
    """Background progress: both workers' allreduces complete while this thread only sleeps
    (before any `wait`), and `wait` then returns the sums."""
    with SimServer(GoldenSwitch()).start() as server:
        session = uuid.uuid4().hex
        ws = [Worker(r, 2, server.url, session=session, timeout=10) for r in range(2)]
        xs = [np.arange(3000, dtype=np.int32) * (r + 1) for r in range(2)]
        handles = [w.allreduce_async(x) for w, x in zip(ws, xs)]
        def finished():     # without Handle.done(), which would drive the engine itself
            return all(work.done for h in handles for work in h.works)
        deadline = time.monotonic() + 10
        while not finished() and time.monotonic() < deadline:
            time.sleep(0.01)            # the caller's compute
        assert finished()
        for h in handles:
            assert np.array_equal(h.wait(), xs[0] + xs[1])
        for w in ws:
            w.close()
