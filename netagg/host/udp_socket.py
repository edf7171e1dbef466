"""UDP sockets to a switch: the socket options under which Linux sends the canonical IPv4
header (`IP_MTU_DISCOVER` = `IP_PMTUDISC_DO`: Don't Fragment, identification 0 on a socket
that is not connected), the simulation's cabling (`switch_port_for`: the switch port a UDP
sender's frames enter), and one control request from a socket (`request_on`).
"""

from __future__ import annotations

import random
import select
import socket
import time

from netagg.contract import wire as W

IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)


def switch_port_for(ip: str, udp_port: int, ports: int) -> int:
    """The switch port that frames from (ip, udp_port) enter in a simulation's cabling
    (`netagg sim serve`, in-process workers): (IPv4 address as an integer + UDP port) % ports."""
    return (W.ip_to_int(ip) + udp_port) % ports


def request_on(sock, addr, source: W.Endpoint, switch: W.Endpoint, records,
               tries: int = 5, wait: float = 0.5) -> list[tuple[int, int]]:
    """One control request from `sock` (whose address is `source`) to the switch at `addr`,
    sent up to `tries` times, `wait` seconds apart, until its answer comes back to `sock`:
    the answer's (address, value) records. For a socket no engine reads (a path socket, a
    benchmark's sender); an engine's requests go through its control channel."""
    psn = random.getrandbits(24)
    request = W.control_request(records, psn, source, switch).datagram()
    for _ in range(tries):
        sock.sendto(request, addr)
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            select.select([sock], [], [], left)
            try:
                data, sender = sock.recvfrom(4096)
            except BlockingIOError:
                continue
            try:
                answer = W.parse_transport(data, W.Endpoint(*sender), source)
            except W.WireError:
                continue
            if answer.opcode == W.OP_CONTROL and answer.psn == psn:
                return W.unpack_records(answer.payload)
    raise TimeoutError(f"the switch at {addr[0]}:{addr[1]} did not answer a control request "
                       f"from {source.ip}:{source.port}")
