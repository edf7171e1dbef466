"""The fast switch behind `netagg sim serve`, its socket loop compiled.

`FastIo` drives `fast_serve` (`netagg/sim/cpp/fast_io.h`): the C++ reads the server's packet socket
(`udp.arrivals_socket`) a batch at a time, makes each packet the frames the switch sees as
`sim.udp_runs` does (a GSO run cut into the kernel's segments, each entering with its
sender's Ethernet header from the senders' table), takes them through the fast switch's core
and sends the results as runs per destination, all without Python. It hands a packet back
where Python decides: a sender the table does not hold yet (`learn` adds it), anything but a
run of contributions (control requests, malformed packets), a row the core gives the golden
model. `SimServer` takes that packet the Python way (`sim.serve`) and calls `serve` again,
which goes on with the packet after it.

The C++ reads the switch's job table as `FastSwitch` keeps it (refreshed here when stale),
and the destinations' routes (the socket that sends from a result's source, its
destination) from a table built from the result templates each time the job table changes.

A call waits for more (ppoll, the GIL released) up to `WAIT_US` and returns at the latest
after it, so Python's own loop runs about once per `WAIT_US` under load. Cost: one recvmmsg
per batch of up to `RX_BATCH` packets, the core's per row, and one sendmmsg per socket per
batch for every destination's runs.
"""

from __future__ import annotations

import ctypes
import os
import socket

import numpy as np

from netagg.contract import wire as W
from netagg.sim import fast_build, udp
from netagg.sim.fast import FastSwitch
from netagg.sim.fast_build import ROUTE_WORDS, RX_BATCH, SENDER_WORDS, Io, Served

RX_BYTES = (1 << 16) + udp.ARRIVAL_HEAD     # the largest IPv4 packet, after vnet and Ethernet
MOST_SENDERS = 256          # senders in the table; the others' packets are Python's
ARENA_BYTES = 4 << 20       # results held until a batch's are sent
WAIT_US = 2000              # us a call waits for more, and runs at most, before Python's turn
_ADDRESSES = slice(W.IP_OFFSET + 12, W.UDP_OFFSET + 4)     # a frame's IPv4 and UDP addresses


class FastIo:
    """The compiled loop for `switch` on `raw` (the server's packet socket, non-blocking);
    `route(addresses)` gives (source, socket or None, destination) of a frame by its IPv4
    and UDP addresses, as `SimServer._route`, and a source without a socket goes into
    `unsendable` (the server's set)."""

    def __init__(self, switch: FastSwitch, raw: socket.socket, route,
                 unsendable: set[tuple[str, int]]):
        self.switch, self.raw, self.route = switch, raw, route
        self._serve = fast_build.library().fast_serve
        self.rx = np.zeros((RX_BATCH, RX_BYTES), np.uint8)
        self.rx_lengths = np.zeros(RX_BATCH, np.int64)
        self.senders = np.zeros((MOST_SENDERS, len(SENDER_WORDS)), np.int64)
        self.routes = np.full((switch.jobs * switch.max_workers, len(ROUTE_WORDS)), -1,
                              np.int64)
        self.arena = np.zeros(ARENA_BYTES, np.uint8)
        rows = ARENA_BYTES // (W.BTH_OFFSET + W.BTH_LEN)
        self.records = np.zeros((rows, 3), np.int64)
        self.sent = np.zeros((rows, 2), np.int64)
        self.io = Io(raw_fd=raw.fileno(), gso=1, rx=self.rx.ctypes.data, rx_bytes=RX_BYTES,
                     rx_count=RX_BATCH, rx_lengths=self.rx_lengths.ctypes.data,
                     senders=self.senders.ctypes.data, senders_count=0,
                     routes=self.routes.ctypes.data, arena=self.arena.ctypes.data,
                     arena_bytes=ARENA_BYTES, records=self.records.ctypes.data,
                     records_rows=rows, sent=self.sent.ctypes.data, wait_us=WAIT_US)
        self._pointers = ctypes.pointer(switch.core), ctypes.pointer(self.io)
        self._routed = -1               # the job table's generation the routes are for
        self.unsendable = unsendable

    def serve(self) -> Served:
        """Take what comes until nothing does for `WAIT_US`, `WAIT_US` have passed (the
        deadlines' clock and the control path's turn) or a packet is Python's (`handed`);
        every result taken is sent."""
        sw = self.switch
        sw.sync_table()
        if self._routed != sw.generation:
            self._make_routes()
        sw.core.now = sw.now
        compiled = self.io.compiled
        why = Served(self._serve(*self._pointers))
        if self.io.error:           # the packet socket failed (not: nothing waits)
            error, self.io.error = self.io.error, 0
            raise OSError(error, f"reading the switch's packet socket: {os.strerror(error)}")
        if self.io.compiled != compiled:
            sw.paths.compiled += self.io.compiled - compiled
            sw.sync_completed()
        return why

    def handed(self) -> tuple[bytes, int, int]:
        """The packet handed back, its run's segment size (`udp.arrival`), and the row of
        its frames from which it is Python's (-1: the whole packet)."""
        i = self.io.hand_packet
        return *udp.arrival(self.rx[i, :self.rx_lengths[i]].tobytes()), self.io.hand_row

    def learn(self, packet: bytes, eth: bytes, port: int) -> None:
        """Add the sender of `packet` (an IPv4 packet without options) to the table: its
        frames have Ethernet header `eth` and enter switch `port`."""
        n = self.io.senders_count
        if n == MOST_SENDERS or packet[0] != W.IPV4_FIRST_BYTE:
            return
        ip = int.from_bytes(packet[12:16], "big")
        udp_port = int.from_bytes(packet[W.IP_LEN:W.IP_LEN + 2], "big")
        known = self.senders[:n]
        if np.any((known[:, 0] == ip) & (known[:, 1] == udp_port)):
            return
        self.senders[n] = (ip, udp_port, port, int.from_bytes(eth[6:12], "big"))
        self.io.senders_count = n + 1

    def counts(self) -> dict[str, int]:
        """What the loop counted, over every call: datagrams in (those of the packets it
        cut) and out, dropped on a full socket buffer, and those without a socket to send
        from."""
        io = self.io
        return {"datagrams_in": io.datagrams_in, "datagrams_out": io.datagrams_out,
                "dropped": io.dropped, "undeliverable": io.undeliverable}

    def _make_routes(self):
        """Each enabled job's workers' routes, from their result templates."""
        sw = self.switch
        self.routes[:] = -1
        for j, job in enumerate(sw.job):
            for rank in range(job.workers if job.enable else 0):
                head = sw.result_heads[j, rank, _ADDRESSES]
                source, sock, (ip, port) = self.route(head.tobytes())
                if sock is None:
                    self.unsendable.add(source)
                    continue
                self.routes[j * sw.max_workers + rank] = (sock.fileno(), W.ip_to_int(ip), port)
        self._routed = sw.generation
