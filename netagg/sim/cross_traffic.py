"""Another job's traffic on the emulated cluster: long TCP flows and an incast, sharing the
hosts' links and the fabric's uplinks with netagg.

- **Long flows** (`flows`, pairs of host indices): a TCP connection from one host to another
  that sends as fast as TCP lets it, for the whole run (a bulk transfer: a checkpoint, a
  dataset's shard).
- **Incast** (`incast`, one host, from every other host): every `period` seconds each other
  host sends `burst` bytes at once to it, on a connection of its own (a parameter server's
  or a storage client's fan-in), so they meet at its link.

`CrossTraffic(cluster, flows, incast=...)` starts a receiver (`sink`) on each host that
receives, then the senders (`send`), and returns once every sink listens and every sender is
connected (each says so in a line), so traffic flows from then on; `stop()` ends them and
returns the bytes each receiver took from each sender, and the goodput. Every process runs
inside the cluster's own namespaces (`Cluster.run`), to the hosts' 10.x addresses; its TCP is
Linux's (cubic), DSCP 0.

Run by hand: ``python -m netagg.sim.cross_traffic sink PORT`` prints, when it is ended
(SIGTERM), one JSON object of bytes received per sender address; ``python -m
netagg.sim.cross_traffic send HOST PORT [--burst BYTES --period SECONDS]`` sends until ended:
without a burst, continuously.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import select
import selectors
import signal
import socket
import subprocess
import sys
import time

PORT = 5301
CHUNK = 64 << 10
LISTENING, CONNECTED = "listening", "connected"     # each process's line once it is ready
READY_TIMEOUT = 30.0


@dataclasses.dataclass(frozen=True)
class Incast:
    """Every `period` seconds, every other host sends `burst` bytes to host `into`."""

    into: int
    burst: int = 256 << 10
    period: float = 0.5


class CrossTraffic:
    """Long flows `flows` ((from, to) host indices) and an `incast`, on `cluster`'s hosts,
    from entering (or `start`) to `stop`."""

    def __init__(self, cluster, flows: list[tuple[int, int]], incast: Incast | None = None):
        hosts = len(cluster.hosts)
        for a, b in flows + ([(0, incast.into)] if incast else []):
            if not (0 <= a < hosts and 0 <= b < hosts):
                raise ValueError(f"cross traffic between hosts {a} and {b}: the cluster has "
                                 f"hosts 0 to {hosts - 1}")
        self.cluster, self.flows, self.incast = cluster, list(flows), incast
        self.sinks: dict[int, subprocess.Popen] = {}
        self.senders: list[subprocess.Popen] = []
        self.started = 0.0

    @classmethod
    def across(cls, cluster, hosts_per_leaf: int, incast: bool = True) -> CrossTraffic:
        """Each host's long flow to the host in its place on the next leaf (every flow
        crosses the uplinks, both ways), and an incast into the last host."""
        n = len(cluster.hosts)
        flows = [(h, (h + hosts_per_leaf) % n) for h in range(n)]
        return cls(cluster, flows, Incast(n - 1) if incast else None)

    def __enter__(self) -> CrossTraffic:
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        c = self.cluster
        receivers = {b for _, b in self.flows} | ({self.incast.into} if self.incast else set())
        for h in sorted(receivers):
            self.sinks[h] = c.run(h, [sys.executable, "-m", __name__, "sink", str(PORT)],
                                  stdout=subprocess.PIPE, text=True)
        for h, p in self.sinks.items():
            _await(p, LISTENING, f"the sink on host {h}")
        sends = [(a, [c.hosts[b].ip, str(PORT)]) for a, b in self.flows]
        if self.incast:
            i = self.incast
            sends += [(a, [c.hosts[i.into].ip, str(PORT), "--burst", str(i.burst),
                           "--period", str(i.period)])
                      for a in range(len(c.hosts)) if a != i.into]
        for a, args in sends:
            self.senders.append(c.run(a, [sys.executable, "-m", __name__, "send", *args],
                                      stdout=subprocess.PIPE, text=True))
        for (a, args), p in zip(sends, self.senders):
            _await(p, CONNECTED, f"the sender on host {a} to {args[0]}")
        self.started = time.monotonic()

    def stop(self) -> dict:
        """End every process: the bytes each receiver took from each sender (by address),
        and their goodput in bits per second."""
        seconds = max(time.monotonic() - self.started, 1e-9)
        for p in self.senders:
            p.terminate()
        for p in self.senders:
            p.wait(10)
        received = {}
        for h, p in self.sinks.items():
            p.terminate()
            out, _ = p.communicate(timeout=10)
            received[self.cluster.hosts[h].ip] = json.loads(out or "{}")
        self.senders, self.sinks = [], {}
        total = sum(n for peers in received.values() for n in peers.values())
        return {"seconds": round(seconds, 3), "bytes": received,
                "goodput_bps": round(total * 8 / seconds)}


def _await(proc: subprocess.Popen, word: str, what: str):
    """Wait for `proc`'s line `word` (it is ready), at most READY_TIMEOUT seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT)
    line = proc.stdout.readline().strip() if ready else ""
    if line != word:
        raise RuntimeError(f"cross traffic: {what} did not start in {READY_TIMEOUT:.0f} s "
                           f"(exit status {proc.poll()}, said {line!r})")


# --- the processes -------------------------------------------------------------------------

def _sink(port: int):
    """Receive from every sender until SIGTERM; print the bytes per sender address."""
    received = collections.Counter()
    server = socket.create_server(("0.0.0.0", port), backlog=64)
    server.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    print(LISTENING, flush=True)
    while not stop:
        for key, _ in sel.select(timeout=0.2):
            if key.fileobj is server:
                conn, (peer, _) = server.accept()
                conn.setblocking(False)
                sel.register(conn, selectors.EVENT_READ, peer)
                continue
            try:
                data = key.fileobj.recv(CHUNK)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()
            received[key.data] += len(data)
    print(json.dumps(dict(received)), flush=True)


def _send(host: str, port: int, burst: int, period: float):
    """Send to `host` until SIGTERM: continuously, or `burst` bytes every `period`."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    data = bytes(CHUNK)
    conn = socket.create_connection((host, port), timeout=30)     # its sink listens
    print(CONNECTED, flush=True)
    with conn:
        if not burst:
            while True:
                conn.sendall(data)
        while True:
            start = time.monotonic()
            left = burst
            while left > 0:
                left -= conn.send(data[:min(left, CHUNK)])
            time.sleep(max(0.0, period - (time.monotonic() - start)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="role", required=True)
    sink = sub.add_parser("sink")
    sink.add_argument("port", type=int)
    send = sub.add_parser("send")
    send.add_argument("host")
    send.add_argument("port", type=int)
    send.add_argument("--burst", type=int, default=0)
    send.add_argument("--period", type=float, default=0.5)
    args = p.parse_args(argv)
    if args.role == "sink":
        _sink(args.port)
    else:
        _send(args.host, args.port, args.burst, args.period)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
