"""This host's network interfaces, as a worker needs them to fill its job-table entry.

A worker sends from one IPv4 address of one interface (its NIC, the one cabled towards the
switch); the switch addresses its results to that interface's MAC. `interface_of(ip)` names
the interface holding an address and its MAC (0 for loopback, which has none);
`neighbour_mac(ip)` reads the kernel's neighbour (ARP) table, where the switch's MAC is once
the kernel has exchanged a datagram with it; `candidate_addresses()` lists the addresses a
host may send from (up interfaces, loopback last).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket

import psutil


@dataclasses.dataclass(frozen=True)
class Interface:
    name: str
    ip: str
    mac: int            # 0 where the interface has none (loopback, TUN)
    up: bool
    loopback: bool


def interfaces() -> list[Interface]:
    """Every IPv4 address of this host (in its network namespace), with its interface."""
    stats = psutil.net_if_stats()
    out = []
    for name, addrs in psutil.net_if_addrs().items():
        mac = 0
        for a in addrs:
            if a.family == psutil.AF_LINK and a.address:
                mac = int(a.address.replace(":", "").replace("-", "") or "0", 16)
        st = stats.get(name)
        for a in addrs:
            if a.family == socket.AF_INET:
                out.append(Interface(name, a.address, mac, bool(st and st.isup),
                                     ipaddress.IPv4Address(a.address).is_loopback))
    return out


def interface_of(ip: str) -> Interface | None:
    """The interface that holds `ip`, or None (an address of no interface here)."""
    for itf in interfaces():
        if itf.ip == ip:
            return itf
    if ipaddress.IPv4Address(ip).is_loopback:   # all of 127/8 is lo's
        return Interface("lo", ip, 0, True, True)
    return None


def candidate_addresses(loopback: bool) -> list[str]:
    """The addresses a worker may send from: those of up interfaces, the loopback ones only
    when `loopback` (a switch on loopback is reached from nowhere else)."""
    return [i.ip for i in interfaces() if i.up and i.loopback == loopback]


def neighbour_mac(ip: str) -> int:
    """The MAC the kernel's neighbour table holds for `ip` (0 if none: loopback, or not
    resolved). Linux only; elsewhere 0."""
    try:
        with open("/proc/net/arp") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return 0
    for line in lines:
        fields = line.split()
        if len(fields) >= 4 and fields[0] == ip and int(fields[2], 16) & 0x2:   # ATF_COM
            return int(fields[3].replace(":", ""), 16)
    return 0
