"""The simulated leaf and spine network (`sim.topology`): the cabling it writes, frames it
carries between switches (and drops, duplicates, reorders or loses on a cut link), its host
ports, and the fabric's description as the hosts read it (`host.fabric`)."""

from __future__ import annotations

import random

import pytest

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host.errors import NetaggError
from netagg.host.fabric import Fabric, Placement
from netagg.sim.topology import Direction, Link, LinkFaults, Topology
from tests.frames import scapy_frame


def test_the_rack_is_cabled_and_addressed():
    topo = Topology(2, 3, downlinks=4)
    ips = set()
    for leaf in topo.leaf_nodes:
        [(_, uplinks), (_, down), (_, ip)] = topo.control(
            leaf.name, [(R.REG_UPLINKS, 0), (R.REG_UPLINK_DOWN, 0), (R.REG_IP, 0)])
        assert (uplinks, down) == (3, 0)
        ips.add(ip)
        for i, spine in enumerate(topo.spine_nodes):
            table = [v for _, v in topo.control(leaf.name, [(R.uplink_reg(i, f), 0) for f in (
                R.UPLINK_PORT, R.UPLINK_MAC_HI, R.UPLINK_MAC_LO, R.UPLINK_IP,
                R.UPLINK_UDP_PORT)])]
            assert table == [4 + i, spine.mac >> 32, spine.mac & 0xFFFFFFFF,
                             W.ip_to_int(spine.ip), W.ROCEV2_PORT]
            link, direction = topo.links[leaf.name, 4 + i]
            assert (link.b, link.b_port, direction) == (spine.name, leaf.index, Direction.UP)
    for spine in topo.spine_nodes:
        [(_, uplinks), (_, ip)] = topo.control(spine.name, [(R.REG_UPLINKS, 0), (R.REG_IP, 0)])
        assert uplinks == 0
        ips.add(ip)
    assert len(ips) == 5                                    # an address of its own each
    for name in topo.nodes:                                 # nothing of any job
        [(_, config)] = topo.control(name, [(R.job_reg(0, R.JOB_CONFIG), 0)])
        assert config == 0


def test_host_ports_are_the_downlinks_then_the_spines_management_ports():
    topo = Topology(2, 2, downlinks=3)
    assert topo.ports == 2 * 3 + 2
    assert [topo.locate(p) for p in range(topo.ports)] == [
        ("leaf0", 0), ("leaf0", 1), ("leaf0", 2), ("leaf1", 0), ("leaf1", 1), ("leaf1", 2),
        ("spine0", 2), ("spine1", 2)]
    assert all(topo.host_port(*topo.locate(p)) == p for p in range(topo.ports))
    with pytest.raises(ValueError, match="does not face hosts"):
        topo.send_to("leaf0", 3, b"")                       # an uplink


def _toward_spine(topo: Topology, uplink: int, copies: int = 1) -> list[bytes]:
    """Contributions of a one-worker job on leaf0 whose entry names uplink `uplink`'s port:
    each completes a use at once, and its result leaves by that uplink, toward spine
    `uplink`'s port 0 (the leaf's), as a frame the spine counts. The frames, by scapy."""
    worker = W.Endpoint("10.9.0.1", 5000, 0x02_00_00_00_09_01)
    leaf = topo.nodes["leaf0"]
    key = 0x1234
    records = [(R.job_reg(0, R.JOB_SLOT_BASE), 0), (R.job_reg(0, R.JOB_SLOT_COUNT), 4),
               (R.worker_reg(0, 0, R.WORKER_PORT), R.WORKER_ENDPOINT.pack(
                   switch_port=topo.downlinks + uplink, udp_port=W.ROCEV2_PORT)),
               (R.worker_reg(0, 0, R.WORKER_IP), W.ip_to_int(worker.ip)),
               (R.job_reg(0, R.JOB_CONFIG), R.CONFIG.pack(enable=1, workers=1)),
               (R.job_reg(0, R.JOB_KEY), key)]
    topo.control("leaf0", [(a | R.WRITE, v) for a, v in records])
    switch = W.Endpoint(leaf.ip, W.ROCEV2_PORT, leaf.mac)
    return [scapy_frame(W.OP_CONTRIBUTION, 2, 1, bytes(range(16)), worker, switch,
                        reth=(W.contribution_va(msn, 0), key, 16),
                        imm=W.pack_imm(W.REQUEST_IMM, job=0, rank=0, slot=msn % 4,
                                       version=0)) for msn in range(1, copies + 1)]


def _spine_rx(topo: Topology, spine: str, port: int) -> int:
    return topo.control(spine, [(R.port_counter(port, "rx"), 0)])[0][1]


@pytest.mark.parametrize("faults,arrive", [(LinkFaults(), 3), (LinkFaults(drop=1.0), 0),
                                           (LinkFaults(duplicate=1.0), 6)])
def test_frames_between_switches_are_carried_with_the_link_faults(faults, arrive):
    topo = Topology(2, 2, downlinks=4)
    frames = _toward_spine(topo, uplink=1, copies=3)
    before = _spine_rx(topo, "spine1", 0)     # (the operator's reads enter port 2)
    topo.set_faults(faults, [topo.links["leaf0", 5][0]])
    for frame in frames:
        topo.send(topo.host_port("leaf0", 0), frame)
    assert topo.run() == []                             # nothing left by a host port
    link = topo.links["leaf0", 5][0]
    assert link.frames[Direction.UP] == 3 and link.lost == (3 if faults.drop else 0)
    assert _spine_rx(topo, "spine1", 0) - before == arrive
    assert _spine_rx(topo, "spine0", 0) == 0            # the other spine: nothing


def test_a_link_reorders_frames():
    link = Link("leaf0", 4, "spine0", 0, LinkFaults(reorder=1.0))
    assert link.carry([b"a", b"b"], Direction.UP, random.Random(0)) == [b"b", b"a"]
    assert link.frames == {Direction.UP: 2, Direction.DOWN: 0}


def test_a_cut_spine_loses_its_frames_and_every_leaf_marks_its_uplink_down():
    topo = Topology(2, 2, downlinks=4)
    frames = _toward_spine(topo, uplink=1)
    topo.cut(1)
    for leaf in topo.leaf_nodes:
        assert topo.control(leaf.name, [(R.REG_UPLINK_DOWN, 0)])[0][1] == 0b10
    topo.send(topo.host_port("leaf0", 0), frames[0])
    topo.run()
    assert topo.links["leaf0", 5][0].lost == 1 and topo.links["leaf0", 5][0].cut
    assert not topo.links["leaf0", 4][0].cut


def test_the_rtl_backend_is_cabled_as_the_golden_one():
    """The RTL's leaves (one build) and spines (another) read back the addresses and uplink
    tables the topology wrote, as the golden switches do; an unknown backend is refused."""
    rtl, golden = Topology(2, 2, backend="rtl"), Topology(2, 2)
    regs = [R.REG_UPLINKS, R.REG_IP, R.REG_MAC_LO, R.REG_UPLINK_DOWN] + [
        R.uplink_reg(i, f) for i in range(2)
        for f in (R.UPLINK_PORT, R.UPLINK_IP, R.UPLINK_MAC_LO, R.UPLINK_UDP_PORT)]
    for name in golden.nodes:
        got = rtl.control(name, [(r, 0) for r in regs])
        assert got == golden.control(name, [(r, 0) for r in regs]), name
    assert [v for _, v in rtl.control("leaf1", [(R.REG_UPLINKS, 0)])] == [2]
    with pytest.raises(ValueError, match="golden or rtl"):
        Topology(2, 2, backend="vhdl")


def test_the_description_round_trips_and_places_ranks_in_blocks():
    topo = Topology(2, 2)
    described = topo.describe({"leaf0": "udp://127.0.0.9:4791"})
    fabric = Fabric.from_dict(described)
    assert fabric.to_dict() == described
    assert fabric.leaves[0].uplinks[1].ip == topo.nodes["spine1"].ip
    assert fabric.spines[1].leaf_ports == (0, 1)
    assert fabric.leaf_named("udp://127.0.0.9:4791") == 0 and fabric.leaf_named("leaf1") == 1
    places = [Placement.of(r, 8, 2) for r in range(8)]
    assert [(p.leaf, p.leaf_rank, p.leaf_workers) for p in places] == \
        [(0, r, 4) for r in range(4)] + [(1, r, 4) for r in range(4)]
    assert [Placement.of(r, 5, 2).leaf for r in range(5)] == [0, 0, 1, 1, 1]
    described["leaves"][1]["uplinks"].reverse()
    with pytest.raises(NetaggError, match="uplink i must go to spine i"):
        Fabric.from_dict(described)


def test_a_description_without_udp_ports_takes_the_contracts():
    described = Topology(2, 1).describe()
    for switch in described["leaves"] + described["spines"]:
        del switch["udp_port"]
    for uplink in described["leaves"][0]["uplinks"]:
        del uplink["udp_port"]
    fabric = Fabric.from_dict(described)
    assert fabric.leaves[0].uplinks[0].udp_port == W.ROCEV2_PORT == 4791   # a spine's parser's
    assert fabric.leaves[0].udp_port == fabric.spines[0].udp_port == 0xC000  # REG_UDP_SPORT's
