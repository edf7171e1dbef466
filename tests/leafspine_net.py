"""The golden leaf's tests on the fabric's network (`sim.topology.Topology`, golden leaves and
spines, its cabling and links): what only those tests need on top of it. A test-side job
set-up (job 0 at every switch, configured by control records as the tests' own frames
need it: scapy-built workers with fixed addresses, keys and buffers), the workers' links
(each a `sim.topology.Link` between the worker and its leaf port, with the topology's
`LinkFaults`), and workers that send their uses as hosts do (a use of a slot only after the
result of the slot's previous use; every use not answered is sent again each round) and
check every result they get against numpy's sums.

Worker r of leaf l sits on the leaf's port r (the topology's downlinks: as many as the
largest leaf's workers); the topology's uplink i is port `downlinks + i`, to spine i's port
l. Contributions are built by scapy (`tests.switch_traffic.Worker`); the use a result
answers is read from its RETH.va (the offset encodes the use and slot)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.topology import (
    Direction,
    Link,
    LinkFaults,
    Notice,
    Role,
    Topology,
    default_ip,
    default_mac,
)
from tests.switch_traffic import Worker, control_frame, job_config_records, job_key

JOB = 0
SPINE_KEY = 0x5B1E0000 | 0x77
CHUNK = 4096                      # bytes between two uses' offsets in a worker's buffer


def leaf_ip(l: int) -> str:
    return default_ip(Role.LEAF, l)


def spine_ip(s: int) -> str:
    return default_ip(Role.SPINE, s)


def leaf_mac(l: int) -> int:
    return default_mac(Role.LEAF, l)


def spine_mac(s: int) -> int:
    return default_mac(Role.SPINE, s)


def control(sw, records, port: int = 0) -> list[int]:
    """Apply control records to a switch directly; the values of its reply."""
    [(_, reply)] = sw.receive(port, control_frame(records))
    return [v for _, v in W.unpack_records(W.parse_frame(reply).payload)]


class Net:
    """A `Topology` of `leaves` leaves and `spines` spines with `workers` workers per leaf (a
    list: per leaf) and job 0 set up at every switch; `set_faults` puts the same faults on
    every link, the workers' included. `leaf`, `spine`: the golden switches (or `make`'s,
    the topology's: the RTL's, say); `inbox`: the frames the workers got, as (leaf, rank,
    frame)."""

    def __init__(self, *, leaves: int = 2, spines: int = 1, workers=2, slots: int = 8,
                 lanes: int = 16, seed: int = 0, quorum: int = 0, credits: int = 0,
                 make=None):
        self.workers = [workers] * leaves if isinstance(workers, int) else list(workers)
        self.slots, self.lanes = slots, lanes
        self.topology = Topology(leaves, spines, downlinks=max(max(self.workers), 1), jobs=1,
                                 max_workers=8, slots=slots, seed=seed, make=make)
        self.leaf = [n.switch for n in self.topology.leaf_nodes]
        self.spine = [n.switch for n in self.topology.spine_nodes]
        self.hosts = [[Worker(job=JOB, rank=r, ip=f"10.{l + 1}.0.{r + 10}",
                              mac=0x020000000000 | l << 8 | r, udp_port=0xC100 + r, port=r,
                              qpn=0x100 + 16 * l + r, rkey=0xAB00 + r,
                              va=(l + 1) << 40 | (r + 1) << 32, slot_count=slots,
                              key=job_key(JOB)) for r in range(n)]
                      for l, n in enumerate(self.workers)]
        self.host_links = {(l, r): Link(f"host{l}.{r}", 0, f"leaf{l}", r)
                           for l, n in enumerate(self.workers) for r in range(n)}
        for l in range(leaves):
            self._set_up_leaf(l, quorum, credits)
        for s in range(spines):
            self._set_up_spine(s)
        self.outbox: list[tuple[int, int, bytes]] = []    # to the leaves' ports, not yet in
        self.inbox: list[tuple[int, int, bytes]] = []     # (leaf, rank, frame) at workers

    def _set_up_leaf(self, l: int, quorum: int, credits: int):
        spray = R.spray_word([e % len(self.spine) for e in range(R.SPRAY_ENTRIES)])
        self.topology.control(f"leaf{l}", job_config_records(
            JOB, self.hosts[l], 0, self.slots, credits, quorum) + [
            (R.WRITE | R.job_reg(JOB, R.JOB_PARENT_KEY), SPINE_KEY),
            (R.WRITE | R.job_reg(JOB, R.JOB_SPRAY), spray),
            (R.WRITE | R.job_reg(JOB, R.JOB_PARENT), R.PARENT.pack(enable=1, rank=l))])

    def _set_up_spine(self, s: int):
        leaves = [Worker(job=JOB, rank=l, ip=leaf_ip(l), mac=leaf_mac(l), udp_port=W.ROCEV2_PORT,
                         port=l, qpn=W.UPLINK_QPN, rkey=SPINE_KEY, va=0, key=SPINE_KEY)
                  for l in range(len(self.leaf))]
        records = job_config_records(JOB, leaves, 0, self.slots)
        records[-1] = (records[-1][0], R.CONFIG.pack(enable=1, partials=1, workers=len(leaves)))
        self.topology.control(f"spine{s}", records)

    # --- the network ------------------------------------------------------------------------

    def set_faults(self, faults: LinkFaults):
        """The same faults on every link: between the switches and the workers' own."""
        self.topology.set_faults(faults)
        for link in self.host_links.values():
            link.faults = faults

    def send(self, l: int, r: int, frame: bytes):
        """A worker's frame toward its leaf's port (it goes in at `drain`)."""
        self.outbox.append((l, r, frame))

    def drain(self):
        """Carry the workers' frames over their links, run the fabric until no frame is in
        flight between switches, and carry what leaves the leaves to the workers (`inbox`)."""
        rng = self.topology.rng
        outbox, self.outbox = self.outbox, []
        for (l, r), link in self.host_links.items():
            frames = [f for ll, rr, f in outbox if (ll, rr) == (l, r)]
            for frame in link.carry(frames, Direction.UP, rng) if frames else []:
                self.topology.send_to(f"leaf{l}", r, frame)
        out: dict[tuple[int, int], list[bytes]] = {}
        for name, port, frame in self.topology.run_by_switch():
            if name.startswith("leaf") and (int(name[4:]), port) in self.host_links:
                out.setdefault((int(name[4:]), port), []).append(frame)
        for (l, r), frames in out.items():
            self.inbox += [(l, r, f) for f in
                           self.host_links[l, r].carry(frames, Direction.DOWN, rng)]

    def silence(self, spine: int, silent: bool = True):
        """Spine `spine` sends and takes nothing (its links lose every frame), and the leaves
        do not know; or it is back."""
        if silent:
            self.topology.cut(spine, Notice.NONE)
        else:
            self.topology.restore(spine)

    def mark_down(self, uplinks: int):
        """Every leaf's REG_UPLINK_DOWN, as the fabric's manager writes it."""
        for node in self.topology.leaf_nodes:
            self.topology.control(node.name, [(R.WRITE | R.REG_UPLINK_DOWN, uplinks)],
                                  check=True)

    @property
    def sent_up(self) -> list[list[int]]:
        """Frames each leaf sent up each uplink (per leaf, per uplink)."""
        partials = self.topology.partials()
        return [partials[f"leaf{l}"] for l in range(len(self.leaf))]

    def tap(self) -> list[tuple[Link, Direction, bytes]]:
        """The frames that enter a link between switches from now on (appended as they go)."""
        seen = []
        self.topology.tap = lambda link, direction, frame: seen.append((link, direction, frame))
        return seen


@dataclasses.dataclass
class Job:
    """`uses` uses of every slot by every worker of a network, as hosts run them, each
    result checked against numpy."""

    net: Net
    uses: int
    seed: int = 0
    high: int = 1 << 20           # lanes in [-high, high)
    skipped: Callable[[int], int] | None = None    # use -> the job's msns skipped before it

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        net = self.net
        self.lanes = {(l, r, u, s): rng.integers(-self.high, self.high, net.lanes, dtype=np.int32)
                      for l, n in enumerate(net.workers) for r in range(n)
                      for u in range(self.uses) for s in range(net.slots)}
        self.expected = {}
        for (_, _, u, s), v in self.lanes.items():
            self.expected[u, s] = self.expected.get((u, s), 0) + v.astype(np.int64)
        self.cur = {(l, r, s): 0 for l, n in enumerate(net.workers) for r in range(n)
                    for s in range(net.slots)}          # the use each worker is at, per slot
        self.frames = {}
        self.results = 0                                # results checked

    def contribution(self, l: int, r: int, u: int, s: int) -> bytes:
        key = (l, r, u, s)
        if key not in self.frames:
            w = self.net.hosts[l][r]
            self.frames[key] = w.contribution(s, u % 2, CHUNK * (u * self.net.slots + s),
                                              self.lanes[key], 0, msn=self.msn(u, s))
        return self.frames[key]

    def msn(self, u: int, s: int) -> int:
        """The msn of use u of slot s: u * slots + s, and the messages the job skipped
        before it (`skipped`: as if the leaves ran them elsewhere meanwhile)."""
        skipped = self.skipped(u) if self.skipped else 0
        return (u * self.net.slots + s + skipped) & 0xFFFFFFFF

    def round(self):
        """Every worker sends each slot's use it has no result for; the network drains;
        each result is checked, and moves its worker's slot to the next use."""
        net = self.net
        for (l, r, s), u in self.cur.items():
            if u < self.uses:
                net.send(l, r, self.contribution(l, r, u, s))
        net.drain()
        inbox, net.inbox = net.inbox, []
        for l, r, frame in inbox:
            u, s = self.check(l, r, frame)
            if self.cur[l, r, s] == u:
                self.cur[l, r, s] = u + 1

    def check(self, l: int, r: int, frame: bytes) -> tuple[int, int]:
        """A result at worker (l, r): addressed to it, with the sums, count and flags of
        the use its offset names; that (use, slot)."""
        w, pkt = self.net.hosts[l][r], W.parse_frame(frame)
        assert pkt.opcode == W.OP_RESULT and pkt.dqpn == w.qpn and pkt.dst.ip == w.ip
        assert pkt.src.ip == leaf_ip(l) and pkt.rkey == w.rkey
        u, s = divmod((pkt.va - w.va) // CHUNK, self.net.slots)
        imm = W.unpack_imm(W.RESULT_IMM, pkt.imm)
        assert (imm["job"], imm["slot"], imm["version"]) == (JOB, s, u % 2)
        sums = np.frombuffer(pkt.payload, "<i4")
        np.testing.assert_array_equal(sums, self.expected[u, s])
        assert imm["count"] == sum(self.net.workers) and imm["overflow"] == 0
        self.results += 1
        return u, s

    def done(self, uses: int | None = None) -> bool:
        """Whether every worker has the results of every slot's first `uses` uses (all)."""
        uses = self.uses if uses is None else uses
        return all(u >= uses for u in self.cur.values())

    def run(self, rounds: int = 200, uses: int | None = None, each_round=None) -> int:
        """Rounds until the first `uses` uses (all) are done (AssertionError after
        `rounds`); how many. `each_round(n)` runs before round n (a test's faults)."""
        for n in range(1, rounds + 1):
            if each_round is not None:
                each_round(n)
            self.round()
            if self.done(uses):
                return n
        raise AssertionError(f"not done after {rounds} rounds: {self.pending(uses)}")

    def pending(self, uses: int | None = None) -> dict:
        uses = self.uses if uses is None else uses
        return {k: u for k, u in self.cur.items() if u < uses}


AWAY_STEP = 14000       # msns skipped before each use while a spine is away (< 2^15 / 2)


def away_for_2_16(before: int = 2, away: int = 8) -> Callable[[int], int]:
    """A `Job.skipped` for `away_and_back`: no msns skipped before use `before`, AWAY_STEP
    more before each of the `away` uses from it (two uses of a copy stay less than 2^15
    apart, as a leaf's and a working spine's 16-bit copies need), then as many as then: the
    uses after it are more than 2^16 messages on, and behind by their low 16 bits."""
    return lambda u: AWAY_STEP * min(max(u - before + 1, 0), away)


def away_and_back(net: Net, job: Job, spine: int = 1, before: int = 2, away: int = 8) -> dict:
    """The first `before` uses through every spine; `spine` cut and marked down at every
    leaf for the next `away` uses (with `away_for_2_16`'s msns: more than 2^16 messages
    through the others); then mended and marked up for the rest: every use done, each
    result checked. The uses the spine completed before it came back, and after."""
    def completed() -> int:
        return control(net.spine[spine], [(R.job_counter(JOB, "completed"), 0)])[0]

    job.run(uses=before)
    net.topology.cut(spine)
    job.run(uses=before + away)
    net.topology.restore(spine)
    net.mark_down(0)
    back = completed()
    job.run()
    return {"before": back, "after": completed() - back}
