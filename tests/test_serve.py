"""`SimServer`'s datagram path: with a raw socket the kernel queues only the datagrams to the
switch's address and port (once); frames the backend sends from an address this machine
does not have are counted as undeliverable, every one of them."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from netagg.sim import wire as W
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


@pytest.mark.skipif(os.geteuid() != 0, reason="a raw socket needs CAP_NET_RAW (root)")
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
        request = W.control_request([(W.REG_MAGIC, 0)], 9, src, dst).datagram()
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
        assert len(queued) == 1 and queued[0].endswith(request)       # the kernel filtered
        assert queued[0][16:20] == W.ip_packed(server.bound_ip)
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
