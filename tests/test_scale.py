"""The flow-level model of `netagg scale` against closed forms, the loss model's limits, the
reproduce table and the command's outputs (netagg/apps/scale/, docs/scale.md)."""

import json
import math

import pytest

from netagg.apps.scale import loss, topology
from netagg.apps.scale.cli import main, parse
from netagg.apps.scale.cluster import (
    PAYLOAD,
    WIRE_BYTES,
    Cluster,
    Model,
    SwitchCalibration,
    Topology,
)
from netagg.apps.scale.flow import Scheme, estimate
from netagg.apps.scale.reproduce import claims

GB = 1 << 30
BIG = Model("1 GiB of gradient", GB // 4, 1.0)      # bandwidth-dominated


def line_seconds(nbytes: float, gbps: float) -> float:
    """Gradient bytes at a link's rate, each packet's headers included."""
    return nbytes * WIRE_BYTES / PAYLOAD * 8 / (gbps * 1e9)


@pytest.mark.parametrize("workers", [8, 64, 1024])
@pytest.mark.parametrize("gbps", [10.0, 100.0])
def test_ring_is_2_n_minus_1_over_n(workers, gbps):
    e = estimate(Scheme.RING, Cluster(workers, gbps), BIG)
    assert e.sync_s == pytest.approx(2 * (workers - 1) / workers * line_seconds(GB, gbps),
                                     rel=0.01)


@pytest.mark.parametrize("workers,servers", [(8, 1), (64, 4), (256, 16)])
def test_parameter_server_incast_is_n_over_p(workers, servers):
    """P dedicated servers: each takes N/P of every worker's gradient in and sends as much
    out (push and pull overlap): N S / (P B)."""
    e = estimate(Scheme.PS, Cluster(workers, 100.0, ps_servers=servers), BIG)
    assert e.sync_s == pytest.approx(workers / servers * line_seconds(GB, 100.0), rel=0.01)
    assert "incast" in e.note


def test_sharded_parameter_server_moves_what_ring_does():
    c = Cluster(64, 100.0)
    assert estimate(Scheme.PS, c, BIG).sync_s == pytest.approx(
        estimate(Scheme.RING, c, BIG).sync_s, rel=0.01)


@pytest.mark.parametrize("n,k", [(8, 2), (4, 3), (4, 4)])
def test_bml_on_bcube(n, k):
    """k parts over k NICs, each reduce-scattered and gathered level by level:
    2 (N-1)/N * S / (k B)."""
    servers = n ** k
    c = Cluster(servers, 10.0, Topology.BCUBE, bcube_n=n, bcube_k=k)
    expected = 2 * (servers - 1) / servers * line_seconds(GB, 10.0) / k
    assert estimate(Scheme.BML, c, BIG).sync_s == pytest.approx(expected, rel=0.01)
    assert topology.bcube_switches(n, k) == k * n ** (k - 1)


def test_fat_tree_switch_count():
    for n in (4, 8, 48):
        assert topology.fat_tree_switches(n ** 3 // 4, n) == 5 * n * n // 4


@pytest.mark.parametrize("workers", [8, 64])
def test_aggregation_sends_s_once(workers):
    e = estimate(Scheme.INA, Cluster(workers, 100.0), BIG)
    assert e.sync_s == pytest.approx(line_seconds(GB, 100.0), rel=0.01)


def test_aggregation_held_by_the_rtl_port():
    """At 400 Gb/s a 512-bit port at 250 MHz (18 beats a packet) is the bottleneck; at a
    faster clock it is not."""
    slow = Cluster(16, 400.0)
    per_packet = math.ceil((WIRE_BYTES - 20) / 64) / 250e6
    e = estimate(Scheme.INA, slow, BIG)
    assert e.sync_s == pytest.approx(GB / PAYLOAD * per_packet, rel=0.01)
    assert "switch port" in e.note
    fast = Cluster(16, 400.0, switch=SwitchCalibration(clock_mhz=1000.0))
    assert estimate(Scheme.INA, fast, BIG).sync_s == pytest.approx(
        line_seconds(GB, 400.0), rel=0.01)


def test_window_limits_aggregation():
    tight = Cluster(16, 400.0, window=2, switch=SwitchCalibration(clock_mhz=1000.0))
    e = estimate(Scheme.INA, tight, BIG)
    assert "window" in e.note
    assert e.sync_s > 2 * line_seconds(GB, 400.0)


def test_hierarchical_condition():
    """Hierarchical (intra reduce-scatter, aggregation across nodes, intra all-gather) costs
    2 (G-1)/G S/B_in + S/B."""
    c = Cluster(128, 100.0, gpus_per_node=8, intra_gbps=400.0)
    expected = 2 * 7 / 8 * line_seconds(GB, 400.0) + line_seconds(GB, 100.0)
    assert estimate(Scheme.HIERARCHICAL, c, BIG).sync_s == pytest.approx(expected, rel=0.01)


def test_ecmp_collisions_slow_an_oversubscribed_parameter_server():
    base = dict(workers=256, link_gbps=100.0, topology=Topology.LEAF_SPINE, radix=32,
                ps_servers=0)
    sprayed = estimate(Scheme.PS, Cluster(**base, oversubscription=1.0), BIG).sync_s
    over = estimate(Scheme.PS, Cluster(**base, oversubscription=3.0), BIG).sync_s
    hashed = estimate(Scheme.PS, Cluster(**base, oversubscription=3.0, spraying=False),
                      BIG).sync_s
    assert sprayed < over <= hashed


def test_scaling_and_full_utilisation():
    m = Model("m", 100_000_000, 0.3)
    e = estimate(Scheme.RING, Cluster(64, 10.0), m)
    assert e.iteration_s == pytest.approx(0.1 + max(0.2, e.sync_s))
    assert e.scaling == pytest.approx(0.3 / e.iteration_s)
    assert e.full_sync_s == pytest.approx(2 * 63 / 64 * 4e8 * 8 / 10e9)
    assert 0.85 < e.utilisation < PAYLOAD / WIRE_BYTES + 1e-9
    assert e.full_scaling >= e.scaling


def test_loss_limits():
    e = estimate(Scheme.INA, Cluster(64, 100.0), BIG)
    calm = loss.tails(e, GB, 1.0, True, loss.LossSetup())
    assert all(t.mean_sync_s == pytest.approx(e.sync_s) for t in calm)
    congested = {t.mode: t for t in loss.tails(e, GB, 1.0, True,
                                               loss.LossSetup(overload=1.05))}
    plain, bounded = congested["plain"], congested["bounded loss"]
    priority = congested["priority drop + bounded loss"]
    assert plain.p99_sync_s > bounded.p99_sync_s > priority.p99_sync_s
    assert priority.p99_sync_s < 1.2 * e.sync_s       # congestion taken by droppable payloads
    assert plain.p99_sync_s >= plain.mean_sync_s > e.sync_s + 0.2   # at least one timeout
    # Random loss: priority drop cannot steer it.
    lossy = {t.mode: t for t in loss.tails(e, GB, 1.0, True, loss.LossSetup(loss=1e-4))}
    assert lossy["priority drop + bounded loss"].mean_sync_s == pytest.approx(
        lossy["bounded loss"].mean_sync_s, rel=0.01)


def test_incast_loss():
    assert loss.incast_loss(64, 16, 0) == 0.0
    assert loss.incast_loss(4, 16, 1000) == 0.0
    assert loss.incast_loss(64, 16, 112) == pytest.approx(1 - 128 / 1024)


def test_reproduce_rows():
    rows = claims()
    bml = [c for c in rows if c.source == "BML"]
    assert len(bml) == 6 and all(c.holds for c in bml)
    ina = [c for c in rows if c.source == "INA vs ring"]
    assert [c.holds for c in ina] == [True, True, True, False]
    assert "bottleneck" in ina[-1].why
    assert all(c.holds for c in rows if c.source == "NetReduce")
    assert all(c.why for c in rows if not c.holds)


def test_cli_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib: pip install -e .[scale]")
    plot = tmp_path / "scale.png"
    assert main(parse(["--workers", "8,16,1024", "--gbps", "25", "--plot", str(plot),
                       "--json", "--loss", "1e-5"])) == 0
    report = json.loads(capsys.readouterr().out)
    assert {r["scheme"] for r in report["rows"]} == {s.value for s in Scheme}
    assert len(report["rows"]) == 3 * len(Scheme)
    assert all(r["tails"] for r in report["rows"])
    assert plot.stat().st_size > 10_000
    assert main(parse(["--reproduce", "--json"])) == 0
    assert len(json.loads(capsys.readouterr().out)["claims"]) == len(claims())
