"""The "netagg" backend of torch.distributed: all_reduce through the switch, the rest by gloo.

    import torch.distributed as dist
    import netagg.host.torch_backend                   # registers the backend "netagg"
    dist.init_process_group("netagg")           # under torchrun; NETAGG_SWITCH=udp://...

Set-up (`init_process_group`, through torch's plugin interface): the rank and world size are
torch's (torchrun's RANK and WORLD_SIZE); the switch is `NetaggOptions.switch` when
`pg_options=NetaggOptions(...)` is given, else `NETAGG_SWITCH`, else rank 0's; the session
is a new one that rank 0 draws (`secrets.token_hex`: the run's secret, from which the
job's key comes, `host.session`) and the others read from torch's store (so every process
of a run agrees on it, no two runs share one, and no process outside the run can guess
it); with LOCAL_WORLD_SIZE > 1 and the ranks of a
node consecutive (torchrun's numbering) the worker is hierarchical, `local_size` =
LOCAL_WORLD_SIZE (the node's processes add their tensors in shared memory first, and each
carries one share of the node's sum to the switch). `NETAGG_BIND` (or
`NetaggOptions.bind`) names the address to send from. A gloo group over the same store
starts beside the worker.

A leaf and spine fabric (`NetaggOptions.fabric` or `NETAGG_FABRIC`: its description, JSON or
a file's path, `host.fabric`): rank 0's description goes to every rank through torch's store
(another rank's own, if it has one, must be the same), and each rank joins at its leaf
(`NETAGG_SWITCH`, if set, names it; by default the leaf its node sits on), flat or
hierarchical alike (`host.fabric_setup`).

Collectives: `all_reduce` of what `host.torch_tensors.switch_op` accepts (SUM of int32, SUM
and AVG of float32, float16 and bfloat16 tensors, on the CPU or on one CUDA device) goes
through the switch, with the worker's default priority and no loss budget
(`host.torch_hook` sets them per gradient for DDP); CUDA tensors through pinned host
memory, chunk by chunk (`host.torch_staging`, one ring and pair of side streams per
device). Every other all_reduce, and every other collective (broadcast, barrier,
all_gather, reduce, scatter, send/recv...), is gloo's, CPU and CUDA tensors alike: the group
hands them to its gloo backend (registered for both devices), which copies CUDA tensors
through host memory itself where it implements the collective for CUDA (broadcast,
all_reduce, reduce, all_gather, gather, scatter, all_to_all) and refuses them with its own
error where it does not. send, recv and all_reduce_coalesced of CUDA tensors are refused
here, naming the device: gloo would hand their device addresses to its transport as host
memory (a recv from any source, which torch does not hand to Python, is not caught: copy
to the CPU first). An all_reduce neither takes (AVG of other dtypes, PREMUL_SUM) is an
error naming the rank, dtype, op and device (`host.torch_tensors.refusal`). Only the default
group uses the switch (its jobs from `NetaggOptions.job`); a group made later with
`new_group(backend="netagg")` is gloo alone.

What differs from gloo: floats are summed in fixed point (within `host.numerics`'s bound,
not bit for bit gloo's), NaN and infinities as IEEE sums them (`host.nonfinite`: an inf on
one rank is an inf on every rank, so GradScaler skips the step on all of them); an int32
sum that overflows is an error, not a wrapped value; every failure is an error that names
the rank and the job, within the worker's timeout (`NetaggOptions.timeout`, default the
smaller of the group's timeout and 60 s).

Cost: per process, the worker (a UDP socket and its progress thread), a completion thread
(`host.torch_work`) and the gloo group's connections; a contiguous CPU tensor is read and
written in place (its result is the worker's `out`), a non-contiguous one copied each way;
with CUDA tensors, per device, two streams and `NetaggOptions.staging_bytes` x 3 of pinned
host memory (`host.torch_staging`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import secrets
import warnings

import torch
import torch.distributed as dist

from netagg.host import numerics as N
from netagg.host import torch_staging
from netagg.host.errors import NetaggError
from netagg.host.torch_tensors import as_array, in_place_outs, refusal, store_result, switch_op
from netagg.host.torch_work import Completer, Done, NetaggWork, Pending
from netagg.host.worker import Worker, deadline_ticks, per_tensor

BACKEND = "netagg"
MAX_WORKER_TIMEOUT = 60.0       # seconds without progress before an allreduce fails
SESSION_KEY, SWITCH_KEY, FABRIC_KEY = "netagg/session", "netagg/switch", "netagg/fabric"


@dataclasses.dataclass
class NetaggOptions:
    """`dist.init_process_group("netagg", pg_options=NetaggOptions(...))`: the switch
    (`udp://host:port`; default NETAGG_SWITCH), the local address to send from (default
    NETAGG_BIND, else the kernel's route), the worker's timeout in seconds, its first switch
    job, whether LOCAL_WORLD_SIZE > 1 makes it hierarchical, the job's deadline in seconds
    (`Worker`'s: 0, none), a leaf and spine fabric's description (default NETAGG_FABRIC:
    JSON, or a file's path; `switch` then names this rank's leaf, by default its node's), and
    the source ports to spray over (`Worker`'s `paths`; default NETAGG_PATHS, else 1: more
    than one where a network sprays packets, whose answers then come back out of order),
    and the bytes of each of the 3 pinned host buffers CUDA tensors are staged through."""

    switch: str | None = None
    bind: str | None = None
    timeout: float | None = None
    job: int = 0
    hierarchical: bool = True
    deadline: float = 0.0
    fabric: str | None = None
    paths: int | None = None
    staging_bytes: int = torch_staging.CHUNK_BYTES


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where this process is: its rank among `world_size`, and `local_size` processes per
    node (1: flat)."""

    rank: int
    world_size: int
    local_size: int


def placement(rank: int, world_size: int, hierarchical: bool = True) -> Placement:
    """torchrun's LOCAL_WORLD_SIZE and LOCAL_RANK, when they describe nodes of consecutive
    ranks that the world is a whole number of; flat otherwise."""
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not hierarchical or local_size <= 1:
        return Placement(rank, world_size, 1)
    if world_size % local_size or rank % local_size != local_rank:
        warnings.warn(f"netagg: rank {rank} is local rank {local_rank} of {local_size} in a "
                      f"world of {world_size}, not torchrun's consecutive numbering: flat "
                      f"allreduce", stacklevel=2)
        return Placement(rank, world_size, 1)
    return Placement(rank, world_size, local_size)


def _agree(store, rank: int, key: str, mine: str | None, what: str) -> str:
    """Rank 0's value of `key` (its own `mine`, published); another rank's `mine` must match."""
    if rank == 0:
        if not mine:
            raise NetaggError(f"netagg rank 0: no {what}: set NETAGG_SWITCH=udp://HOST:PORT "
                              f"or pass pg_options=NetaggOptions(switch=...)")
        store.set(key, mine)
        return mine
    theirs = store.get(key).decode()
    if mine and mine != theirs:
        raise NetaggError(f"netagg rank {rank}: {what} {mine}, but rank 0 uses {theirs}")
    return theirs


def _fabric(store, rank: int, described: str | None) -> dict | None:
    """The run's fabric: rank 0's description (`described`: JSON or a file's path), which it
    publishes; another rank takes it from the store (its own, if any, must be the same). None
    when rank 0 has none: one switch."""
    from netagg.host.fabric import Fabric
    mine = None if not described else json.dumps(Fabric.load(described).to_dict(),
                                                  sort_keys=True)
    if rank == 0:
        store.set(FABRIC_KEY, mine or "")
        return None if mine is None else json.loads(mine)
    theirs = store.get(FABRIC_KEY).decode()
    if mine and mine != theirs:
        raise NetaggError(f"netagg rank {rank}: its fabric's description is not rank 0's"
                          + ("" if theirs else " (rank 0 has none: one switch)"))
    return json.loads(theirs) if theirs else None


def _by_gloo(name: str, host_only: bool = False):
    """A collective of torch's Python trampoline (`PyProcessGroup`) that goes to gloo. Left
    to the base class, the trampoline would call gloo holding the GIL, and gloo's own thread,
    freeing an earlier Work's Python tensors, waits for the GIL while holding the lock gloo's
    `enqueue` needs: a deadlock. Called from here, gloo's binding releases the GIL first.
    `host_only`: gloo hands the tensors' addresses to its transport as host memory (send,
    recv, allreduce_coalesced), so a tensor elsewhere (CUDA) is refused, naming it."""
    def collective(self, *args, **kwargs):
        if host_only:
            elsewhere = sorted({str(t.device) for t in args[0] if t.device.type != "cpu"})
            if elsewhere:
                raise NetaggError(f"netagg rank {self.rank()}: {name} of tensors on "
                                  f"{', '.join(elsewhere)}: gloo's {name} reads and writes "
                                  f"host memory only; copy them to the CPU first")
        return getattr(self.gloo, name)(*args, **kwargs)
    collective.__name__ = collective.__qualname__ = name
    return collective


class NetaggProcessGroup(dist.ProcessGroup):
    """A torch process group whose all_reduce goes through a netagg switch when it can."""

    def __init__(self, store, rank: int, world_size: int, timeout: datetime.timedelta,
                 options: NetaggOptions | None = None, uses_switch: bool = True):
        super().__init__(rank, world_size)
        options = options or NetaggOptions()
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size,
                                          timeout)
        for device in ("cpu", "cuda"):      # what the trampoline leaves to torch: gloo's
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO,
                                   self.gloo)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self.worker = self.completer = None
        self.staging_bytes = options.staging_bytes
        # the device CUDA tensors are staged through (tests put a CPU stand-in here)
        self.staging_device = torch_staging.device_for
        self.staging: dict[str, torch_staging.Staging] = {}
        if not uses_switch:
            return
        seconds = min(timeout.total_seconds(), MAX_WORKER_TIMEOUT) if options.timeout is None \
            else options.timeout
        switch = options.switch or os.environ.get("NETAGG_SWITCH") or None
        fabric = _fabric(store, rank, options.fabric or os.environ.get("NETAGG_FABRIC"))
        if fabric is None:
            switch = _agree(store, rank, SWITCH_KEY, switch, "switch")
        session = _agree(store, rank, SESSION_KEY, f"torch-{secrets.token_hex(16)}"
                         if rank == 0 else None, "session")
        self.placement = placement(rank, world_size, options.hierarchical)
        self.where = f"netagg rank {rank} of {world_size}, job {options.job}"   # not the secret
        deadline_ticks(options.deadline)        # a bad deadline is the caller's, not the network's
        try:
            self.worker = Worker(rank, world_size, switch, options.job, session=session,
                                 local_size=self.placement.local_size, timeout=seconds,
                                 bind=options.bind or os.environ.get("NETAGG_BIND"),
                                 deadline=options.deadline, fabric=fabric,
                                 paths=options.paths or int(os.environ.get("NETAGG_PATHS", "1")))
        except Exception as e:
            place = f"switch {switch}" if fabric is None else \
                f"the fabric at {switch or 'its leaf'}"
            raise NetaggError(f"{self.where}: cannot join {place}: "
                              f"{type(e).__name__}: {e}") from e
        self.completer = Completer(self.where, seconds)

    def getBackendName(self) -> str:
        return BACKEND

    # every collective the trampoline dispatches to Python but the switch's all_reduce
    # (the others, reduce, gather, scatter, all_to_all..., torch sends to gloo itself)
    allgather = _by_gloo("allgather")
    allreduce_coalesced = _by_gloo("allreduce_coalesced", host_only=True)
    alltoall_base = _by_gloo("alltoall_base")
    barrier = _by_gloo("barrier")
    broadcast = _by_gloo("broadcast")
    reduce_scatter = _by_gloo("reduce_scatter")
    send = _by_gloo("send", host_only=True)
    recv = _by_gloo("recv", host_only=True)

    # --- all_reduce ---------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        opts = dist.AllreduceOptions() if opts is None else opts
        op = switch_op(tensors, opts.reduceOp) if self.worker is not None else None
        if op is None:
            refused = refusal(tensors, opts.reduceOp)
            if refused:
                raise NetaggError(f"netagg rank {self.rank()}: {refused}")
            return self.gloo.allreduce(tensors, opts)
        return NetaggWork(self.switch_allreduce(tensors, op.op))

    def switch_allreduce(self, tensors, op: str, loss_budget=0.0,
                         priority=None) -> torch.futures.Future:
        """Allreduce `tensors` (which `switch_op` accepts) through the switch, in place;
        `loss_budget` and `priority` as for `Worker.allreduce`, one value or one per tensor.
        The future's value is the list of tensors; its error names this rank and job."""
        if self.worker is None:
            raise NetaggError(f"netagg rank {self.rank()}: this group does not use the switch")
        accepted = switch_op(tensors, dist.ReduceOp.SUM)
        if accepted is None:
            raise NetaggError(f"{self.where}: the switch does not take all_reduce of "
                              f"{[str(t.dtype) for t in tensors]} on "
                              f"{sorted({str(t.device) for t in tensors})}")
        staging = self._staging(tensors[0].device)
        if staging is not None:
            return self._staged_allreduce(staging, tensors, op, accepted.dtype, loss_budget,
                                          priority)
        if tensors[0].device.type != "cpu":
            raise NetaggError(f"{self.where}: no staging for {tensors[0].device}")
        dtype = accepted.dtype
        arrays = [as_array(t) for t in tensors]
        outs = in_place_outs(tensors, arrays)

        def start():
            return self.worker.allreduce_async(arrays, op, dtype, loss_budget=loss_budget,
                                               priority=priority, out=outs)

        def finish(results):
            return [t if o is not None else store_result(t, r)
                    for t, r, o in zip(tensors, results, outs)]

        # flat: sent now, the completer only waits; hierarchical: one step at a time, on
        # the completer's thread
        return self.completer.submit(Pending(torch.futures.Future(), finish, start=start),
                                     now=self.placement.local_size == 1)

    def _staging(self, device: torch.device) -> torch_staging.Staging | None:
        """This group's staging for tensors on `device` (made on first use), None when
        they need none (CPU tensors)."""
        key = str(device)
        if key not in self.staging:
            staged = self.staging_device(device)
            if staged is None:
                return None
            # cut at blocks of the packet's full lanes: every local worker of a node (a
            # hierarchical step's leaders, which read the switch's lanes, and the others
            # alike) plans the same chunks
            self.staging[key] = torch_staging.Staging(
                staged, N.LANES * self.worker.block, self.staging_bytes)
        return self.staging[key]

    def _staged_allreduce(self, staging: torch_staging.Staging, tensors, op: str, dtype: str,
                          loss_budget, priority) -> torch.futures.Future:
        """Allreduce device `tensors` through `staging`, chunk by chunk on the completer's
        thread; each piece of a tensor has the tensor's loss budget and priority."""
        n = len(tensors)
        budgets = per_tensor(loss_budget, n, "loss_budget")
        priorities = None if priority is None else per_tensor(priority, n, "priority")
        staged = staging.prepare(tensors)       # after the caller's stream, on its thread

        def chunk(arrays, pieces):
            return self.worker.allreduce_async(
                arrays, op, dtype, loss_budget=[budgets[p.tensor] for p in pieces],
                priority=None if priorities is None else [priorities[p.tensor] for p in pieces],
                out=arrays)

        def start():
            return Done(staging.run(staged, chunk, self.completer.timeout))

        pending = Pending(staging.device.future(), lambda tensors: tensors, start=start,
                          complete=staging.complete)
        return self.completer.submit(pending)

    def counters(self) -> dict:
        """The worker's counters (packets and bytes sent...), {} when it has none."""
        return self.worker.counters() if self.worker is not None else {}

    # --- shutting down ------------------------------------------------------------------

    def shutdown(self):
        if self.completer is not None:
            self.completer.close()
        if self.worker is not None:
            self.worker.close()
        self.worker = self.completer = None

    def abort(self):
        self.shutdown()



def _create(backend_opts, options) -> NetaggProcessGroup:
    if options is not None and not isinstance(options, NetaggOptions):
        raise TypeError(f"netagg takes pg_options=NetaggOptions(...), not {type(options)}")
    return NetaggProcessGroup(backend_opts.store, backend_opts.group_rank,
                              backend_opts.group_size, backend_opts.timeout, options,
                              uses_switch=not dist.is_initialized())   # the default group


dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
