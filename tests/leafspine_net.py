"""A leaf/spine network of golden switches for the tests (`sim.golden_leaf`): leaves with
local workers and one uplink per spine, wired by a tiny router that can drop, duplicate and
reorder frames on every link, and workers that send their uses as hosts do (a use of a slot
only after the result of the slot's previous use; every use not answered is sent again each
round) and check every result they get against numpy's sums.

Wiring: leaf l's local worker r on its port r, its uplink i on port `workers + i` to spine i's
port l. Job 0 at every switch; each spine's job 0 has the leaves as workers (rank l = leaf
l). Contributions are built by scapy (`tests.switch_traffic.Worker`); the use a result
answers is read from its RETH.va (the offset encodes the use and slot)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
from netagg.sim import wire as W
from netagg.sim.golden_leaf import GoldenLeaf
from netagg.sim.golden_spine import GoldenSpine

from tests.switch_traffic import Worker, control_frame, job_config_records, job_key

JOB = 0
SPINE_KEY = 0x5B1E0000 | 0x77
CHUNK = 4096                      # bytes between two uses' offsets in a worker's buffer


def leaf_ip(l: int) -> str:
    return f"10.0.1.{l + 1}"


def spine_ip(s: int) -> str:
    return f"10.0.2.{s + 1}"


def leaf_mac(l: int) -> int:
    return 0x02AA00000100 | l


def spine_mac(s: int) -> int:
    return 0x02AA00000200 | s


def control(sw, records, port: int = 0) -> list[int]:
    """Apply control records to a switch directly; the values of its reply."""
    [(_, reply)] = sw.receive(port, control_frame(records))
    return [v for _, v in W.unpack_records(W.parse_frame(reply).payload)]


@dataclasses.dataclass
class Link:
    """Where a frame that leaves a switch's port goes: a worker (leaf, rank) or a switch's
    port (kind "leaf"/"spine", index, port)."""

    kind: str
    index: int
    port: int


class Fabric:
    """`leaves` leaves of `workers` local workers each (a list: per leaf), `spines` spines.
    `loss`, `dup`, `swap`: per frame on every link, the chance it is lost, delivered twice,
    or delivered after the frames behind it."""

    def __init__(self, *, leaves: int = 2, spines: int = 1, workers=2, slots: int = 8,
                 lanes: int = 16, seed: int = 0, quorum: int = 0, credits: int = 0):
        self.rng = random.Random(seed)
        self.workers = [workers] * leaves if isinstance(workers, int) else list(workers)
        self.slots, self.lanes, self.spine_count = slots, lanes, spines
        self.loss = self.dup = self.swap = 0.0
        ports = max(max(self.workers) + spines, leaves, 2)
        self.leaf = [GoldenLeaf(ports=ports, jobs=1, max_workers=8, slots=slots, uplinks=spines)
                     for _ in range(leaves)]
        self.spine = [GoldenSpine(ports=ports, jobs=1, max_workers=8, slots=slots)
                      for _ in range(spines)]
        self.dead: set[int] = set()            # spines that send and take nothing
        self.hosts = [[Worker(job=JOB, rank=r, ip=f"10.{l + 1}.0.{r + 10}",
                              mac=0x020000000000 | l << 8 | r, udp_port=0xC100 + r, port=r,
                              qpn=0x100 + 16 * l + r, rkey=0xAB00 + r,
                              va=(l + 1) << 40 | (r + 1) << 32, slot_count=slots,
                              key=job_key(JOB)) for r in range(n)]
                      for l, n in enumerate(self.workers)]
        for l, sw in enumerate(self.leaf):
            self._configure_leaf(l, sw, quorum, credits)
        for s, sw in enumerate(self.spine):
            self._configure_spine(s, sw)
        self.flight: list[tuple[Link, bytes]] = []
        self.inbox: list[tuple[int, int, bytes]] = []     # (leaf, rank, frame) at workers
        self.sent_up = [[0] * spines for _ in range(leaves)]   # partials per leaf and uplink
        self.cut = None             # (link, frame) -> True: the frame is lost (a test's tap)

    def _configure_leaf(self, l: int, sw: GoldenLeaf, quorum: int, credits: int):
        n = self.workers[l]
        recs = [(W.WRITE | W.REG_MAC_HI, leaf_mac(l) >> 32),
                (W.WRITE | W.REG_MAC_LO, leaf_mac(l) & 0xFFFFFFFF),
                (W.WRITE | W.REG_IP, W.ip_to_int(leaf_ip(l)))]
        for i in range(self.spine_count):
            recs += [(W.WRITE | W.uplink_reg(i, W.UPLINK_PORT), n + i),
                     (W.WRITE | W.uplink_reg(i, W.UPLINK_MAC_HI), spine_mac(i) >> 32),
                     (W.WRITE | W.uplink_reg(i, W.UPLINK_MAC_LO), spine_mac(i) & 0xFFFFFFFF),
                     (W.WRITE | W.uplink_reg(i, W.UPLINK_IP), W.ip_to_int(spine_ip(i))),
                     (W.WRITE | W.uplink_reg(i, W.UPLINK_UDP_PORT), W.ROCEV2_PORT)]
        control(sw, recs)
        control(sw, job_config_records(JOB, self.hosts[l], 0, self.slots, credits, quorum))
        spray = W.spray_word([e % max(self.spine_count, 1) for e in range(W.SPRAY_ENTRIES)])
        control(sw, [(W.WRITE | W.job_reg(JOB, W.JOB_PARENT_KEY), SPINE_KEY),
                     (W.WRITE | W.job_reg(JOB, W.JOB_SPRAY), spray),
                     (W.WRITE | W.job_reg(JOB, W.JOB_PARENT), W.PARENT.pack(enable=1, rank=l))])

    def _configure_spine(self, s: int, sw: GoldenSpine):
        control(sw, [(W.WRITE | W.REG_MAC_HI, spine_mac(s) >> 32),
                     (W.WRITE | W.REG_MAC_LO, spine_mac(s) & 0xFFFFFFFF),
                     (W.WRITE | W.REG_IP, W.ip_to_int(spine_ip(s)))])
        leaves = [Worker(job=JOB, rank=l, ip=leaf_ip(l), mac=leaf_mac(l), udp_port=W.ROCEV2_PORT,
                         port=l, qpn=W.UPLINK_QPN, rkey=SPINE_KEY, va=0, key=SPINE_KEY)
                  for l in range(len(self.leaf))]
        recs = job_config_records(JOB, leaves, 0, self.slots)
        recs[-1] = (recs[-1][0], W.CONFIG.pack(enable=1, partials=1, workers=len(leaves)))
        control(sw, recs)

    # --- the router ---------------------------------------------------------------------------

    def _out(self, kind: str, index: int, frames):
        for port, frame in frames:
            if kind == "leaf":
                n = self.workers[index]
                if port < n:
                    link = Link("worker", index, port)
                else:
                    self.sent_up[index][port - n] += 1
                    link = Link("spine", port - n, index)
            else:
                link = Link("leaf", port, self.workers[port] + index)
            self.flight.append((link, frame))

    def send(self, l: int, r: int, frame: bytes):
        """A worker's frame into its leaf's port."""
        self.flight.append((Link("leaf", l, r), frame))

    def deliver(self, link: Link, frame: bytes):
        """A frame at the end of its link: a dead spine's frames in flight are lost too."""
        if self.cut is not None and self.cut(link, frame):
            return
        if link.kind == "leaf" and link.port - self.workers[link.index] in self.dead:
            return
        if link.kind == "worker":
            self.inbox.append((link.index, link.port, frame))
        elif link.kind == "leaf":
            self._out("leaf", link.index, self.leaf[link.index].receive(link.port, frame))
        elif link.index not in self.dead:
            self._out("spine", link.index, self.spine[link.index].receive(link.port, frame))

    def drain(self, limit: int = 100000):
        """Deliver every frame in flight (and what they cause), with loss, duplication and
        reordering."""
        rng = self.rng
        for _ in range(limit):
            if not self.flight:
                return
            i = rng.randrange(min(len(self.flight), 4)) if rng.random() < self.swap else 0
            link, frame = self.flight.pop(i)
            if rng.random() < self.loss:
                continue
            self.deliver(link, frame)
            if rng.random() < self.dup:
                self.flight.append((link, frame))
        raise AssertionError("the network does not quiesce")

    def mark_down(self, uplinks: int):
        """Every leaf's REG_UPLINK_DOWN, as the fabric's manager writes it."""
        for sw in self.leaf:
            assert control(sw, [(W.WRITE | W.REG_UPLINK_DOWN, uplinks)]) == [uplinks]


@dataclasses.dataclass
class Job:
    """`uses` uses of every slot by every worker of a fabric, as hosts run them, each
    result checked against numpy."""

    net: Fabric
    uses: int
    seed: int = 0
    high: int = 1 << 20           # lanes in [-high, high)

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
                                              self.lanes[key], 0, msn=u * self.net.slots + s)
        return self.frames[key]

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

    def done(self) -> bool:
        return all(u >= self.uses for u in self.cur.values())

    def run(self, rounds: int = 200) -> int:
        """Rounds until every use is done (AssertionError after `rounds`); how many."""
        for n in range(1, rounds + 1):
            self.round()
            if self.done():
                return n
        raise AssertionError(f"not done after {rounds} rounds: {self.pending()}")

    def pending(self) -> dict:
        return {k: u for k, u in self.cur.items() if u < self.uses}

