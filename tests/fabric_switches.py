"""The switches of the fabric's tests: the golden leaf and spine (`sim.golden_leaf`,
`sim.golden_spine`) where they exist, else the tests' stand-in (`leaf_standin`)."""

from __future__ import annotations

import importlib.util


def golden_fabric() -> bool:
    """Whether the golden model has its leaf and spine."""
    return all(importlib.util.find_spec(f"netagg.sim.{m}") is not None
               for m in ("golden_leaf", "golden_spine"))


def fabric_make():
    """`Topology(make=)`: None (the golden leaf and spine) where they exist, else the
    stand-in."""
    if golden_fabric():
        return None
    from tests.leaf_standin import StandinSwitch
    return StandinSwitch
