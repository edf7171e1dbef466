"""A tap on a fabric's links that follows each spine's uses (`sim.topology.Topology.tap`): the
partials each spine took and the results it sent down, by leaf, so that a failure can say
which uses it left in flight: those whose partials a spine took and whose result did not
reach every leaf of the use (`in_flight`).

A use is (slot, version, msn), the whole msn (a partial's RETH.va carries it, and so does a
spine's result's); a partial's is read from its REQUEST_IMM and RETH.va, a result's from its
RESULT_IMM and RETH.va; pulls (no
payload) are not uses taken or answered. `frozen` spines are not followed any more (their
links cut: what they held stays as it was).

Cost: one frame parse per frame between switches.
"""

from __future__ import annotations

from netagg.sim import wire as W
from netagg.sim.topology import Direction, Link

Use = tuple[int, int, int]      # slot, version, msn


def use_of(frame: bytes, direction: Direction) -> Use | None:
    """The use of a partial (up) or a result (down); None for a pull or a bad frame."""
    try:
        pkt = W.parse_frame(frame)
    except W.WireError:
        return None
    if not pkt.payload or pkt.imm is None:
        return None
    imm = W.unpack_imm(W.REQUEST_IMM if direction is Direction.UP else W.RESULT_IMM, pkt.imm)
    return imm["slot"], imm["version"], W.split_va(pkt.va)[0]


class SpineUses:
    """The tap (see the module's docstring): `up[spine][use]`, the leaves whose partial of
    `use` entered the spine's links; `down[spine][use]`, the leaves its result was sent to."""

    def __init__(self):
        self.up: dict[str, dict[Use, set[str]]] = {}
        self.down: dict[str, dict[Use, set[str]]] = {}
        self.frozen: set[str] = set()

    def __call__(self, link: Link, direction: Direction, frame: bytes) -> bool:
        if link.b in self.frozen:
            return False
        use = use_of(frame, direction)
        if use is not None:
            seen = self.up if direction is Direction.UP else self.down
            seen.setdefault(link.b, {}).setdefault(use, set()).add(link.a)
        return False

    def in_flight(self, spine: str) -> list[Use]:
        """The uses whose partials `spine` took and whose result did not reach every leaf
        that sent one."""
        down = self.down.get(spine, {})
        return [u for u, leaves in self.up.get(spine, {}).items()
                if not leaves <= down.get(u, set())]
