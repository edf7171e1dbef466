"""cocotb testbench of the RTL leaf (sim.tops.SwitchTop built with `uplinks=2`: downlinks on
ports 0 and 1, uplinks on ports 2 and 3) in a world of golden switches, compared frame for
frame with the golden leaf and its workers' sums with numpy.

The world (docs/leafspine.md's set-up): leaf 0 is the RTL, leaf 1 a `GoldenLeaf`, each with
two workers (scapy frames, `tests.switch_traffic.Worker`) on its ports 0 and 1; spine i (a
`GoldenSpine`) is uplink i of both leaves, leaf l on its port l. The golden switches answer in
zero simulated time: a frame the RTL sends up an uplink goes to its spine as its last beat
leaves (`SwitchTB.on_frame`), and the spine's frames for the RTL enter the uplink's rx queue.
Every cable is a `sim.topology.Link` that may lose and duplicate frames; a reordered frame is
held back on its link behind the next one (or until the round ends). A `GoldenLeaf` fed the
RTL's inputs in commit order (`tests.cocotb_switch.Golden`) must send the RTL's frames on
every port, byte for byte; the workers (`tests.leafspine_net.Job`) send each use of a slot
only after the result of its previous use, send again what went unanswered each round, and
check every result against numpy's sum of all four world ranks' data.
"""

from __future__ import annotations

import enum
import os
import random

import cocotb
import numpy as np
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.bench_leaf import (
    DOWNLINKS,
    SPINE_KEY,
    UPLINKS,
    address_records,
    alternate,
    leaf,
    spine,
    spine_job_records,
    uplink_records,
)
from netagg.sim.bench_switch import PARAMS, PORTS, WIDTH, SwitchTB
from netagg.sim.golden_leaf import GoldenLeaf
from netagg.sim.golden_spine import GoldenSpine
from netagg.sim.topology import Direction, Link, LinkFaults
from tests.cocotb_switch import Golden, assert_same
from tests.leafspine_net import CHUNK, JOB, Job, control
from tests.switch_traffic import Worker, control_frame, job_config_records, job_key
from tests.test_spine_rtl import _read

LEAVES, PER_LEAF = 2, 2
UP, DOWN = Direction.UP, Direction.DOWN


class Cable(enum.Enum):
    """A worker's cable to its leaf port, or a leaf's uplink to a spine."""

    HOST = "host"
    UPLINK = "uplink"

TABLES = {"jobs": PARAMS.get("jobs", 2), "max_workers": PARAMS.get("max_workers", 4),
          "slots": PARAMS.get("slots", 16)}


def golden_leaf() -> GoldenLeaf:
    return GoldenLeaf(uplinks=UPLINKS, ports=PORTS, width=WIDTH, **TABLES)


class World:
    """The RTL leaf 0, golden leaf 1 and golden spines, cabled; job 0 over `slots` slots at
    every switch, SPRAY `spray` at both leaves. `tap(l, i, direction, frame)`, when set, sees
    each frame that enters the cable between leaf l and spine i, and loses it by returning
    True. The attributes `Job` uses: `workers`, `slots`, `lanes`, `hosts`, `send`, `inbox`."""

    def __init__(self, dut, *, seed: int, slots: int = 8, lanes: int = 64, spray=None):
        self.tb = SwitchTB(dut, seed=seed, on_frame=self._from_rtl)
        self.rng = random.Random(seed)
        self.shadow = Golden()
        self.shadow.model = golden_leaf()
        self.leaf1 = golden_leaf()
        self.spines = [GoldenSpine(ports=LEAVES, width=WIDTH, **TABLES) for _ in range(UPLINKS)]
        self.workers, self.slots, self.lanes = [PER_LEAF] * LEAVES, slots, lanes
        self.spray = alternate() if spray is None else spray
        self.hosts = [[Worker(job=JOB, rank=r, ip=f"10.{l + 1}.0.{r + 10}",
                              mac=0x020000000000 | l << 8 | r, udp_port=0xC100 + r, port=r,
                              qpn=0x100 + 16 * l + r, rkey=0xAB00 + r,
                              va=(l + 1) << 40 | (r + 1) << 32, slot_count=slots,
                              key=job_key(JOB)) for r in range(PER_LEAF)]
                      for l in range(LEAVES)]
        self.links = {(Cable.HOST, l, r): Link(f"host{l}.{r}", 0, f"leaf{l}", r)
                      for l in range(LEAVES) for r in range(PER_LEAF)}
        self.links.update({(Cable.UPLINK, l, i):
                           Link(f"leaf{l}", DOWNLINKS + i, f"spine{i}", l)
                           for l in range(LEAVES) for i in range(UPLINKS)})
        self.held: dict[tuple, list[bytes]] = {}       # reordered frames, per cable and way
        self.tap = None
        self.outbox: list[tuple[int, int, bytes]] = []
        self.inbox: list[tuple[int, int, bytes]] = []
        self.replies: list[bytes] = []                 # the RTL's control replies
        self.up_frames: list[tuple[int, int, bytes]] = []   # (leaf, uplink, frame) sent up

    async def start(self):
        """Reset the RTL and set the job up at every switch."""
        await self.tb.reset()
        for l in range(LEAVES):
            leaf_job = (address_records(leaf(l)) + uplink_records(UPLINKS, DOWNLINKS)
                        + job_config_records(JOB, self.hosts[l], 0, self.slots) + [
                            (R.WRITE | R.job_reg(JOB, R.JOB_PARENT_KEY), SPINE_KEY),
                            (R.WRITE | R.job_reg(JOB, R.JOB_SPRAY), self.spray),
                            (R.WRITE | R.job_reg(JOB, R.JOB_PARENT),
                             R.PARENT.pack(enable=1, rank=l))])
            if l == 0:
                await self.control(leaf_job)
            else:
                control(self.leaf1, leaf_job)
        for i, s in enumerate(self.spines):
            control(s, address_records(spine(i)) + spine_job_records(JOB, LEAVES, 0, self.slots))

    async def control(self, records) -> list[int]:
        """A control request to the RTL leaf (port 0); the values of its reply."""
        before = len(self.replies)
        for k in range(0, len(records), W.MAX_CONTROL_RECORDS):
            self.tb.send(0, control_frame(records[k:k + W.MAX_CONTROL_RECORDS], psn=k))
        await self.settle()
        return [v for f in self.replies[before:] for _, v in
                W.unpack_records(W.parse_frame(f).payload)]

    async def counters(self, names) -> dict:
        """The RTL leaf's job-0 counters (FABRIC_COUNTERS too) by name."""
        return dict(zip(names, await self.control([(R.job_counter(JOB, n), 0) for n in names])))

    # --- the cables ---------------------------------------------------------------------------

    def silence(self, i: int, silent: bool = True):
        """Spine i sends and takes nothing (its cables lose every frame); the leaves do not
        know."""
        for l in range(LEAVES):
            self.links[Cable.UPLINK, l, i].cut = silent

    def set_faults(self, faults: LinkFaults, kinds=tuple(Cable)):
        for key, link in self.links.items():
            if key[0] in kinds:
                link.faults = faults

    def _carry(self, key: tuple, direction: Direction, frame: bytes):
        if key[0] is Cable.UPLINK and direction is UP:
            self.up_frames.append((key[1], key[2], frame))
        if key[0] is Cable.UPLINK and self.tap is not None and \
                self.tap(key[1], key[2], direction, frame):
            return
        link = self.links[key]
        held = self.held.setdefault((key, direction), [])
        for f in link.carry([frame], direction, self.rng):
            if link.faults.reorder and self.rng.random() < link.faults.reorder:
                held.append(f)                      # it arrives after the next one
                continue
            self._deliver(key, direction, f)
            while held:
                self._deliver(key, direction, held.pop(0))

    def _release(self) -> bool:
        """Deliver every frame held back; whether there was one."""
        any_held = False
        while any(self.held.values()):
            any_held = True
            for (key, direction), held in list(self.held.items()):
                while held:
                    self._deliver(key, direction, held.pop(0))
        return any_held

    def _deliver(self, key: tuple, direction: Direction, frame: bytes):
        kind, l, n = key
        if kind is Cable.HOST and direction is DOWN:
            self.inbox.append((l, n, frame))
        elif kind is Cable.HOST:
            self._into_leaf(l, n, frame)
        elif direction is UP:
            for port, out in self.spines[n].receive(l, frame):
                self._carry((Cable.UPLINK, port, n), DOWN, out)
        else:
            self._into_leaf(l, DOWNLINKS + n, frame)

    def _into_leaf(self, l: int, port: int, frame: bytes):
        if l == 0:
            self.tb.send(port, frame)
            return
        for p, out in self.leaf1.receive(port, frame):
            self._out_of_leaf(1, p, out)

    def _out_of_leaf(self, l: int, port: int, frame: bytes):
        if port < DOWNLINKS:
            self._carry((Cable.HOST, l, port), DOWN, frame)
        else:
            self._carry((Cable.UPLINK, l, port - DOWNLINKS), UP, frame)

    def _from_rtl(self, port: int, frame: bytes):
        """`SwitchTB.on_frame`: the RTL's frame out of `port`, onto its cable."""
        if W.parse_frame(frame).opcode == W.OP_CONTROL:
            self.replies.append(frame)
        else:
            self._out_of_leaf(0, port, frame)

    # --- rounds --------------------------------------------------------------------------------

    def send(self, l: int, r: int, frame: bytes):
        self.outbox.append((l, r, frame))

    async def settle(self):
        """Run until the RTL is quiet and no frame is held on a cable; the shadow catches up."""
        while True:
            await self.tb.drain(quiet=300)
            if not self._release() and not any(self.tb.queues):
                break
        self.shadow.catch_up(self.tb)

    async def drain(self):
        """The workers' frames onto their cables, and everything they cause."""
        outbox, self.outbox = self.outbox, []
        for l, r, frame in outbox:
            self._carry((Cable.HOST, l, r), UP, frame)
        await self.settle()

    def check_shadow(self, dut):
        assert_same(dut, self.tb, self.shadow)


class LeafJob(Job):
    """`tests.leafspine_net.Job` on the cocotb world: rounds are awaited."""

    async def round(self):
        net = self.net
        for (l, r, s), u in self.cur.items():
            if u < self.uses:
                net.send(l, r, self.contribution(l, r, u, s))
        await net.drain()
        inbox, net.inbox = net.inbox, []
        for l, r, frame in inbox:
            u, s = self.check(l, r, frame)
            if self.cur[l, r, s] == u:
                self.cur[l, r, s] = u + 1

    async def run(self, rounds: int = 60) -> int:
        for n in range(1, rounds + 1):
            await self.round()
            if self.done():
                return n
        raise AssertionError(f"not done after {rounds} rounds: {self.pending()}")


def local_sum(job: Job, l: int, u: int, s: int) -> np.ndarray:
    return sum(job.lanes[l, r, u, s].astype(np.int64) for r in range(PER_LEAF))


def check_partial(job: Job, frame: bytes, uplink: int, *, count=PER_LEAF):
    """A partial of the RTL leaf as scapy reads it: to spine `uplink`, DSCP 7, dqpn 0, the
    leaf's rank and PARENT_KEY, the local workers' sums of the use its RETH.va names."""
    pkt, reth, imm, lanes = _read(frame)
    assert pkt[IP].src == leaf(0).ip and pkt[IP].dst == spine(uplink).ip
    assert pkt[IP].tos >> 2 == W.PARTIAL_DSCP and pkt[BTH].dqpn == 0
    assert pkt[BTH].opcode == W.OP_CONTRIBUTION and reth.rkey == SPINE_KEY
    fields = W.unpack_imm(W.REQUEST_IMM, imm)
    msn, offset = W.split_va(reth.va)
    u, s = divmod(msn, job.net.slots)
    assert (fields["job"], fields["rank"], fields["slot"], fields["version"]) == (JOB, 0, s, u % 2)
    assert offset == CHUNK * msn
    partial = W.unpack_imm(W.PARTIAL, pkt[BTH].psn)
    assert partial["count"] == count and partial["overflow"] == 0
    np.testing.assert_array_equal(lanes, local_sum(job, 0, u, s))
    return partial, u, s


@cocotb.test()
async def upstream_downstream(dut):
    """Three uses of 8 slots: each use's partial goes up once, as scapy reads it, with the
    local sums; each spine result comes down to both local workers with the world's sums;
    a worker's retransmission after its result is a replay to it alone."""
    world = World(dut, seed=21)
    await world.start()
    job = LeafJob(world, uses=3, seed=21)
    rounds = await job.run()
    slots = world.slots
    assert rounds == job.uses
    ours = [(i, f) for l, i, f in world.up_frames if l == 0]
    assert len(ours) == job.uses * slots
    seen = set()
    for i, frame in ours:
        partial, u, s = check_partial(job, frame, i)
        assert partial["resent"] == 0 and partial["final"] == 0
        assert R.spray_entry(world.spray, s) == i
        seen.add((u, s))
    assert len(seen) == job.uses * slots
    # replays: worker 0 of leaf 0 sends each slot's last use again
    for s in range(slots):
        world.send(0, 0, job.contribution(0, 0, job.uses - 1, s))
    before = len(world.up_frames)
    await world.drain()
    assert len(world.up_frames) == before                  # nothing goes up again
    assert sorted((l, r) for l, r, _ in world.inbox) == [(0, 0)] * slots
    for l, r, frame in world.inbox:
        job.check(l, r, frame)
    world.inbox.clear()
    names = ("upstream", "resends", "parent_results", "completed", "results", "replays",
             "drop_parent", "pulled")
    counters = await world.counters(names)
    uses = job.uses * slots
    assert counters == {"upstream": uses, "resends": 0, "parent_results": uses,
                        "completed": uses, "results": uses * PER_LEAF + slots,
                        "replays": slots, "drop_parent": 0, "pulled": 0}
    world.check_shadow(dut)


@cocotb.test()
async def spraying(dut):
    """A random SPRAY over the 2 uplinks (both leaves alike): each spine sees the partials
    of its slots only, every slot's from both leaves."""
    rng = random.Random(22)
    entries = [rng.randrange(UPLINKS) for _ in range(R.SPRAY_ENTRIES - 2)] + [0, 1]
    rng.shuffle(entries)
    world = World(dut, seed=22, slots=16, spray=R.spray_word(entries))
    await world.start()
    job = LeafJob(world, uses=2, seed=22)
    await job.run()
    per_spine = [0] * UPLINKS
    for l, i, frame in world.up_frames:
        slot = W.unpack_imm(W.REQUEST_IMM, W.parse_frame(frame).imm)["slot"]
        assert entries[slot % R.SPRAY_ENTRIES] == i, (l, i, slot)
        per_spine[i] += 1
    want = [LEAVES * job.uses * entries[:world.slots].count(i) for i in range(UPLINKS)]
    assert per_spine == want and min(want) > 0
    for i, frame in ((i, f) for l, i, f in world.up_frames if l == 0):
        check_partial(job, frame, i)
    world.check_shadow(dut)


@cocotb.test()
async def uplink_failure(dut):
    """Spine 1 completes use 1 of its slots but its result reaches only one leaf (leaf 0, the
    RTL, for slots 1 and 5; leaf 1 for 3 and 7); then it goes silent, and a control frame
    marks uplink 1 down at the RTL (and at leaf 1) mid-run. The leaf still waiting re-sends
    its partial to spine 0, which pulls the other, DONE, leaf; its final completes the use at
    spine 0; every use completes exactly, the last ones through spine 0 alone."""
    world = World(dut, seed=23)
    await world.start()
    job = LeafJob(world, uses=3, seed=23)
    await job.round()                                          # use 0 everywhere

    def tap(l, i, direction, frame):
        if i != 1 or direction is not DOWN:
            return False
        slot = W.unpack_imm(W.RESULT_IMM, W.parse_frame(frame).imm)["slot"]
        return slot % 4 == (3 if l == 0 else 1)           # the other leaf gets it
    world.tap = tap
    await job.round()                                          # use 1: a result lost per slot
    world.tap = None
    assert job.pending()
    world.silence(1)
    await job.round()                                          # re-sent into the silence
    assert await world.control([(R.WRITE | R.REG_UPLINK_DOWN, 0b10)]) == [0b10]
    control(world.leaf1, [(R.WRITE | R.REG_UPLINK_DOWN, 0b10)])
    await job.run()
    names = ("pulled", "resends", "parent_results", "drop_parent", "completed")
    counters = await world.counters(names)
    dut._log.info("RTL leaf %s; spine 0 %s", counters,
                  {n: world.spines[0].fabric_counters[JOB][n] for n in ("finals", "pulls")})
    uses = job.uses * world.slots
    # every use's result taken once; slots 1 and 5 pulled at the RTL (DONE: its finals, up
    # uplink 0), and spine 0's results for them refused; slots 3 and 7 re-sent from the RTL
    assert counters["completed"] == uses and counters["parent_results"] == uses
    assert counters["pulled"] >= 2 and counters["drop_parent"] >= 2 and counters["resends"] >= 2
    assert world.spines[0].fabric_counters[JOB]["finals"] >= 4
    finals = [(i, s) for l, i, f in world.up_frames if l == 0
              for s in [W.unpack_imm(W.REQUEST_IMM, W.parse_frame(f).imm)["slot"]]
              if W.unpack_imm(W.PARTIAL, W.parse_frame(f).psn)["final"]]
    assert {s for _, s in finals} == {1, 5} and {i for i, _ in finals} == {0}
    world.check_shadow(dut)


async def mark_down(world: World, uplinks: int):
    """REG_UPLINK_DOWN at both leaves: by a control frame at the RTL, directly at leaf 1."""
    assert await world.control([(R.WRITE | R.REG_UPLINK_DOWN, uplinks)]) == [uplinks]
    control(world.leaf1, [(R.WRITE | R.REG_UPLINK_DOWN, uplinks)])


@cocotb.test()
async def every_uplink_down(dut):
    """Both uplinks marked down before use 1: the locally complete uses go nowhere
    (`no_uplink`, nothing up) and wait; uplink 1 marked up again, the workers'
    retransmissions send every partial up it, and every use completes exactly."""
    world = World(dut, seed=25)
    await world.start()
    job = LeafJob(world, uses=3, seed=25)
    await job.round()
    await mark_down(world, 0b11)
    sent = len(world.up_frames)
    await job.round()
    await job.round()
    assert len(world.up_frames) == sent and job.pending()
    held = await world.counters(("no_uplink", "upstream", "completed"))
    # each use: its completion and both workers' retransmissions find no uplink
    assert held == {"no_uplink": 3 * world.slots, "upstream": world.slots,
                    "completed": world.slots}
    await mark_down(world, 0b01)
    await job.run()
    assert {i for _, i, _ in world.up_frames[sent:]} == {1}
    counters = await world.counters(("completed", "no_uplink"))
    assert counters == {"completed": job.uses * world.slots, "no_uplink": 3 * world.slots}
    world.check_shadow(dut)


@cocotb.test()
async def spine_dies_under_loss(dut):
    """Loss, duplication and reordering at both levels (NETAGG_LOSS, 10 % by default), and
    one spine (drawn by NETAGG_SEED) silent from a random round on, its uplink marked down a
    round later: every use completes exactly, frame for frame as the golden leaf."""
    seed = int(os.environ.get("NETAGG_SEED", "26"))
    rate = float(os.environ.get("NETAGG_LOSS", "0.1"))
    rng = random.Random(seed)
    world = World(dut, seed=seed)
    await world.start()
    world.set_faults(LinkFaults(drop=rate, duplicate=rate, reorder=rate))
    job = LeafJob(world, uses=int(os.environ.get("NETAGG_USES", "4")), seed=seed)
    dead, at = rng.randrange(UPLINKS), rng.randrange(1, job.uses)
    for _ in range(at):
        await job.round()
    world.silence(dead)
    await job.round()
    await mark_down(world, 1 << dead)
    await job.run()
    world.set_faults(LinkFaults())
    counters = await world.counters(("completed", "resends", "pulled", "parent_results"))
    dut._log.info("spine %d dead at round %d; RTL leaf %s", dead, at, counters)
    assert counters["completed"] == job.uses * world.slots
    world.check_shadow(dut)


@cocotb.test()
async def loss(dut):
    """Loss, duplication and reordering on the workers' cables and on the uplinks (10 %
    each by default, NETAGG_LOSS; NETAGG_SEED, NETAGG_USES): every use completes exactly and
    the RTL sends the golden leaf's frames."""
    seed = int(os.environ.get("NETAGG_SEED", "24"))
    rate = float(os.environ.get("NETAGG_LOSS", "0.1"))
    world = World(dut, seed=seed)
    await world.start()
    world.set_faults(LinkFaults(drop=rate, duplicate=rate, reorder=rate))
    job = LeafJob(world, uses=int(os.environ.get("NETAGG_USES", "3")), seed=seed)
    rounds = await job.run()
    world.set_faults(LinkFaults())
    counters = await world.counters(("completed", "resends", "duplicates", "replays"))
    dut._log.info("%d rounds; RTL leaf %s", rounds, counters)
    assert counters["completed"] == job.uses * world.slots
    assert rounds > job.uses and counters["resends"] + counters["replays"] > 0
    world.check_shadow(dut)
