"""The golden spine: a golden switch without uplinks whose jobs may take leaves' partials
(CONFIG.partials), as docs/leafspine.md says; the rules are `sim.golden_leaf`'s, which a
switch with uplinks (a leaf, which may serve as a spine as well) follows too."""

from __future__ import annotations

from netagg.sim.golden_leaf import GoldenLeaf


class GoldenSpine(GoldenLeaf):
    """A spine: a switch without uplinks whose jobs may take leaves' partials; parameters as
    `sim.golden.GoldenSwitch`'s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, uplinks=0, **kwargs)
