"""A board in simulation: its top level in Verilator, each Ethernet port on a Linux TAP device.

    netagg sim board --board colorlight_5a75b        # prints udp://192.168.1.50:4791

`BoardSim` is the board's `bitstreams.top.BoardCore` (`sim.tops.BoardTop`: the same MACs,
ARP responders, frame muxes and switch as its bitstream, with the parameters and addresses
of its `bitstreams.top.Target`) clocked by the C++ loop of ``netagg/sim/cpp/board.cpp``, which
turns each port's GMII into whole Ethernet frames and back (preamble, SFD, padding, FCS)
and reads and writes them on file descriptors. With a TAP device per port (`sim.tap`) the
kernel's own ARP, IPv4 and UDP talk to the board as to one cabled to a NIC: port 0 is
192.168.1.1/24 on the host side, port n is 192.168.(n+1).1/24, and datagrams sent from
that address to the board leave through port n's TAP.

Clocks: ``eth_clk`` runs at 125 MHz and the core at the target's ``core_hz``: the core
clock rises once every ``125 MHz / core_hz`` eth cycles (5 on both boards). The loop clocks
the model only while something is in flight, and for `tail_cycles` after (see there);
idle, it sleeps in poll(). `BoardSim.serve` hands the loop a slice of wall time at a time
(ctypes releases the GIL), so that Python handles signals in between.

Speed: about a million eth cycles a second (1 % of real time), some 25,000 small control
requests a second answered through the TAPs. The model is built once per board and design
and cached (`sim.verilated`): a build takes about half a minute.

`main` is ``netagg sim board``: the board in the current network namespace, or, with
``--netns``, in a namespace of its own that it makes and deletes (``ip netns``).
"""

from __future__ import annotations

import ctypes
import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from netagg.contract.headers import ROCEV2_PORT

from .verilated import (
    ContractError,
    Harness,
    LoadedModel,
    Signals,
    build_library,
    build_seconds,
    check_port,
)

ETH_HZ = 125e6
GMII_PORTS = (("gmii{n}_rx_d", "IN", 8), ("gmii{n}_rx_dv", "IN", 1), ("gmii{n}_rx_er", "IN", 1),
              ("gmii{n}_tx_d", "OUT", 8), ("gmii{n}_tx_en", "OUT", 1),
              ("gmii{n}_tx_er", "OUT", 1), ("rx_crc_errors{n}", "OUT", 32),
              ("arp_replies{n}", "OUT", 32))
# Per-port counters of nb_stats, in its order.
PORT_STATS = ("frames_in", "frames_out", "bad_fcs", "malformed", "write_errors",
              "mac_rx_crc_errors", "arp_replies")
# Per frame on GMII besides its bytes: preamble and SFD, FCS, the gap after it.
WIRE_OVERHEAD = 8 + 4 + 12


def _board_header(signals: Signals, top: str) -> str:
    """netagg_board.h for netagg/sim/cpp/board.cpp, after checking the top's ports."""
    for name in ("clk", "eth_clk", "rst"):
        check_port(signals, top, name, "IN", 1)
    count = 0
    while f"gmii{count}_rx_d" in signals:
        count += 1
    if count == 0:
        raise ContractError(f"top {top!r} has no gmii0_rx_d port: not a board top")
    for n in range(count):
        for pattern, direction, width in GMII_PORTS:
            check_port(signals, top, pattern.format(n=n), direction, width)
    each = " ".join(f"X({n})" for n in range(count))
    return f"#define NETAGG_PORTS {count}\n#define NETAGG_FOR_EACH_PORT(X) {each}\n"


HARNESS = Harness(sources=("board.cpp",), header=_board_header, abi=1,
                  header_name="netagg_board.h")


def build_board(board: str) -> Path:
    """The shared library of `board`'s model, built (about half a minute) if not cached."""
    return build_library("board", HARNESS, board=board)


def clock_ratio(core_hz: float) -> int:
    """eth_clk cycles per core cycle: 125 MHz over `core_hz`, which must divide it."""
    ratio = round(ETH_HZ / core_hz)
    if ratio < 1 or abs(ETH_HZ / ratio - core_hz) > 1:
        raise ValueError(f"a core clock of {core_hz / 1e6:g} MHz is not 125 MHz divided by "
                         "an integer: the model's clocks cannot both be kept exact")
    return ratio


def longest_frame() -> int:
    """The longest frame a board's port carries: what the MACs' buffers hold."""
    from netagg.hw.mac import Mac

    return inspect.signature(Mac).parameters["buffer_bytes"].default


def tail_cycles(ratio: int, width: int) -> int:
    """eth_clk cycles the model runs on after the last byte in or out: four times the longest
    frame's time through the slower of a port's two ends, the wire (a byte a cycle) and the
    core (a `width`-bit beat every `ratio` cycles). A frame goes through at most four
    store-and-forward stages after its last byte is in (the MAC's receive buffer, the
    switch's ingress queue, its egress, the MAC's transmit buffer); the first byte of the
    switch's answer leaves within that time, and from there on the wire keeps the loop
    going."""
    frame = longest_frame()
    return 4 * max(frame + WIRE_OVERHEAD, -(-frame // (width // 8)) * ratio)


def _load(library: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library))
    handle, p = ctypes.c_void_p, ctypes.c_void_p
    sigs = {
        "nb_ports": ([], ctypes.c_int), "nb_port_stats": ([], ctypes.c_int),
        "nb_create": ([ctypes.c_uint, ctypes.c_uint64], handle),
        "nb_destroy": ([handle], None), "nb_reset": ([handle, ctypes.c_uint], None),
        "nb_stats": ([handle, p], None),
        "nb_serve": ([handle, p, ctypes.c_int, ctypes.c_int, p], ctypes.c_int),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    if lib.nb_port_stats() != len(PORT_STATS):
        raise RuntimeError(f"{library}: {lib.nb_port_stats()} counters per port, this module "
                           f"names {len(PORT_STATS)}: a stale build")
    return lib


class BoardSim(LoadedModel):
    """`board`'s model (see the module docstring), built or taken from the cache, and reset.

    `serve` clocks it against one file descriptor per port, each carrying whole Ethernet
    frames without FCS (a TAP device opened with IFF_TAP | IFF_NO_PI, or a SOCK_SEQPACKET
    socket), non-blocking. `counters` reads what went through.
    """

    def __init__(self, board: str):
        from netagg.bitstreams import target
        from netagg.bitstreams.top import WIDTH

        self.board = board
        self.target = target(board)
        self.ratio = clock_ratio(self.target.core_hz)
        self.tail = tail_cycles(self.ratio, WIDTH)
        self.library = build_board(board)
        self._lib = _load(self.library)
        self.ports = self._lib.nb_ports()
        self._stats = (ctypes.c_int64 * (1 + self.ports * len(PORT_STATS)))()
        self._destroy = self._lib.nb_destroy
        self._h = self._lib.nb_create(self.ratio, self.tail)
        self.reset()

    @property
    def url(self) -> str:
        return f"udp://{self.target.ip}:{ROCEV2_PORT}"

    def reset(self, core_cycles: int = 16) -> None:
        """Hold the core's reset for `core_cycles` core cycles; frames queued are dropped and
        the counters start again. The 125 MHz side has no reset, as on the board."""
        self._lib.nb_reset(self._h, core_cycles)

    def serve(self, fds: list[int], max_ms: int = 200) -> None:
        """Serve the ports on `fds` (port i on fds[i]) for up to `max_ms` milliseconds of wall
        time, or until a signal arrives. Raises OSError when an fd fails."""
        if len(fds) != self.ports:
            raise ValueError(f"{self.board} has {self.ports} ports, not {len(fds)}")
        array = (ctypes.c_int * len(fds))(*fds)
        rc = self._lib.nb_serve(self._h, array, len(fds), max_ms, self._stats)
        if rc < 0:
            raise OSError(-rc, f"reading or polling a port's device failed while serving "
                          f"{self.board}: {os.strerror(-rc)}")

    def counters(self) -> dict:
        """{"cycles": eth_clk cycles since the reset, "ports": [{name: count} per port]}:
        frames in (driven into the MAC), frames out (sent by the MAC with a good FCS and
        written), bad FCS and malformed frames out (dropped), write errors, and the core's
        own counts of frames dropped for their FCS and of ARP requests answered."""
        self._lib.nb_stats(self._h, self._stats)
        values = list(self._stats)
        width = len(PORT_STATS)
        return {"cycles": values[0],
                "ports": [dict(zip(PORT_STATS, values[1 + n * width:1 + (n + 1) * width]))
                          for n in range(self.ports)]}


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _mac_text(mac: int) -> str:
    return ":".join(f"{mac >> (8 * k) & 0xFF:02x}" for k in reversed(range(6)))


def _serve_on_taps(board: str, prefix: str) -> int:
    """Open the TAPs, build or load the model, cable the host side, print the board's URL on
    stdout and serve until SIGINT or SIGTERM; then the counters, on stderr."""
    from . import tap as T

    try:
        from netagg.bitstreams import target

        ports = len(target(board).ports)
    except ModuleNotFoundError as exc:
        _say(f"netagg sim board: the board definitions need {exc.name} "
             "(pip install amaranth-boards==0.0.21)")
        return 1
    fds: list[int] = []
    try:
        names = [f"{prefix}{n}" for n in range(ports)]
        for name in names:
            fds.append(T.open_tap(name))
        started = time.monotonic()
        _say(f"netagg sim board: {board}: building or loading its Verilator model "
             "(a build takes a while; it is cached) ...")
        with BoardSim(board) as sim, T.HostSide(names, sim.target.ip) as host:
            _say(f"netagg sim board: {board} ready in {time.monotonic() - started:.1f} s "
                 f"(its model took {build_seconds(sim.library) or 0:.0f} s to build, cached); "
                 f"the board is {sim.target.ip}, MAC {_mac_text(sim.target.mac)}")
            for cable in host.cables:
                route = ("" if cable.table is None else
                         f"; datagrams from {cable.host_ip} to {sim.target.ip} go through "
                         f"{cable.tap} (rule table {cable.table})")
                _say(f"  port {cable.port}: TAP {cable.tap}, host {cable.host_ip}/"
                     f"{cable.prefix}{route}")
            if len(host.cables) > 1:
                _say(f"  a worker on port 1 binds to {host.cables[1].host_ip}; on port 0, to "
                     f"{host.cables[0].host_ip} (or to nothing)")
            print(sim.url, flush=True)
            _serve_until_signalled(sim, fds)
            _report(sim)
        return 0
    except T.NeedsNetAdmin:
        _say("netagg sim board: creating TAP devices needs CAP_NET_ADMIN (run as root)")
        return 2
    except OSError as exc:
        _say(f"netagg sim board: {exc.strerror or exc}")
        return 1
    finally:
        for fd in fds:
            os.close(fd)


def _serve_until_signalled(sim: BoardSim, fds: list[int]) -> None:
    """Serve until SIGINT or SIGTERM. The handlers stay for the rest of the process, so that
    a second signal (``--netns`` forwards the terminal's) does not cut the clean-up short."""
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, frame: stop.append(number))
    while not stop:
        sim.serve(fds, max_ms=200)


def _report(sim: BoardSim) -> None:
    counters = sim.counters()
    cycles = counters["cycles"]
    _say(f"netagg sim board: stopped after {cycles:,} eth cycles ({cycles / ETH_HZ * 1e3:.3f} ms "
         "simulated)")
    for n, port in enumerate(counters["ports"]):
        _say(f"  port {n}: " + ", ".join(f"{name.replace('_', ' ')} {value:,}"
                                         for name, value in port.items()))


def _in_netns(board: str, prefix: str, netns: str) -> int:
    """Run the board in network namespace `netns` (created unless it exists, deleted at the
    end if created here): `main` again, under ``ip netns exec``."""
    from . import tap as T

    try:
        created = T.create_netns(netns)
    except T.NeedsNetAdmin:
        _say("netagg sim board: creating a network namespace needs CAP_SYS_ADMIN "
             "(run as root)")
        return 2
    except OSError as exc:
        _say(f"netagg sim board: {exc}")
        return 1
    _say(f"netagg sim board: network namespace {netns} ({'created' if created else 'existing'})"
         f"; enter it with `ip netns exec {netns} <shell or command>`")
    call = (f"import sys; from netagg.sim.board import main; "
            f"sys.exit(main({board!r}, tap={prefix!r}))")
    command = ["ip", "netns", "exec", netns, sys.executable, "-c", call]
    child = subprocess.Popen(command)

    def forward(number, frame):
        child.send_signal(number)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
        return code if code >= 0 else 128 - code      # killed by a signal: as a shell says
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child.poll() is None:
            child.kill()
            child.wait()
        if created:
            try:
                T.delete_netns(netns)
            except OSError as exc:
                _say(f"netagg sim board: {exc}")


def main(board: str, tap: str = "nagg", netns: str | None = None) -> int:
    """`netagg sim board`: serve `board` on TAP devices `tap`0, `tap`1, ... in this network
    namespace, or in `netns`. Returns the exit code."""
    if netns:
        return _in_netns(board, tap, netns)
    return _serve_on_taps(board, tap)
