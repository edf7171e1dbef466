"""How the workers of a run set up their job across a leaf and spine fabric (`host.fabric`).

A worker names its leaf and the fabric (`Worker(rank, world, switch=leaf_url,
fabric=description)`); it sits on its leaf by the fabric's `Placement` (blocks of ranks, leaf
by leaf) and aggregates there as rank `leaf_rank` of the leaf's job `job` (its ImmDt rank),
while the check lane, the fill-in rounds and the result counts are the world's (`FabricEngine`:
its check lane carries the world rank's bit, so the spines' results hold the world's bitmap).

1. The world's rank 0 configures every spine's job `job` (`host.job_setup.JobSetup.claim`,
   one epoch it draws for all): its workers are the leaves, leaf l as rank l with the
   spine's port to leaf l, the leaf's MAC, IPv4 address, the RoCEv2 UDP port (the leaf's
   parser takes nothing else), QPN `UPLINK_QPN` and the job's KEY as R_Key in its entry;
   CONFIG.partials set; the slot range of its own leaf's job; CREDITS 0 (a spine sees the
   uses of the slots sprayed to it only, while message numbers count all of the job's: the
   leaves' credits bound the uses open) and no quorum or deadline (the leaves close their
   local uses; a spine waits for every leaf's partial). A spine that refuses it is named
   with the reason, and the spines it configured before are disabled again (no half-claimed
   fabric).
2. Each leaf's first rank (the world's rank 0 after the spines) waits until every spine reads
   as configured for this session (enabled, CONFIG.partials, one epoch whose key is the
   leaves' R_Keys) and the world's rank 0 beats with that epoch (`_spines_epoch`: its BEAT
   in leaf 0 carries the epoch's mark and moves), and configures its leaf's job with that
   epoch (so one key and one tag for the whole fabric): its local ranks, credits and deadline
   as on one switch, the leaf's share of the world's quorum as its QUORUM (below), and the
   parent: JOB_PARENT (enable, rank = the leaf's index),
   JOB_PARENT_KEY (the spines' KEY, the leaf job's own as the epoch is the same) and
   JOB_SPRAY (slot s up uplink s % uplinks).
3. The leaf's other ranks join it as on one switch (`JobSetup.rank_check`).

Hierarchical workers (`local_size` L > 1) take part as on one switch (`host.hierarchical`):
the fabric's job is over nodes (the switch workers), placed in blocks over the leaves, and a
node's local worker i (as far as its leaf has jobs: the leaders) is the node in switch job
`job + i` at its leaf and, through the leaves' partials, at every spine; the others share
memory only. Steps 1-3 run per switch job: node 0's local worker i claims the spines' job
`job + i` (one epoch of its own per switch job), each leaf's first node's worker i its
leaf's, and the others join; every job's slot range is its own at every switch (the spines'
are the leaves', `job_setup.slot_range`), so a node's jobs never share a slot anywhere.
Liveness runs per switch job across the leaves: local worker i watches the nodes' workers of
job `job + i`, and names a gone one by its world rank, its node, its rank at its leaf and
the leaf; a local worker gone in its node is named by its node's others (`host.node`).

One run's spines only: an earlier run of the same session string may have left the spines
configured with its epoch, whose keys match the session as well; its rank 0 is gone, so its
beat in leaf 0 stands still, while this run's rank 0 beats with its own fresh epoch only
after it has configured every spine with it. A leaf's first rank that comes first waits.

A world quorum (`host.fabric_quorum`): `quorum=Q` of the world's W ranks deals the W - Q
ranks a use may close without to the leaves, one at a time to the leaf with the most ranks
still needed, never a leaf's last; leaf l closes its local uses at q_l of its ranks (its
QUORUM), the spines wait for every leaf, so a result holds at least sum(q_l) >= Q ranks
(8 ranks on two leaves, Q = 6: 3 at each leaf; Q = 7: 3 at leaf0, all 4 at leaf1). Every
rank passes the same Q and checks its leaf's QUORUM when it joins. The world's check lane
shows which ranks a result holds, and a fill-in round's senders are chosen per leaf, with
its leaf's quorum, so the round completes at every leaf (`FabricEngine.fill_send`). A
deadline closes a use short at a leaf too, its partial carries the smaller count, and the
hosts fill in alike. Liveness spans the leaves
(`host.fabric_liveness`): every worker reads every leaf's heartbeats, through a control
channel of its own to each other leaf, and names a rank gone on any of them.

Every rank compares its leaf with the description (its REG_IP and uplink table), and the
world's rank 0 each spine's REG_IP: a switch cabled or addressed otherwise is a NetaggError
naming the switch and the register (it would drop the other switches' frames, and the run
time out). A fabric's job holds at most 63 ranks (`W.MAX_DATA_COUNT`: a result's count),
nodes when hierarchical (each switch job's result counts the nodes).

Ownership is as on one switch: the world's rank 0 (node 0's worker of each switch job) owns
the spines' jobs, each leaf's first rank its leaf's. Errors name the rank (and its node),
the job and the switch.
"""

from __future__ import annotations

import time

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host.control import ControlChannel, ip_str, read_params
from netagg.host.engine import Engine
from netagg.host.errors import NetaggError
from netagg.host.fabric import Fabric, Placement
from netagg.host.fabric_liveness import FabricLiveness
from netagg.host.fabric_quorum import FabricQuorum
from netagg.host.job_setup import JobSetup, slot_range
from netagg.host.liveness import COUNT_BITS, MARK
from netagg.host.lossy import LossyTransport
from netagg.host.messages import Send
from netagg.host.session import JobKeys, fresh_epoch
from netagg.host.transport import worker_ip
from netagg.host.wire_arrays import ContributionWriter


def spray_all(uplinks: int) -> int:
    """JOB_SPRAY with the slots dealt round robin over every uplink."""
    return R.spray_word([e % uplinks for e in range(R.SPRAY_ENTRIES)])


class FabricEngine(Engine):
    """A worker's engine in a fabric: ImmDt rank `leaf_rank` of its leaf's job, the check
    lane's bit by its world rank among `world` workers, the fill-in rounds among its leaf's
    ranks with its leaf's quorum (`quorums`), heartbeats among the leaf's ranks (the ones its
    leaf holds)."""

    def __init__(self, transport, *, placement: Placement, leaves: list[str], job: int,
                 quorums: FabricQuorum, **kw):
        super().__init__(transport, job=job, rank=placement.rank, workers=placement.world,
                         slots=None, **kw)
        self.placement, self.quorums, self.leaf_names = placement, quorums, leaves
        self.leaf_name = leaf = leaves[placement.leaf]
        # a job's slots are sprayed over the spines, paths of their own lengths: results
        # come back out of order by design, so none is taken as lost for another's answer
        self.recent.sprayed = True
        self.liveness = FabricLiveness(self.control, placement=placement, leaf=leaf, job=job,
                                       session_tag=self.session_tag, stats=self.stats)

    def close(self):
        """Close what the engine holds beside its transport: the channels to the other
        leaves."""
        self.liveness.close()

    def set_job(self, slots: int, credits: int = 0, quorum: int = 0, completed: int = 0,
                keys: JobKeys | None = None):
        """As `Engine.set_job`, `quorum` the leaf's QUORUM: it must be the one the world's
        quorum gives the leaf (every rank passes the same), and the engine's `needed` is the
        world's ranks a result holds at least."""
        p, q = self.placement, self.quorums
        if quorum != q.local[p.leaf]:
            raise NetaggError(
                f"{p.me(self.leaf_name)} of job {self.job}: "
                f"{self.leaf_name} closes a use at QUORUM {quorum}, this rank's quorum="
                f"{q.quorum} of {p.world} gives it {q.local[p.leaf]} ({q.closing(p.leaf)} of "
                f"its {q.sizes[p.leaf]} ranks): every rank of a fabric passes the same quorum")
        super().set_job(slots, credits, q.needed, completed, keys)   # check lane: the world's
        self.writer = ContributionWriter(self.job, self.placement.leaf_rank,
                                         self.transport.path_endpoints(),
                                         self.transport.switch, key=self.key)

    def me(self) -> str:
        """This worker, for errors: "rank 4 (rank 0 at leaf1) of job 0"."""
        return f"{self.placement.me(self.leaf_name)} of job {self.job}"

    def name_ranks(self, ranks: list[int]) -> str:
        """World ranks with their leaf's rank and name."""
        q, p = self.quorums, self.placement
        named = []
        for r in ranks:                 # ranks of the fabric's job: world ranks, or nodes
            at = Placement.of(r, p.world, len(q.sizes))
            named.append(p.who(r, at.leaf_rank, self.leaf_names[at.leaf]))
        return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(named)

    def fill_send(self, members: int) -> Send:
        """A fill-in round's rule among this rank's leaf's ranks, with its leaf's quorum, so
        that the round completes at every leaf (`FabricQuorum.fill_in`)."""
        return self.quorums.fill_in(self.check_lane, members, self.placement)


def fabric_worker(worker, fabric, switch, *, slots, slot_base, credits, quorum, paths, spray,
                  bind, faults, qpn: int) -> bool:
    """The rest of `Worker(..., fabric=)`'s making (`worker`: its rank, world, node, switch
    job, session, timeout and deadline are set): `switch` names its leaf (its URL or name;
    None, or an in-process topology: the leaf its rank sits on), `fabric` describes the
    fabric (`Fabric.load`: a description, its JSON or file, or an in-process
    `sim.topology.Topology`). Sets the worker's transport and engine; False for a local
    worker beyond its leaf's jobs (hierarchical: it shares memory only, and holds neither)."""
    if not isinstance(switch, (str, type(None))):
        switch = None
    worker.engine = worker.transport = None
    networked = False
    try:
        networked = join_fabric(worker, fabric, switch, slots=slots, slot_base=slot_base,
                                credits=credits, quorum=quorum, paths=paths, spray=spray,
                                bind=bind, faults=faults, qpn=qpn)
    finally:
        if not networked:
            if worker.engine is not None:
                worker.engine.close()
            if worker.transport is not None:
                worker.transport.close()
            worker.engine = None
    worker.switch_rank = worker.placement.leaf_rank
    worker.switch_workers = worker.placement.leaf_workers
    return networked


def join_fabric(worker, fabric, switch, *, slots, slot_base, credits, quorum, paths, spray,
                bind, faults, qpn: int) -> bool:
    """Set `worker` (a `host.worker.Worker` being made) up in `fabric`: its transport to its
    leaf, its `FabricEngine`, and the configuration its place asks for (the module's
    docstring); False, once it has read its leaf's jobs, for a local worker beyond them.
    `switch`: its leaf's URL or name (None: the one its rank sits on)."""
    fabric = Fabric.load(fabric)
    if worker.nodes > W.MAX_DATA_COUNT:
        what = "ranks" if worker.local_size == 1 else \
            f"nodes (switch workers; {worker.world_size} ranks in nodes of {worker.local_size})"
        raise NetaggError(f"rank {worker.rank}, job {worker.job}: a fabric's job holds at most "
                          f"{W.MAX_DATA_COUNT} ranks (a result's count is 6 bits: a spine's "
                          f"would wrap), not {worker.nodes} {what}")
    where = Placement.of(worker.rank, worker.world_size, len(fabric.leaves), worker.local_size)
    named = where.leaf if switch is None else fabric.leaf_named(switch)
    if named != where.leaf:
        node = "" if worker.local_size == 1 else f" (node {where.rank})"
        raise NetaggError(f"rank {worker.rank}{node} of {worker.world_size} sits on "
                          f"{fabric.leaves[where.leaf].name} ({fabric.leaves[where.leaf].url}) "
                          f"by the fabric's placement, not on {switch!r}")
    leaf = fabric.leaves[where.leaf]
    j = worker.switch_job                   # the job's + the local rank (hierarchical)
    ip = worker_ip(j, where.rank)
    transport = fabric.transport(leaf, ip, paths=paths, bind=bind)
    if faults:
        transport = LossyTransport(transport, **faults)
    worker.transport, worker.placement, worker.fabric = transport, where, fabric
    quorums = FabricQuorum.of(quorum, where.world, len(fabric.leaves))    # of nodes, hier.
    engine = FabricEngine(transport, placement=where, leaves=[lf.name for lf in fabric.leaves],
                          job=j, qpn=qpn, timeout=worker.timeout, spray=spray,
                          quorums=quorums, recovery=worker.recovery)
    worker.engine = engine
    p = read_params(engine.control)
    at = where.me(leaf.name)
    if worker.job >= p["jobs"]:
        raise NetaggError(f"{at}: {leaf.name} has jobs 0..{p['jobs'] - 1}, not job {worker.job}")
    # Hierarchical: one local worker per switch job takes part, as far as the leaf has jobs
    worker.leaders = min(worker.local_size, p["jobs"] - worker.job)
    if where.local_rank >= worker.leaders:
        return False
    if where.leaf_workers > p["max_workers"]:
        raise NetaggError(f"{at}: {leaf.name} takes at most {p['max_workers']} workers per job,"
                          f" not {where.leaf_workers}")
    [(_, uplinks)] = engine.control.request([(R.REG_UPLINKS, 0)])
    if uplinks != len(fabric.spines):
        raise NetaggError(f"{at}: {leaf.name} ({leaf.url}) has {uplinks} uplinks, the fabric "
                          f"{len(fabric.spines)} spines" + (": it is not a leaf (a switch "
                                                           "without uplinks: a board, the RTL)"
                                                           if uplinks == 0 else ""))
    worker.lanes = engine.lanes = min(W.MAX_PAYLOAD, p["max_payload"]) // 4 - 1
    if p["ip"] == "0.0.0.0":        # a board's leaf not yet addressed: the description's
        worker.write_registers([(R.REG_IP, W.ip_to_int(leaf.ip)), (R.REG_MAC_HI, leaf.mac >> 32),
                       (R.REG_MAC_LO, leaf.mac & 0xFFFFFFFF)])
        p["ip"] = leaf.ip
    _check_leaf(engine.control, leaf, p, at)
    worker.switch_params = p
    transport.attach_switch(p["ports"], p["port"])
    transport.result_source = W.Endpoint(p["ip"], p["udp_sport"])
    for lf, other in enumerate(fabric.leaves):
        if lf != where.leaf:
            ranks = Placement.ranks_of(lf, where.world, len(fabric.leaves))
            engine.liveness.add_leaf(lf, other.name, ranks.start, len(ranks),
                                     _channel(worker, fabric, other, ip, LEAF_PORTS + lf))
    base, count = slot_range(p, j, slots, slot_base, where.local_rank)
    r = where.leaf_rank
    entry = W.entry_records(j, r, transport.switch_port, transport.local, engine.qpn)
    setup = JobSetup(engine.control, j, r, where.leaf_workers, worker.session, entry,
                     p["jobs"], p["slots"], switch=leaf.name)
    if r != 0:
        engine.joined = False
        engine.join_check = setup.rank_check(credits, quorums.local[where.leaf],
                                             worker.deadline_ticks)
        return True
    credits = count if credits is None else credits
    if credits > 0xFFFF:
        raise NetaggError(f"{at}: {credits} credits do not fit in JOB_CREDITS (16 bits)")
    spines: list[ControlChannel] = []
    try:
        for s, spine in enumerate(fabric.spines):
            spines.append(_channel(worker, fabric, spine, ip, SPINE_PORTS + s))
        if where.rank == 0:         # the world's rank 0, or node 0's leader of this job
            epoch = fresh_epoch()
            _claim_spines(worker, fabric, spines, base, count, epoch)
        else:
            epoch = _spines_epoch(worker, fabric, spines, at)
    finally:
        for channel in spines:
            channel.transport.close()
    keys = JobKeys.derive(worker.session, j, epoch)
    setup.base, setup.count, setup.credits = base, count, credits
    setup.quorum, setup.deadline = quorums.local[where.leaf], worker.deadline_ticks
    setup.epoch = epoch
    setup.parent = R.PARENT.pack(enable=1, rank=where.leaf)
    setup.extra = [(R.job_reg(j, R.JOB_PARENT_KEY), keys.key),
                   (R.job_reg(j, R.JOB_SPRAY), spray_all(len(fabric.spines)))]
    keys = setup.claim()
    engine.set_job(count, credits, quorums.local[where.leaf], keys=keys)
    return True


UPLINK_FIELDS = {R.UPLINK_PORT: "UPLINK_PORT", R.UPLINK_MAC_HI: "UPLINK_MAC_HI",
                 R.UPLINK_MAC_LO: "UPLINK_MAC_LO", R.UPLINK_IP: "UPLINK_IP",
                 R.UPLINK_UDP_PORT: "UPLINK_UDP_PORT"}


def _check_leaf(control: ControlChannel, leaf, p: dict, at: str):
    """The leaf holds the description's REG_IP and uplink table (uplink i: the port it leaves
    by, spine i's MAC, IPv4 address and UDP port), or a NetaggError names the leaf and the
    register: a leaf cabled otherwise would drop the spines' frames, and the run time out."""
    if p["ip"] != leaf.ip:
        raise NetaggError(f"{at}: {leaf.name} ({leaf.url}) holds REG_IP {p['ip']}, the "
                          f"fabric's description {leaf.ip}")
    reads = [(R.uplink_reg(u.uplink, f), 0) for u in leaf.uplinks for f in UPLINK_FIELDS]
    values = iter(v for _, v in control.request(reads))
    for u in leaf.uplinks:
        held = {f: next(values) for f in UPLINK_FIELDS}
        described = {R.UPLINK_PORT: u.port, R.UPLINK_MAC_HI: u.mac >> 32,
                     R.UPLINK_MAC_LO: u.mac & 0xFFFFFFFF, R.UPLINK_IP: W.ip_to_int(u.ip),
                     R.UPLINK_UDP_PORT: u.udp_port}
        for f, name in UPLINK_FIELDS.items():
            if held[f] != described[f]:
                show = ip_str if f == R.UPLINK_IP else hex
                raise NetaggError(f"{at}: {leaf.name} ({leaf.url}) holds {name} "
                                  f"{show(held[f])} of uplink {u.uplink} (to {u.spine}), the "
                                  f"fabric's description {show(described[f])}")


SPINE_PORTS = W.ROCEV2_PORT + 1                 # in process: a worker's UDP port to spine s
LEAF_PORTS = SPINE_PORTS + R.MAX_UPLINKS        # and to leaf l (its beats)


def _channel(worker, fabric: Fabric, switch, ip: str, udp_port: int) -> ControlChannel:
    """A control channel of the worker's own to another switch of the fabric (UDP from its
    address, or in process from its IPv4 address and UDP port `udp_port`)."""
    transport = fabric.transport(switch, ip, udp_port=udp_port,
                                 bind=worker.transport.local.ip
                                 if switch.url.startswith("udp://") else None)
    return ControlChannel(transport, timeout=worker.timeout)


def _claim_spines(worker, fabric: Fabric, spines: list[ControlChannel], base: int, count: int,
                  epoch: int):
    """The world's rank 0 configures every spine's job in turn; a spine that refuses leaves
    none claimed: the jobs of the spines before it are disabled again (as their owner may),
    and the error names the spine and why."""
    for s, channel in enumerate(spines):
        try:
            _claim_spine(worker, fabric, s, channel, base, count, epoch)
        except NetaggError as e:
            released = _release(worker.switch_job, fabric, spines[:s])
            raise NetaggError(f"{first_rank(worker.placement)}: {e}"
                              + (f"; the jobs it had claimed at {released} are disabled again"
                                 if released else "")) from e


def first_rank(placement: Placement) -> str:
    """The rank that configures the spines' job of `placement`'s switch job, for errors: the
    world's rank 0, or (hierarchical) node 0's local worker of that job."""
    if placement.local_size == 1:
        return "rank 0"
    return f"rank {placement.world_rank(0)} (node 0)"


def _release(job: int, fabric: Fabric, channels: list[ControlChannel]) -> str:
    """Disable `job` at the fabric's first `len(channels)` spines, through `channels` (their
    owner's CONFIG write); their names, each that refused or did not answer noted."""
    names = []
    for s, channel in enumerate(channels):
        name = fabric.spines[s].name
        try:
            [(_, config)] = channel.request([(R.job_reg(job, R.JOB_CONFIG) | R.WRITE, 0)])
            names.append(name if not config >> 31 else f"{name} (refused)")
        except NetaggError:
            names.append(f"{name} (no answer)")
    return ", ".join(names)


def _claim_spine(worker, fabric: Fabric, s: int, channel: ControlChannel, base: int,
                 count: int, epoch: int):
    """The world's rank 0 configures spine `s`'s job: the leaves as its ranks."""
    spine, j = fabric.spines[s], worker.switch_job
    p = read_params(channel)
    if j >= p["jobs"]:
        raise NetaggError(f"{spine.name} ({spine.url}) has jobs 0..{p['jobs'] - 1}, not job {j}")
    if p["ip"] != spine.ip:
        raise NetaggError(f"{spine.name} ({spine.url}) holds REG_IP {p['ip']}, the "
                          f"fabric's description {spine.ip}")
    if len(fabric.leaves) > p["max_workers"]:
        raise NetaggError(f"{spine.name} takes at most {p['max_workers']} leaves per "
                          f"job, not {len(fabric.leaves)}")
    entries = [record for lf, leaf in enumerate(fabric.leaves)
               for record in W.entry_records(j, lf, spine.leaf_ports[lf],
                                             W.Endpoint(leaf.ip, W.ROCEV2_PORT, leaf.mac),
                                             W.UPLINK_QPN)]
    setup = JobSetup(channel, j, 0, len(fabric.leaves), worker.session, entries, p["jobs"],
                     p["slots"], base=base, count=count, credits=0, epoch=epoch,
                     partials=True, switch=spine.name)
    setup.claim()


def _spines_epoch(worker, fabric: Fabric, spines: list[ControlChannel], at: str) -> int:
    """A leaf's first rank: the epoch every spine's job was configured with by this run's
    rank 0 (waiting up to the worker's timeout). The spines' one epoch, with their R_Keys the
    session's KEY of it, is this run's once the world's rank 0 is seen beating with it: its
    BEAT in leaf 0 carries the epoch's mark (`host.liveness`) and its count moves between two
    reads. An earlier run of the same session left its spines with its own epoch, but its
    rank 0's beat stands still (its process is gone); this run's rank 0 beats with the mark
    only after it configured every spine with its fresh epoch."""
    j, first = worker.switch_job, first_rank(worker.placement)
    reads = [(R.job_reg(j, R.JOB_CONFIG), 0), (R.job_reg(j, R.JOB_EPOCH), 0),
             (R.worker_reg(j, 0, R.WORKER_RKEY), 0)]
    leaf0 = next(w.control for w in worker.engine.liveness.watches if w.leaf == 0)
    deadline = time.monotonic() + worker.timeout
    waiting = "no answer"
    beat = None                         # rank 0's beat in leaf 0 with the spines' epoch's mark
    while True:
        epochs = set()
        for s, channel in enumerate(spines):
            cfg, epoch, rkey = (v for _, v in channel.request(reads))
            fields = R.CONFIG.unpack(cfg)
            if not fields["enable"] or not fields["partials"] or \
                    rkey != JobKeys.derive(worker.session, j, epoch).key:
                waiting = (f"{fabric.spines[s].name}'s job {j} was not configured for this "
                           f"run by {first}")
                break
            epochs.add(epoch)
        else:
            if len(epochs) == 1:
                epoch = next(iter(epochs))
                mark = JobKeys.derive(worker.session, j, epoch).tag & MARK or 1
                [(_, now)] = leaf0.request([(R.beat_reg(j, 0), 0)])
                if now >> COUNT_BITS != mark:
                    beat = None
                    waiting = (f"the spines hold epoch {epoch:#010x}, but {first} does not "
                               f"beat with it in {fabric.leaves[0].name} (an earlier run's "
                               f"configuration, this run's {first} not yet there)")
                elif beat is not None and beat != now:
                    return epoch
                else:
                    beat = now
                    waiting = (f"{first}'s heartbeat in {fabric.leaves[0].name} does not "
                               f"move (an earlier run's {first}, gone)")
            else:
                waiting = "the spines' jobs hold different epochs"
        if time.monotonic() > deadline:
            raise NetaggError(f"{at}: waited {worker.timeout:.0f} s for the spines: {waiting}")
        time.sleep(0.02)
