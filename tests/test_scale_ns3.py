"""The flow-level model against the packet-level simulation on ns-3 at 8 and 16 workers
(netagg/apps/scale/ns3.py): within 10 %. Skipped without the `ns3` package (`pip install -e
.[scale]`)."""

import pytest

from netagg.apps.scale import ns3
from netagg.apps.scale.cluster import Cluster, Model, SwitchCalibration
from netagg.apps.scale.flow import Scheme, estimate

pytestmark = [
    pytest.mark.skipif(not ns3.available(),
                       reason="ns-3 is not installed: pip install -e .[scale] (ns3 from PyPI)"),
    pytest.mark.xdist_group("ns3"),     # one process imports ns-3 (15 to 40 s) for them all
]

MB = 1 << 20


@pytest.mark.parametrize("workers", [8, 16])
@pytest.mark.parametrize("scheme,servers", [(Scheme.RING, 0), (Scheme.PS, 0), (Scheme.PS, 1),
                                            (Scheme.INA, 0)])
def test_flow_model_matches_ns3(workers, scheme, servers):
    c = ns3.comparable(Cluster(workers, 10.0, ps_servers=servers))
    model = Model("1 MiB", MB // 4, 0.1)
    sim = ns3.simulate(scheme, c, model.gradient_bytes)
    assert estimate(scheme, c, model).sync_s == pytest.approx(sim.max_s, rel=0.10)
    if servers:
        assert sim.peak_queue > workers                  # the incast queues at the server


@pytest.mark.parametrize("workers", [8, 16])
def test_latency_bound_and_switch_bound_cases(workers):
    """Small tensors (latency terms dominate) and a 400 Gb/s link behind the RTL's port."""
    small = Model("64 KiB", 16 * 1024, 0.1)
    for scheme in (Scheme.RING, Scheme.INA):
        c = ns3.comparable(Cluster(workers, 100.0, prop_us=2.0))
        sim = ns3.simulate(scheme, c, small.gradient_bytes)
        assert estimate(scheme, c, small).sync_s == pytest.approx(sim.max_s, rel=0.10)
    c = ns3.comparable(Cluster(workers, 400.0, switch=SwitchCalibration(clock_mhz=250.0)))
    sim = ns3.simulate(Scheme.INA, c, MB)
    assert estimate(Scheme.INA, c, Model("x", MB // 4, 0.1)).sync_s == pytest.approx(
        sim.max_s, rel=0.10)
