"""`SimServer`'s datagram path: with a packet socket the kernel queues only the datagrams to the
switch's address and port (once); frames the backend sends from an address this machine
does not have are counted as undeliverable, every one of them; a backend that takes runs is
given one run per sender and length; a frame the backend raises on is counted and the switch
(one, or a fabric's) goes on answering; a fabric server that fails to come up closes its
endpoints."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.contract.headers import Verdict
from netagg.host import udp_offload as U
from netagg.host.udp_socket import IP_MTU_DISCOVER, IP_PMTUDISC_DO, switch_port_for
from netagg.sim import udp, udp_runs
from netagg.sim.codec import decode
from netagg.sim.golden import GoldenSwitch
from netagg.sim.serve import SimServer


def _other_traffic(stop: threading.Event):
    """UDP datagrams between two other sockets of this machine, until `stop`: what a raw
    socket sees until its filter is attached."""
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    while not stop.is_set():
        out.sendto(bytes(64), sink.getsockname())
    sink.close()
    out.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="a packet socket needs CAP_NET_RAW (root)")
def test_only_datagrams_to_the_switch_are_queued_once():
    stop = threading.Event()
    noise = threading.Thread(target=_other_traffic, args=(stop,))
    noise.start()
    try:
        server = SimServer(GoldenSwitch())     # opened while other datagrams fly
    finally:
        stop.set()
        noise.join()
    with server:
        assert server.headers_as_received
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        src, dst = W.Endpoint(*sock.getsockname()), W.Endpoint(*server.address)
        request = W.control_request([(R.REG_MAGIC, 0)], 9, src, dst).datagram()
        sock.sendto(request, server.address)
        sock.sendto(request, (server.bound_ip, W.ROCEV2_PORT + 1))   # another port
        sock.sendto(request, ("127.0.0.1", W.ROCEV2_PORT))           # another address
        time.sleep(0.1)
        queued = []
        while True:
            try:
                queued.append(server.raw.recv(65536))
            except BlockingIOError:
                break
        assert len(queued) == 1                                        # the kernel filtered
        packet, segment = udp.arrival(queued[0])
        assert packet.endswith(request) and segment == 0               # one datagram
        assert packet[16:20] == W.ip_packed(server.bound_ip)
        with pytest.raises(BlockingIOError):                           # no second copy
            server.sock.recv(4096)
        sock.close()


class _Stranger:
    """A backend that answers every frame with one from an address nobody here has."""

    ports = 2

    def __init__(self):
        self.pending = 0

    def send(self, port, frame):
        self.pending += 1

    def run(self):
        src, dst = W.Endpoint("192.0.2.1", 0xC000), W.Endpoint("127.0.0.1", 9)
        frame = W.Packet(W.OP_RESULT, 1, 0, bytes(8), va=0, imm=0, src=src, dst=dst).frame()
        out, self.pending = [(0, frame)] * self.pending, 0
        return out


def test_every_frame_from_an_address_not_here_is_undeliverable():
    with SimServer(_Stranger()) as server:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _ in range(3):
            sock.sendto(b"x", server.address)
            deadline = time.monotonic() + 2
            while not server.poll(0.1) and time.monotonic() < deadline:
                pass
        assert server.stats["undeliverable"] == 3 and server.stats["datagrams_out"] == 0
        assert server.unsendable == {("192.0.2.1", 0xC000)}
        sock.close()


class _Runs:
    """A backend that takes runs and keeps each as (port, its frames)."""

    ports = 4

    def __init__(self):
        self.runs = []

    def send(self, port, frame, fill=0, null=None):
        raise AssertionError("a backend that takes runs is given runs")

    def send_run(self, port, heads, body, size):
        self.runs.append((port, [h + bytes(body[i * size:(i + 1) * size])
                                 for i, h in enumerate(heads)]))

    def run(self):
        return []


def _sender(server: SimServer):
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
    sock.bind(("127.0.0.1", 0))
    src = W.Endpoint(*sock.getsockname())

    def datagram(slot: int, lanes: int) -> bytes:
        return W.contribution(job=0, rank=1, slot=slot, version=0, offset=0,
                              lanes=np.arange(lanes, dtype="<i4").tobytes(), psn=slot, src=src,
                              dst=W.Endpoint(*server.address), msn=slot, key=1).datagram()
    return sock, src, datagram


def _renumbered(datagrams: list[bytes]) -> list[bytes]:
    """Datagrams of a GSO run, each ICRC for its segment's IPv4 identification."""
    return [d[:-W.ICRC_LEN] + (int.from_bytes(d[-W.ICRC_LEN:], "little")
                               ^ int(U.ident_deltas(len(d))[i])).to_bytes(4, "little")
            for i, d in enumerate(datagrams)]


@pytest.mark.parametrize("as_received", [True, False])
def test_a_senders_datagrams_of_one_length_are_one_run(as_received):
    """What waits reaches a backend that takes runs as one run per sender and length: a GSO
    run, single datagrams and the full datagrams of a GSO run with a shorter last one, of one
    sender, one after the other, are one run; the shorter one and another sender's datagram
    are runs of their own. Each frame is the datagram sent with the headers it arrived with
    (its ICRC holds)."""
    if as_received and os.geteuid() != 0:
        pytest.skip("a packet socket needs CAP_NET_RAW (root)")
    backend = _Runs()
    with SimServer(backend, as_received=as_received) as server:
        assert server.headers_as_received == as_received
        a, a_src, a_datagram = _sender(server)
        b, b_src, b_datagram = _sender(server)
        run = _renumbered([a_datagram(s, 64) for s in range(5)])
        singles = [a_datagram(s, 64) for s in range(5, 7)]
        tail = _renumbered([a_datagram(s, 64) for s in range(7, 10)] + [a_datagram(10, 16)])
        for datagrams in (run, singles[:1], singles[1:], tail):
            a.sendmsg([b"".join(datagrams)], [(socket.SOL_UDP, U.UDP_SEGMENT,
                                               struct.pack("=H", len(datagrams[0])))],
                      0, server.address)
        other = b_datagram(0, 64)
        b.sendto(other, server.address)
        time.sleep(0.2)
        assert server.poll(1.0) == 12
        ports = [switch_port_for(s.ip, s.port, server.ports) for s in (a_src, b_src)]
        assert [(port, [f[W.BTH_OFFSET:] for f in frames]) for port, frames in backend.runs] \
            == [(ports[0], run + singles + tail[:3]), (ports[0], tail[3:]), (ports[1], [other])]
        assert all(decode(f)[0] == Verdict.OK for _, frames in backend.runs for f in frames)
        a.close()
        b.close()


def test_the_rest_of_a_window_after_a_full_run_joins_it(monkeypatch):
    """After a GSO run as long as one can be, what its sender sends within `linger` joins
    the run (a worker's window of 64 contributions of 1 KiB leaves as runs of 61 and 3); the
    server does not wait when the rest came with the run, and after a wait that nothing
    ended it does not wait until the traffic pauses; with no linger, what comes later is a
    run of its own."""
    backend = _Runs()
    with SimServer(backend, as_received=False) as server:
        sock, _, datagram = _sender(server)
        window = [datagram(s, 256) for s in range(64)]
        full = U.most_rows(len(window[0]))
        assert full == 61

        def send(datagrams):
            sock.sendmsg([b"".join(_renumbered(datagrams))], [(
                socket.SOL_UDP, U.UDP_SEGMENT, struct.pack("=H", len(datagrams[0])))],
                0, server.address)
        server.reader.linger = 0.0
        send(window[:full])
        assert server.poll(1.0) == full
        send(window[full:])
        assert server.poll(1.0) == 64 - full
        server.reader.linger = 0.5
        send(window[:full])
        later = threading.Timer(0.05, send, (window[full:],))
        later.start()
        assert server.poll(1.0) == 64
        later.join()
        for alone in (False, True):
            send(window[:full])             # the rest there already, or none to come
            if not alone:
                send(window[full:])
            t0 = time.monotonic()
            assert server.poll(1.0) == (full if alone else 64)
            assert (time.monotonic() - t0 >= 0.5) == alone
        monkeypatch.setattr(udp_runs, "IDLE", 0.3)
        send(window[:full])                 # after a wait nothing ended: none for a while
        t0 = time.monotonic()
        assert server.poll(1.0) == full and time.monotonic() - t0 < 0.5
        time.sleep(0.4)                     # until the traffic pauses
        send(window[:full])
        t0 = time.monotonic()
        assert server.poll(1.0) == full and time.monotonic() - t0 >= 0.5
        assert [len(frames) for _, frames in backend.runs] == \
            [full, 64 - full, 64, 64, full, full, full]
        sock.close()


def _hostile(switch, marker: bytes = b"hostile"):
    """`switch` raising on every frame that holds `marker` (a backend's bug a frame finds)."""
    receive = switch.receive

    def raising(port, frame, *args):
        if marker in frame:
            raise ValueError("a field beyond its width")
        return receive(port, frame, *args)
    switch.receive = raising
    return switch


def _poke(url: str, payload: bytes = b"hostile" * 8):
    ip = url.removeprefix("udp://").split(":")[0]
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.sendto(payload, (ip, W.ROCEV2_PORT))
    sock.close()


def _answers_after(server, url: str, errors) -> bool:
    """Whether the switch behind `url` answers a control request after a hostile frame,
    which `errors()` counts once."""
    from netagg.host.control import SwitchControl
    _poke(url)
    deadline = time.monotonic() + 5
    while errors() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    control = SwitchControl(url, timeout=5)
    magic = control.read(R.REG_MAGIC)
    control.transport.close()
    return errors() == 1 and magic == [R.MAGIC] and server._thread.is_alive()


def test_a_frame_the_backend_raises_on_is_counted_and_the_switch_goes_on():
    with SimServer(_hostile(GoldenSwitch())).start() as server:
        assert _answers_after(server, server.url, lambda: server.stats["backend_errors"])


def test_a_frame_a_fabric_switch_raises_on_is_counted_and_the_fabric_goes_on():
    from netagg.sim.topology_serve import FabricServer
    with FabricServer(2, 1) as fabric:
        _hostile(fabric.topology.nodes["spine0"].switch)
        fabric.start()
        assert _answers_after(fabric, fabric.servers["spine0"].url,
                              lambda: fabric.backend_errors)


def test_a_fabric_that_fails_to_come_up_closes_its_endpoints(monkeypatch):
    from netagg.sim import topology_serve
    opened = []

    class Recorded(SimServer):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            opened.append(self)

    def failing(*args, **kw):
        raise RuntimeError("cabling failed")
    monkeypatch.setattr(topology_serve, "SimServer", Recorded)
    monkeypatch.setattr(topology_serve, "Topology", failing)
    with pytest.raises(RuntimeError, match="cabling failed"):
        topology_serve.FabricServer(2, 1)
    assert len(opened) == 3 and all(s.sock.fileno() == -1 for s in opened)
