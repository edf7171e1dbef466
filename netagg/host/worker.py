"""The worker API, in the style of torch.distributed.

    from netagg.host import Worker
    w = Worker(rank, world_size, switch="udp://127.0.0.1:4791", session="run-42")
    total = w.allreduce(gradient)                  # blocking, returns a new array
    h = w.allreduce_async([g1, g2], op="mean")     # several tensors in one step
    g1_mean, g2_mean = h.wait()

`switch` is a `udp://host:port` address (a board, `netagg sim board` or `netagg sim serve`;
`bind=` names the local IPv4 address to send from, by default the one the kernel routes the
switch by), a backend object (`send(port, frame)` / `run()`, e.g. `sim.golden.GoldenSwitch`)
for in-process workers, or a `host.transport.Transport`.

Set-up adapts to the switch, whose parameters it reads through the control path: packets
carry the switch's largest payload (at most 1024 bytes), the worker's job-table entry holds
its real address (the MAC of the interface that holds its IPv4 address, its UDP port, the
switch port its requests come in by as the switch reports it (REG_PORT), a queue pair number
of its own), and when the switch's own IPv4 address is unset, a worker sets it to the
address it reaches the switch at (results leave from there). Every worker of a run must
pass the same `session` (a string, like torch's rendezvous id, best a random one: it is the
run's secret): rank 0 resets the job for the run, draws its epoch and writes the job's key
and every rank's R_Key from the session and the epoch (`host.session`); the other ranks
wait until they read an epoch whose R_Key is their session's before they send anything,
then derive the key. Contributions carry the key, so nothing an earlier run left in the
switch or still sends can mix into this one.
The job is then rank 0's address's (`host.job_setup`): the switch refuses writes to it from
any other (but the switch's manager, and each rank for its own entry, which it writes once
rank 0 has configured the job). A job another address owns, or a slot range that overlaps
another enabled job's, is a `NetaggError` at once, naming it.

Flat (`local_size=1`): switch job `job`, switch rank `rank`, `world_size` workers.

Hierarchical (`local_size=L`, ranks `node * L + local_rank`): the L workers of a node share
their tensors through shared memory; local worker i contributes, for its shard i of every
tensor, the node's sum of that shard to switch job `job + i` as rank `node` (so a hierarchical
run uses jobs job .. job + L - 1, each with `world_size / L` workers, and every local worker
uses the network); the results are shared back through the same memory. A switch with fewer
jobs (G = jobs - job < L) takes the first G local workers of each node as leaders, the
shards cut G ways; with one job, local worker 0 alone carries the node's sums. Shards are whole
exponent blocks, and a node proposes the maximum exponent of its local workers, so the
answer is bit for bit the flat allreduce's. Across a leaf and spine fabric (`fabric=`:
`host.fabric_setup`) the same: the nodes sit on the leaves, and local worker i is its node in
switch job `job + i` at its leaf and every spine.

Spraying (`paths=N`, `spray="round_robin"` or `"least_loaded"`): the worker sends its
contributions from N UDP source ports (other sockets of its address; results still come back
to the first), each packet by the path the engine picks; see `host.transport`.

Loss recovery (`recovery=`): a packet is sent again when a packet sent after it was answered
or when the tail of those in flight goes unanswered (`Recovery.EARLY`, the default), or at
its timeout; `Recovery.TIMERS` (or "timers") waits for the timeouts alone. The rules are in
`host.retransmit`.

A worker over UDP makes progress in the background (`host.progress`): `allreduce_async`
sends at once and the allreduce completes while the caller computes; `wait` only waits.
In-process workers of one backend run cooperatively: `allreduce_async` on each, then `wait`
on the handles; waiting drives every worker of that backend. They may also run in threads.

Credits and quorum (`credits=`, `quorum=`, set by rank 0 for the job, read by the others): a
worker opens at most `credits` uses of the job's slots beyond those completed (default: the
job's slot count; 0: no limit), and a use completes with `quorum` contributions (default 0:
all workers; the late ones get the result when theirs arrives; in a fabric, at least `quorum`
of the world's ranks, each leaf closing at its share: `host.fabric_quorum`). A use still
open `deadline` seconds after it began (at most 1 s; default 0: none, every use waits for
every rank, and a dead one is named, `host.liveness`) is closed by the switch at the next
retransmission into it, with the contributions it has, as a quorum would: with a loss
budget that allows it, the job goes on without a dead or stalled rank, its sums scaled (a
rank that falls behind by more than a use of a slot is left behind: its contributions are
stale).

Loss tolerance (`allreduce(..., loss_budget=0.02, priority=3)`, a value or one per tensor):
each worker may let the switch drop (as null contributions, under congestion) up to
`loss_budget` of the data chunks of each float tensor, its smallest, sent in priority classes
below the tensor's `priority` (0..7); a sum missing contributions is scaled up to the world's
(the mean of those present stands for the missing). With loss_budget 0 (the default) every
sum is exact, quorum or not. The rules are in `host.messages` and `host.checklane`;
`Handle.stats()` counts, per tensor, what was dropped and scaled.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time

import numpy as np

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import compiled, netif
from netagg.host import numerics as N
from netagg.host import transport as T
from netagg.host.control import SwitchControl, make_transport, read_params
from netagg.host.engine import Engine
from netagg.host.errors import NetaggError, NetaggTimeout, NetaggUnreachable
from netagg.host.fabric_setup import fabric_worker
from netagg.host.hierarchical import Handle, hierarchical
from netagg.host.job_setup import JobSetup, slot_range
from netagg.host.lossy import LossyTransport
from netagg.host.messages import DEFAULT_PRIORITY, Work
from netagg.host.outputs import outputs, racing
from netagg.host.progress import Progress
from netagg.host.retransmit import Recovery

__all__ = ["Worker", "Handle", "SwitchControl", "NetaggError", "NetaggTimeout"]


def deadline_ticks(seconds: float) -> int:
    """A job's DEADLINE register for a deadline of `seconds` (0: none), at most 1 s
    (`netagg.contract.regmap.MAX_DEADLINE`: a longer one may never be hit by a retransmission)."""
    ticks = math.ceil(seconds / R.TICK_SECONDS)
    if not 0 <= ticks <= R.MAX_DEADLINE:
        raise ValueError(f"deadline must be 0..{R.MAX_DEADLINE * R.TICK_SECONDS:g} s, not "
                         f"{seconds}")
    return ticks

def _queue_pair() -> int:
    """A queue pair number for a worker's endpoint, as a NIC allocates one: results name it,
    and a result for another is not this worker's. QP 0 and 1 are the SMI's and GSI's, and
    the switch's own are below 0x100."""
    return random.SystemRandom().randrange(0x100, 1 << 24)


def per_tensor(value, n: int, name: str) -> list:
    """One value per tensor: `value` itself when it is a list or tuple of n."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} values for {n} tensors")
        return list(value)
    return [value] * n


class Worker:
    def __init__(self, rank: int, world_size: int, switch="udp://127.0.0.1:4791", job: int = 0,
                 *, local_size: int = 1, session=None, slots: int | None = None,
                 slot_base: int | None = None, timeout: float = 20.0,
                 fraction_bits: int | None = None, block: int = N.DEFAULT_BLOCK,
                 faults: dict | None = None, paths: int = 1, spray: str = "round_robin",
                 credits: int | None = None, quorum: int = 0, bind: str | None = None,
                 deadline: float = 0.0, fabric=None, recovery: Recovery = Recovery.EARLY):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        if credits is not None and not 0 <= credits <= 0xFFFF:
            raise ValueError(f"credits must be 0..65535 (0: no limit), not {credits}")
        if not 0 <= quorum <= 63:
            raise ValueError(f"quorum must be 0..63 (0: all workers), not {quorum}")
        self.deadline_ticks = deadline_ticks(deadline)
        if local_size < 1 or world_size % local_size:
            raise ValueError(f"world_size {world_size} is not a multiple of local_size "
                             f"{local_size}")
        self.rank, self.world_size, self.local_size = rank, world_size, local_size
        self.node, self.local_rank = divmod(rank, local_size)
        self.nodes = world_size // local_size
        self.job = job
        self.switch_job = job + self.local_rank
        self.switch_rank = self.node
        self.switch_workers = self.nodes
        self.session = os.environ.get("NETAGG_SESSION", "default") if session is None \
            else session
        self.timeout = timeout
        self.recovery = Recovery(recovery)
        self.fraction_bits = N.fraction_bits(world_size) if fraction_bits is None \
            else fraction_bits
        self.block = block
        self.node_steps: list[Handle] = []  # hierarchical steps pending, in submission order
        self._in_flight = []        # flat works submitted, until done (`outputs.racing`)
        self._closed = False
        T.Sprayer(paths, spray)        # checks both before any socket opens
        self.fabric = self.placement = None
        self.engine = self.transport = self.progress = self.shm = None
        self.lanes = N.LANES
        qpn = _queue_pair()
        try:
            if fabric is not None:
                networked = fabric_worker(self, fabric, switch, slots=slots,
                                          slot_base=slot_base, credits=credits, quorum=quorum,
                                          paths=paths, spray=spray, bind=bind, faults=faults,
                                          qpn=qpn)
            else:
                networked = self._join(switch, slots, slot_base, credits, quorum, paths, spray,
                                       bind, faults, qpn)
        except NetaggUnreachable as e:      # (a send at set-up: the engine had no works)
            raise e.named(f"rank {self.rank} of job {self.job}") from e.__cause__
        if local_size > 1:
            from netagg.host.node import NodeShm
            try:
                self.shm = NodeShm(self.session, self.node, self.local_rank, local_size,
                                   timeout, job)
            except BaseException:
                self._close_network()
                raise
        if networked and self.transport.driver is not None:
            self.transport.driver.engines.append(self.engine)
        elif networked:
            self.progress = Progress(self.engine)   # the background progress of a UDP worker

    # --- set-up -------------------------------------------------------------------------

    def _join(self, switch, slots, slot_base, credits, quorum, paths, spray, bind, faults,
              qpn) -> bool:
        """Join the job at one switch: this worker's transport and engine, and the job's
        configuration (`_configure`); False for a local worker beyond the switch's jobs (it
        shares memory only, and holds neither)."""
        transport = make_transport(switch, T.worker_ip(self.switch_job, self.switch_rank),
                                   paths, bind)
        if faults:
            transport = LossyTransport(transport, **faults)
        self.transport = transport
        self.engine = Engine(transport, job=self.switch_job, rank=self.switch_rank,
                             workers=self.switch_workers, slots=None, qpn=qpn,
                             timeout=self.timeout, spray=spray, recovery=self.recovery)
        try:
            networked = self._configure(slots, slot_base, credits, quorum)
        except BaseException:
            self.transport.close()
            raise
        if not networked:
            transport.close()
            self.engine = None
        return networked

    def _close_network(self):
        if self.engine is not None:
            getattr(self.engine, "close", lambda: None)()   # a fabric's: its other channels
        if self.transport is not None:
            self.transport.close()

    def _configure(self, slots, slot_base, credits, quorum):
        e, t = self.engine, self.transport
        p = read_params(e.control)
        jobs = p["jobs"] - self.job
        if jobs < 1:
            raise NetaggError(f"the switch has jobs 0..{p['jobs'] - 1}, not job {self.job}")
        # Hierarchical: one local worker per switch job takes part in the network, as far
        # as the switch has jobs (at least the node's leader, local worker 0).
        self.leaders = min(self.local_size, jobs)
        if self.local_rank >= self.leaders:
            return False
        if self.switch_workers > p["max_workers"]:
            raise NetaggError(f"the switch takes at most {p['max_workers']} workers per job, "
                              f"not {self.switch_workers}")
        self.lanes = min(W.MAX_PAYLOAD, p["max_payload"]) // 4 - 1
        if self.lanes < 1:
            raise NetaggError(f"the switch takes {p['max_payload']}-byte payloads: too small "
                              f"for a data lane and the check lane")
        e.lanes = self.lanes
        if p["ip"] == "0.0.0.0":
            # the switch's own addresses are unset: results leave from the address the
            # workers reach it at (the MAC as the kernel resolved it, if it did)
            mac = netif.neighbour_mac(t.switch.ip)
            self.write_registers([(R.REG_IP, W.ip_to_int(t.switch.ip)),
                                  (R.REG_MAC_HI, mac >> 32), (R.REG_MAC_LO, mac & 0xFFFFFFFF)])
            p["ip"] = t.switch.ip
        self.switch_params = p
        t.attach_switch(p["ports"], p["port"])   # the port of its job-table entry
        t.result_source = W.Endpoint(p["ip"], p["udp_sport"])
        total_slots = p["slots"]
        base, count = slot_range(p, self.switch_job, slots, slot_base, self.local_rank)
        r, j = self.switch_rank, self.switch_job
        entry = W.entry_records(j, r, t.switch_port, t.local, e.qpn)
        setup = JobSetup(e.control, j, r, self.switch_workers, self.session, entry, p["jobs"],
                         total_slots)
        if r == 0:
            setup.base, setup.count = base, count
            setup.credits = count if credits is None else credits
            if setup.credits > 0xFFFF:
                raise NetaggError(f"{setup.credits} credits do not fit in JOB_CREDITS (16 "
                                  f"bits): pass credits=")
            setup.quorum, setup.deadline = quorum, self.deadline_ticks
            keys = setup.claim()
            e.set_job(count, setup.credits, quorum, keys=keys)
            return True
        e.joined = False
        e.join_check = setup.rank_check(credits, quorum, self.deadline_ticks)
        return True

    def write_registers(self, pairs):
        """Write the switch's registers (address, value pairs) by a control request; a value
        the switch did not keep is a `NetaggError`."""
        got = self.engine.control.request([(a | R.WRITE, v) for a, v in pairs])
        for (a, v), (_, back) in zip(pairs, got):
            if back != v & 0xFFFFFFFF:
                raise NetaggError(f"the switch kept {back:#x} at register {a:#x}, not {v:#x}")

    # --- allreduce ----------------------------------------------------------------------

    def allreduce(self, arrays, op: str = "sum", dtype=None, timeout: float | None = None, *,
                  loss_budget=0.0, priority=None, out=None):
        """Blocking allreduce of one array or a list of arrays; returns the results: new
        arrays, or `out`'s. `loss_budget` (fraction of a tensor's data chunks this worker may
        have dropped, 0 <= b < 1) and `priority` (class 0..7, default 4): one value, or one
        per tensor. `out`: arrays that receive the results, of the tensors' shapes and
        dtypes, C-contiguous; each may be its input itself (in place). An overlap with
        other memory of the call is a ValueError; a call waits first for the allreduces in
        flight that write what it reads or writes, or read what it writes (`host.outputs`)."""
        return self.allreduce_async(arrays, op, dtype, loss_budget=loss_budget,
                                    priority=priority, out=out).wait(timeout)

    def allreduce_async(self, arrays, op: str = "sum", dtype=None, *, loss_budget=0.0,
                        priority=None, out=None) -> Handle:
        """`allreduce`, started; `out` (in place: the input) is the handle's until `wait`."""
        if self._closed:
            raise NetaggError("this worker is closed")
        single = isinstance(arrays, np.ndarray) or not isinstance(arrays, (list, tuple))
        arrays = [np.asarray(arrays)] if single else [np.asarray(a) for a in arrays]
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', not {op!r}")
        fmts = [N.format_of(a, dtype) for a in arrays]
        for f in fmts:
            if op == "mean" and f.kind == "int":
                raise TypeError("the mean of int32 tensors is not an int32: use op='sum'")
        budgets = per_tensor(loss_budget, len(arrays), "loss_budget")
        priorities = per_tensor(DEFAULT_PRIORITY if priority is None else priority,
                                 len(arrays), "priority")
        for b, p, f in zip(budgets, priorities, fmts):
            if not 0.0 <= float(b) < 1.0:
                raise ValueError(f"loss_budget must be in [0, 1), not {b}")
            if b > 0 and f.kind == "int":
                raise ValueError("int32 sums are exact or nothing: loss_budget must be 0 for "
                                 "an int32 tensor")
            if int(p) != p or not 0 <= p < R.PRIORITY_CLASSES:
                raise ValueError(f"priority must be a class 0..{R.PRIORITY_CLASSES - 1}, "
                                 f"not {p}")
        loss = list(zip((float(b) for b in budgets), (int(p) for p in priorities)))
        outs = outputs(arrays, out, single)     # C order: reshape(-1) is a view
        if self.local_size == 1:
            self._in_flight = [w for w in self._in_flight if not w.done]
            earlier = racing(self._in_flight, arrays, outs)
            if earlier:                 # they write what this call reads, or the reverse
                self.wait_works(earlier, self.timeout)
            works = []
            for a, f, o, lp in zip(arrays, fmts, outs, loss):
                flat = np.ascontiguousarray(a).reshape(-1)
                if flat.size == 0:
                    continue
                works.append(self.make_work(f, [flat], o.reshape(-1), op == "mean",
                                            [self.proposals(flat, f)], lp))
            self.submit(works)
            self._in_flight += works
            return Handle(self, works, outs, single)
        while self.node_steps:          # one hierarchical step at a time: they share memory
            self.node_steps[0].wait()
        return self._hierarchical(arrays, fmts, outs, op == "mean", single, loss)

    def make_work(self, fmt, sources, out, mean, proposals,
                  loss=(0.0, DEFAULT_PRIORITY)) -> Work:
        """The work of one tensor: the sum of `sources` into `out`, its blocks' exponents the
        largest of the sources' `proposals` (fixed point), `loss`: (loss budget, priority)."""
        props = np.max(np.stack(proposals), axis=0) if fmt.kind == "fixed" else None
        return Work(fmt=fmt, sources=sources, out=out, n=len(out), world_size=self.world_size,
                    mean=mean, frac=self.fraction_bits, block=self.block, lanes=self.lanes,
                    proposals=props,
                    loss_budget=loss[0], priority=loss[1])

    def proposals(self, flat, fmt):
        """This worker's exponent proposal per block (`numerics.block_proposals`)."""
        if fmt.kind != "fixed":
            return None
        return compiled.block_proposals(flat, fmt, self.lanes * self.block)

    def _engine_lock(self):
        """What steps this worker's engine holds while it steps: the progress thread's lock,
        or the in-process hub's (any thread waiting on the hub may step every engine on it)."""
        if self.progress is not None:
            return self.progress.lock
        driver = self.transport.driver
        return driver.lock if driver is not None else contextlib.nullcontext()

    def submit(self, works):
        """Hand works to the engine; with background progress they are sent at once."""
        with self._engine_lock():
            for w in works:
                self.engine.submit(w)
            if self.progress is not None and self.engine.window is not None:
                try:
                    self.engine.window.lead(time.monotonic())
                except NetaggUnreachable as e:
                    raise self.engine.unreachable(e) from e.__cause__
        if self.progress is not None:
            self.progress.kick()

    def advance(self, timeout: float):
        """Make progress for up to `timeout` seconds: step the engine (or the in-process
        hub's engines); with background progress, only raise the engine's failure."""
        if self.progress is not None:       # the thread steps; a failure is raised here
            if self.engine.failed:
                raise self.engine.failed
            return
        if self.engine is None:
            time.sleep(min(timeout, 0.001))
            return
        driver = self.transport.driver
        if driver is not None:
            driver.drive()
            if self.engine.failed:
                raise self.engine.failed
            if timeout:
                time.sleep(0)
        else:
            self.engine.step(timeout)

    def wait_works(self, works, timeout):
        """Wait until `works` are done (`NetaggTimeout` after `timeout` seconds, None: no
        limit); the engine's failure is raised."""
        if self.progress is not None:
            if not self.progress.wait_for(lambda: all(w.done for w in works), timeout):
                raise NetaggTimeout(self._unfinished(timeout))
            if self.engine.failed and not all(w.done for w in works):
                raise self.engine.failed
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(w.done for w in works):
            if deadline is not None and time.monotonic() > deadline:
                raise NetaggTimeout(self._unfinished(timeout))
            self.advance(0.05)

    def _unfinished(self, timeout) -> str:
        """Why a wait for works ended: the time, and what the engine still waits for."""
        if self.engine is None:
            return f"allreduce not finished after {timeout} s: not joined"
        with self._engine_lock():
            return f"allreduce not finished after {timeout} s: {self.engine.stuck()}"

    # --- hierarchical -------------------------------------------------------------------

    def _hierarchical(self, arrays, fmts, outs, mean, single, loss) -> Handle:
        return hierarchical(self, arrays, fmts, outs, mean, single, loss)

    # --- the rest -----------------------------------------------------------------------

    def counters(self) -> dict:
        """This worker's counters: packets, retransmissions, bytes, ignored results..."""
        if self.engine is None:
            return {}
        with self._engine_lock():
            c = self.engine.counters()
        c["bad_packets"] = self.transport.bad
        c["stray_packets"] = getattr(self.transport, "stray", 0)
        runs = getattr(self.transport, "runs", None)
        if runs is not None:
            c["gso_runs"] = runs.runs           # runs of contributions sent in one call
        if isinstance(self.transport, LossyTransport):
            c.update({f"injected_{k}": v for k, v in self.transport.faults.items()})
        return c

    def close(self):
        if self._closed:
            return
        self._closed = True
        if self.progress is not None:
            self.progress.stop()
        driver = self.transport.driver
        if driver is not None and self.engine in driver.engines:
            driver.engines.remove(self.engine)
        if self.engine is not None:
            self.engine.liveness.closing()      # the others: this rank closed, not died
        getattr(self.engine, "close", lambda: None)()    # a fabric's: its other channels
        self.transport.close()
        if self.shm is not None:
            self.shm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
