"""A tap on a fabric's links that follows each spine's uses (`sim.topology.Topology.tap`): the
partials each spine took and the results it sent down, by leaf, so that a failure can say
which uses it left in flight: those whose partials a spine took and whose result did not
reach every leaf of the use (`in_flight`).

A use is (slot, version, msn), the whole msn (a partial's RETH.va carries it, and so does a
spine's result's); a partial's is read from its REQUEST_IMM and RETH.va, a result's from its
RESULT_IMM and RETH.va; pulls (no
payload) are not uses taken or answered. `frozen` spines are not followed any more (their
links cut: what they held stays as it was).

`cut_at_result(spine, cut)`: the spine fails while it holds a use. The moment it sends down
the result of a use in flight, the tap freezes the spine and calls `cut()`, which cuts its
links (`Topology.cut(i, Notice.NONE)`: the links only, no control request inside the tap):
that result is lost on them, so the use stays in flight whatever the switches' timing (a
slice, a tick, a golden switch answering at once). `held[spine]` keeps the uses in flight at
that moment (at least that one).

Cost: one frame parse per frame between switches.
"""

from __future__ import annotations

from collections.abc import Callable

from netagg.contract import wire as W
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
        self.cuts: dict[str, Callable[[], None]] = {}     # spine -> what cuts its links
        self.held: dict[str, list[Use]] = {}    # spine -> its uses in flight when it was cut

    def cut_at_result(self, spine: str, cut: Callable[[], None]):
        """`cut()` and freeze `spine` the moment it sends down a result of a use in flight
        (see the module's docstring)."""
        self.cuts[spine] = cut

    def __call__(self, link: Link, direction: Direction, frame: bytes) -> bool:
        if link.b in self.frozen:
            return False
        use = use_of(frame, direction)
        if use is None:
            return False
        if direction is Direction.DOWN and link.b in self.cuts and self.holds(link.b, use):
            self.frozen.add(link.b)
            self.held[link.b] = self.in_flight(link.b)
            self.cuts.pop(link.b)()     # its links cut: this result is lost on them
            return False
        seen = self.up if direction is Direction.UP else self.down
        seen.setdefault(link.b, {}).setdefault(use, set()).add(link.a)
        return False

    def holds(self, spine: str, use: Use) -> bool:
        """Whether `spine` took partials of `use` whose result did not reach every leaf that
        sent one."""
        leaves = self.up.get(spine, {}).get(use)
        return bool(leaves) and not leaves <= self.down.get(spine, {}).get(use, set())

    def in_flight(self, spine: str) -> list[Use]:
        """The uses whose partials `spine` took and whose result did not reach every leaf
        that sent one."""
        return [u for u in self.up.get(spine, {}) if self.holds(spine, u)]
