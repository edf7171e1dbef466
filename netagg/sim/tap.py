"""Linux TAP devices as a simulated board's Ethernet cables, and the host side of each cable.

`open_tap` creates a TAP device (``/dev/net/tun``, ``IFF_TAP | IFF_NO_PI``): every read gives
one Ethernet frame the kernel sends (no preamble, no FCS), every write hands it one. The
device lives as long as the file descriptor. Creating one needs CAP_NET_ADMIN: without it
`open_tap` raises `NeedsNetAdmin`.

`HostSide` configures the kernel's end of each board port's TAP as a NIC cabled to that port,
with iproute2 (``ip``): port 0 gets 192.168.1.1/24; port n > 0 gets 192.168.(n+1).1/24 and
a policy route, so that datagrams sent from that address to the board's IPv4 address leave
through port n's TAP (``ip rule add from 192.168.(n+1).1 table 100+n``, ``ip route add
<board>/32 dev <tap> src 192.168.(n+1).1 table 100+n``), and answers arriving on it are
accepted (reverse-path filtering off: all, default and each TAP). IPv6 is off on the TAPs, so
the kernel sends the board nothing but what is addressed to it and ARP. Leaving the context
deletes the rules and restores the reverse-path settings; the addresses and routes go with
the devices.

`create_netns` and `delete_netns` make and remove a network namespace (``ip netns``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFNAMSIZ = 16
RULE_TABLE_BASE = 100
CONF = Path("/proc/sys/net")


class NeedsNetAdmin(PermissionError):
    """Creating a TAP device, or configuring the network, is not allowed to this process."""


def open_tap(name: str) -> int:
    """A new TAP device `name`: its file descriptor, non-blocking and close-on-exec."""
    if not 0 < len(name.encode()) < IFNAMSIZ:
        raise ValueError(f"a network device name has 1 to {IFNAMSIZ - 1} bytes, not {name!r}")
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise OSError(errno.ENODEV, "no /dev/net/tun: the kernel's TUN/TAP driver is not "
                      "available here") from None
    except PermissionError:
        raise NeedsNetAdmin("opening /dev/net/tun is not permitted") from None
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError as exc:
        os.close(fd)
        if exc.errno == errno.EPERM:
            raise NeedsNetAdmin(f"creating TAP device {name} needs CAP_NET_ADMIN") from None
        if exc.errno == errno.EBUSY:
            raise OSError(exc.errno, f"TAP device {name} is already in use (another "
                          "`netagg sim board`?): choose another with --tap") from None
        raise OSError(exc.errno, f"creating TAP device {name}: {exc.strerror}") from None
    return fd


def ip(*args: str) -> None:
    """Run ``ip args``; a failure raises with the command and what it said."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode:
        said = (result.stderr or result.stdout).strip()
        if "Operation not permitted" in said:
            raise NeedsNetAdmin(f"`ip {' '.join(args)}` is not permitted: {said}")
        raise OSError(f"`ip {' '.join(args)}` failed (exit {result.returncode}): {said}")


@dataclass(frozen=True)
class Cable:
    """The host side of one board port: its TAP, the host's address on it, and the routing
    table that sends datagrams from that address to the board through it (None: the main
    table's connected route does)."""
    port: int
    tap: str
    host_ip: str
    prefix: int
    table: int | None


def cables(taps: list[str]) -> list[Cable]:
    """Port n's cable: 192.168.(n+1).1/24 on taps[n]; a table of its own for n > 0."""
    return [Cable(n, tap, f"192.168.{n + 1}.1", 24, RULE_TABLE_BASE + n if n else None)
            for n, tap in enumerate(taps)]


class HostSide:
    """The kernel's side of the TAPs of a board at `board_ip` (see the module docstring);
    a context manager."""

    def __init__(self, taps: list[str], board_ip: str):
        self.cables = cables(taps)
        self.board_ip = board_ip
        self._rules: list[Cable] = []
        self._saved: dict[Path, str] = {}

    def __enter__(self) -> HostSide:
        try:
            for name in ("all", "default"):
                self._set(CONF / "ipv4" / "conf" / name / "rp_filter", "0", keep=True)
            for cable in self.cables:
                self._set(CONF / "ipv6" / "conf" / cable.tap / "disable_ipv6", "1",
                          missing_ok=True)
                self._set(CONF / "ipv4" / "conf" / cable.tap / "rp_filter", "0")
                ip("addr", "add", f"{cable.host_ip}/{cable.prefix}", "dev", cable.tap)
                ip("link", "set", cable.tap, "up")
                if cable.table is not None:
                    _forget_rule(cable)       # one left by a run that was killed
                    ip("rule", "add", "from", cable.host_ip, "table", str(cable.table))
                    self._rules.append(cable)
                    ip("route", "add", f"{self.board_ip}/32", "dev", cable.tap, "src",
                       cable.host_ip, "table", str(cable.table))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for cable in reversed(self._rules):
            _forget_rule(cable)
        self._rules.clear()
        for path, value in self._saved.items():
            try:
                path.write_text(value)
            except OSError:
                pass
        self._saved.clear()

    def _set(self, path: Path, value: str, keep: bool = False, missing_ok: bool = False):
        try:
            if keep:
                self._saved.setdefault(path, path.read_text().strip())
            path.write_text(value)
        except FileNotFoundError:
            if not missing_ok:
                raise OSError(errno.ENOENT, f"{path} does not exist") from None
        except PermissionError:
            raise NeedsNetAdmin(f"writing {path} is not permitted") from None


def _forget_rule(cable: Cable) -> None:
    """Delete the policy rule of `cable`, if there is one."""
    try:
        ip("rule", "del", "from", cable.host_ip, "table", str(cable.table))
    except OSError:
        pass        # none: nothing to delete


def netns_exists(name: str) -> bool:
    return (Path("/run/netns") / name).exists()


def create_netns(name: str) -> bool:
    """Create network namespace `name` with its loopback up; False if it existed already
    (it is used as it is)."""
    if netns_exists(name):
        ip("-n", name, "link", "set", "lo", "up")
        return False
    ip("netns", "add", name)
    ip("-n", name, "link", "set", "lo", "up")
    return True


def delete_netns(name: str) -> None:
    ip("netns", "del", name)
