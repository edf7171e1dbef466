"""The time of a simulated fabric whose switches have clocks of their own (the RTL's models),
in slices, for hosts in the same process (`sim.topology.Topology.advance`, which an
in-process hub calls: `host.fabric.FabricHub`).

A slice: every such switch with work to do (frames sent to it, or still `busy`) clocks
`cycles` cycles (`sim.model.RtlSwitch.advance`), side by side in threads (a model's clock
runs without the GIL), in the background: `start` returns at once, and the hosts take the
last slice's results and send their next packets while the switches work, as hosts and
boards do; `join` waits for the slice and gives each switch's frames out. A frame sent to a
switch while its slice runs is held (`hold`) and handed over when the slice ends, in the
order sent; the deadlines' ticks due meanwhile wait for the same moment (`Topology.tick`).
Whatever else touches the switches (a `run`, a control request) joins the slice first.

Cost: per slice, a thread hand-over per switch clocked; the switches' clocks run side by
side, a thread per core, while the hosts' Python runs beside them.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_MADE = threading.Lock()        # the pool is made once, whichever thread asks first


def pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that clock the RTL's models side by side, one per core (shared)."""
    global _POOL
    with _MADE:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2),
                                                          thread_name_prefix="netagg-fabric")
    return _POOL


def clocked(switch) -> bool:
    """Whether a switch has a clock of its own (the RTL), which `advance` runs a slice of."""
    return hasattr(switch, "advance")


class Slices:
    """The running slice of a fabric's switches (`nodes`: objects with a `switch`), of
    `cycles` cycles each, and the frames held for them meanwhile."""

    def __init__(self, nodes, cycles: int):
        self.nodes, self.cycles = nodes, cycles
        self.running: list[tuple[object, concurrent.futures.Future]] = []
        self.held: list[tuple[object, int, bytes]] = []

    def hold(self, node, port: int, frame: bytes) -> bool:
        """Keep a frame for a switch whose slice runs (True), or leave it to be sent now."""
        if any(n is node for n, _ in self.running):
            self.held.append((node, port, frame))
            return True
        return False

    def start(self):
        """The next slice of every clocked switch with work, in the background."""
        cycles = self.cycles
        self.running = [(n, pool().submit(n.switch.advance, cycles)) for n in self.nodes
                        if clocked(n.switch) and (n.switch.busy or n.switch.fed)]

    def join(self) -> list[tuple[object, list]]:
        """Wait for the running slice (if any), hand the frames held over, and give (node, its
        frames out) of each switch of the slice."""
        running, self.running = self.running, []
        concurrent.futures.wait([future for _, future in running])
        held, self.held = self.held, []
        for node, port, frame in held:
            node.switch.send(port, frame)
        return [(n, future.result()) for n, future in running]     # (a switch's error raises)
