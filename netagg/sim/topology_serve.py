"""`netagg sim serve --topology LxS`: a simulated leaf and spine fabric on UDP, one endpoint
per switch.

Each switch of a `sim.topology.Topology` gets its own `sim.serve.SimServer`, on a free
127.x.y.z (UDP port 4791) of its own, which is also the switch's REG_IP (its results and
partials leave from there): hosts talk to their leaf's endpoint, whose datagrams enter the
leaf's downlinks (`sim.udp_socket.switch_port_for` over them), and reach each spine's control path
at the spine's endpoint (its management port). Frames between switches never leave the
process: the topology carries them. One loop serves every endpoint: it waits for any of
them, gives each what arrived, runs the fabric and sends each switch's frames from that
switch's endpoint; a frame a switch raises on is logged and counted (`backend_errors`), and
the fabric goes on.

The first line printed is the fabric's description, JSON on one line (`host.fabric.Fabric`'s
format: each switch's URL and addresses, each leaf's uplinks); `--describe FILE` writes it too.
A fabric of boards is described by the same JSON written by hand.
"""

from __future__ import annotations

import json
import select
import signal
import time

from netagg.host.ticks import WallClock
from netagg.sim.serve import Serving, SimServer
from netagg.sim.topology import Topology


class SwitchView:
    """One switch of a topology as a `SimServer`'s backend: frames in by the index of its
    host ports, its frames out gathered by the fabric server (`outbox`)."""

    def __init__(self, name: str, host_ports: list[int]):
        self.name, self.host_ports = name, host_ports
        self.ports = len(host_ports)
        self.topology: Topology | None = None
        self.outbox: list[tuple[int, bytes]] = []
        self.views: dict[str, SwitchView] = {}

    def send(self, port: int, frame: bytes):
        self.topology.send_to(self.name, self.host_ports[port], frame)

    def run(self) -> list[tuple[int, bytes]]:
        for name, port, frame in self.topology.run_by_switch():
            self.views[name].outbox.append((port, frame))
        out, self.outbox = self.outbox, []
        return out


def parse_shape(text: str) -> tuple[int, int]:
    """'2x2' -> (leaves, spines)."""
    try:
        leaves, spines = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--topology takes LEAVESxSPINES (2x2, say), not {text!r}") from None
    return leaves, spines


class FabricServer(Serving):
    """Every switch of a topology of `leaves` x `spines` behind a UDP endpoint of its own
    (`servers`, by switch name); `serve()` until `stop()`, or `start()` in a thread. A frame
    the fabric raises on is logged and counted (`backend_errors`: each server's and the
    fabric loop's), and the fabric goes on."""

    thread_name = "netagg-fabric"

    def __init__(self, leaves: int = 2, spines: int = 2, backend: str = "golden",
                 pcap: str | None = None, **params):
        super().__init__()
        if backend != "golden":
            Topology(leaves, spines, backend)       # the clear error for what is missing
        downlinks = params.pop("downlinks", 4)
        names = [f"leaf{i}" for i in range(leaves)] + [f"spine{i}" for i in range(spines)]
        self.views = {n: SwitchView(n, list(range(downlinks)) if n.startswith("leaf")
                                    else [leaves]) for n in names}
        self.servers: dict[str, SimServer] = {}
        try:
            for n, view in self.views.items():
                self.servers[n] = SimServer(view, None, pcap if n == "leaf0" else None,
                                            ports=view.ports, as_received=True)  # leaf0's
            addresses = {n: s.bound_ip for n, s in self.servers.items()}
            self.topology = Topology(leaves, spines, backend, downlinks=downlinks,
                                     addresses=addresses, **params)
        except BaseException:
            self.close()                # the endpoints bound so far
            raise
        for view in self.views.values():
            view.topology, view.views = self.topology, self.views
        self.clock = WallClock(self.topology)

    @property
    def backend_errors(self) -> int:
        """Frames the fabric raised on, in every endpoint's loop and in the fabric's."""
        return self.stats["backend_errors"] + sum(s.stats["backend_errors"]
                                                  for s in self.servers.values())

    def describe(self) -> dict:
        return self.topology.describe({n: s.url for n, s in self.servers.items()})

    def poll(self, timeout: float = 0.05):
        watch = {(s.raw if s.raw is not None else s.sock): s for s in self.servers.values()}
        ready, _, _ = select.select(list(watch), [], [], timeout)
        self.guarded(self.clock.catch_up)
        for sock in ready:
            watch[sock].poll(0)
        for name, port, frame in self.guarded(self.topology.run_by_switch):
            self.views[name].outbox.append((port, frame))
        for name, server in self.servers.items():
            out, self.views[name].outbox = self.views[name].outbox, []
            if out:
                server.deliver(out)

    def close(self):
        for server in self.servers.values():
            server.stop()


def serve_topology_main(shape: str, backend: str = "golden", pcap: str | None = None,
                        describe: str | None = None, **params) -> int:
    from rich.console import Console
    console = Console(stderr=True)
    leaves, spines = parse_shape(shape)
    try:
        fabric = FabricServer(leaves, spines, backend, pcap, **params)
    except NotImplementedError as e:
        console.print(f"netagg sim serve --topology: {e}")
        return 2
    if describe:                # written before the first line says the fabric is up
        with open(describe, "w") as f:
            f.write(json.dumps(fabric.describe(), indent=1) + "\n")
    print(json.dumps(fabric.describe()), flush=True)
    for d in fabric.describe()["leaves"]:
        console.print(f"{d['name']}: {d['url']}, uplinks to "
                      + ", ".join(f"{u['spine']} {u['ip']} by port {u['port']}"
                                  for u in d["uplinks"]))
    for d in fabric.describe()["spines"]:
        console.print(f"{d['name']}: {d['url']} (control), leaves by ports {d['leaf_ports']}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    t0 = time.monotonic()
    try:
        fabric.serve()
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        fabric.stop()
        console.print(f"{fabric.topology.hops} frames between switches, "
                      f"{fabric.backend_errors} frames the fabric raised on, in "
                      f"{time.monotonic() - t0:.1f} s")
    return 0
