"""One process of tests/test_torch.py's torchrun job: `init_process_group("netagg")` against
`netagg sim serve`, then all_reduce beside a gloo group, the fallbacks, the other
collectives and DDP, with and without the netagg hook. Each rank writes what it saw to
`<out>/rank<r>.json`; the test asserts on it. Inputs are drawn from the rank's seed, so every
rank can rebuild every rank's inputs and the exact sums. `--only-switch` (a fabric's run)
does the all_reduce beside gloo alone, and says where the rank ran (its leaf, its switch
job)."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from netagg.apps.torch_train import exit_now
from netagg.host import numerics as N
from netagg.host import torch_backend as tb
from netagg.host.torch_hook import register

VALUES = 5000          # 20 packets: more than one per hierarchical leader
FORMAT = {torch.float32: N.FLOAT32, torch.float16: N.FLOAT16, torch.bfloat16: N.BFLOAT16}


def inputs(rank: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype == torch.int32:
        return torch.randint(-(1 << 20), 1 << 20, (VALUES,), generator=g, dtype=torch.int32)
    scale = torch.logspace(-3, 3, VALUES, dtype=torch.float64)     # blocks of other exponents
    return (torch.randn(VALUES, generator=g, dtype=torch.float64) * scale).to(dtype)


def sent(pg) -> int:
    return pg.counters().get("packets_sent", 0)


def switch_vs_gloo(pg, gloo, world: int) -> dict:
    """Per dtype and op: the netagg result's largest error against the exact result over the
    documented bound (must be <= 1), the same against gloo's result (a correctly rounded sum
    for 2 ranks: the bound plus half an ulp of gloo's), and the packets it sent."""
    out = {}
    cases = [(dt, op) for dt in FORMAT for op in ("SUM", "AVG")] + [(torch.int32, "SUM")]
    for dtype, op in cases:
        mine = inputs(dist.get_rank(), dtype)
        ours, theirs = mine.clone(), mine.clone()
        before = sent(pg)
        dist.all_reduce(ours, op=getattr(dist.ReduceOp, op))
        packets = sent(pg) - before
        dist.all_reduce(theirs, op=getattr(dist.ReduceOp, op), group=gloo)
        everyone = [inputs(r, dtype).double().numpy() for r in range(world)]
        exact = np.sum(everyone, axis=0) / (world if op == "AVG" else 1)
        key = f"{str(dtype).split('.')[1]}_{op}"
        if dtype == torch.int32:
            out[key] = {"equal_to_gloo": bool(torch.equal(ours, theirs)),
                        "equal_to_exact": bool(np.array_equal(ours.numpy(), exact)),
                        "packets": packets}
            continue
        fmt = FORMAT[dtype]
        got, gloo_got = ours.double().numpy(), theirs.double().numpy()
        bound = N.error_bound(got, N.shared_exponents(everyone, N.FLOAT32), world, fmt,
                              mean=op == "AVG")
        out[key] = {"exact_over_bound": float(np.max(np.abs(got - exact) / bound)),
                    "gloo_over_bound": float(np.max(np.abs(got - gloo_got)
                                                    / (bound + N.half_ulp(gloo_got, fmt)))),
                    "packets": packets}
    return out


def fallbacks(pg, world: int) -> dict:
    """What the switch cannot do, done by gloo: each result right, no packet sent."""
    rank = dist.get_rank()
    cases = {
        "float32_MAX": (torch.tensor([rank, -rank], dtype=torch.float32), dist.ReduceOp.MAX,
                        torch.tensor([world - 1, 0], dtype=torch.float32)),
        "float64_SUM": (torch.full((3,), rank + 0.5, dtype=torch.float64), dist.ReduceOp.SUM,
                        torch.full((3,), world * world / 2, dtype=torch.float64)),
        "int64_SUM": (torch.full((3,), 1 << 40, dtype=torch.int64), dist.ReduceOp.SUM,
                      torch.full((3,), world << 40, dtype=torch.int64)),
        "int32_PRODUCT": (torch.full((2,), rank + 2, dtype=torch.int32),
                          dist.ReduceOp.PRODUCT,
                          torch.full((2,), int(np.prod(np.arange(world) + 2)),
                                     dtype=torch.int32)),
    }
    out = {}
    for name, (t, op, expected) in cases.items():
        before = sent(pg)
        dist.all_reduce(t, op=op)
        out[name] = {"right": bool(torch.equal(t, expected)), "packets": sent(pg) - before}
    return out


def collectives(world: int) -> dict:
    rank = dist.get_rank()
    t = torch.full((4,), float(rank))
    dist.broadcast(t, src=world - 1)
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    dist.barrier()
    x = torch.ones(300)
    work = dist.all_reduce(x, async_op=True)
    value = work.get_future().wait()
    return {"broadcast": bool(torch.all(t == world - 1)),
            "all_gather_object": objs == [{"rank": r} for r in range(world)],
            "work_future": isinstance(value, list) and value[0] is x
            and bool(torch.all(x == world)) and work.is_completed()}


def ddp(pg, gloo) -> dict:
    """3 SGD steps of the same model and data through netagg (DDP's own allreduce, and the
    netagg hook with a loss budget) and through gloo: the largest weight difference."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(40, 1000), nn.ReLU(), nn.Linear(1000, 10))

    plain, hooked, ref = DDP(model()), DDP(model()), DDP(model(), process_group=gloo)
    register(hooked, loss_budget=0.05)        # the switch's thresholds: nothing is dropped
    models = (plain, hooked, ref)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    g = torch.Generator().manual_seed(dist.get_rank())
    before = pg.counters()
    for _ in range(3):
        x, y = torch.randn(16, 40, generator=g), torch.randint(0, 10, (16,), generator=g)
        for m, o in zip(models, opts):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    after = pg.counters()

    def diff(a, b):
        return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))
    droppable = {k: after[k] - before.get(k, 0) for k in after
                 if k.startswith("droppable_sent_class")}
    return {"plain_vs_gloo": diff(plain, ref), "hook_vs_gloo": diff(hooked, ref),
            "droppable_sent": after.get("droppable_sent", 0) - before.get("droppable_sent", 0),
            "droppable_classes": sorted(int(k.removeprefix("droppable_sent_class"))
                                        for k, v in droppable.items() if v),
            "weights": [float(p.detach().double().sum()) for p in hooked.parameters()]}


def nonfinite(world: int) -> dict:
    """An inf on rank 0 alone reaches every rank (the rest exact), +inf and -inf on two
    ranks give NaN, and GradScaler skips the step on every rank alike: rank 0's loss is
    infinite, every rank's weights stay and its scale halves, then a finite step moves them
    all the same."""
    rank = dist.get_rank()
    t = torch.ones(VALUES)
    if rank == 0:
        t[7] = float("inf")
    dist.all_reduce(t)
    b = torch.zeros(600, dtype=torch.bfloat16)
    b[3] = float("-inf") if rank == 0 else float("inf")
    dist.all_reduce(b, op=dist.ReduceOp.AVG)
    torch.manual_seed(0)
    model = DDP(nn.Linear(20, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    steps = []
    for bad in (rank == 0, False):
        opt.zero_grad()
        loss = model(torch.ones(2, 20)).square().sum() * (float("inf") if bad else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        steps.append({"scale": scaler.get_scale(), "moved": any(
            not torch.equal(p, q) for p, q in zip(model.parameters(), before))})
    return {"inf_everywhere": bool(t[7] == float("inf")),
            "rest_exact": bool(torch.all(torch.cat([t[:7], t[8:]]) == world)),
            "skips_step": not bool(torch.isfinite(t).all()),
            "nan_from_both_signs": bool(torch.isnan(b[3])) and bool(torch.all(b[4:] == 0)),
            "scaler": steps, "weights": [float(p.detach().sum()) for p in model.parameters()]}


def main(out: str, only_switch: bool = False):
    dist.init_process_group("netagg")
    pg, world = dist.group.WORLD, dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    if only_switch:             # a fabric's run: all_reduce through it, and where it ran
        w = pg.worker
        report = {"rank": dist.get_rank(), "local_size": pg.placement.local_size,
                  "switch_vs_gloo": switch_vs_gloo(pg, gloo, world),
                  "leaf": w.placement.leaf, "switch_job": w.switch_job}
        dist.destroy_process_group()
        with open(f"{out}/rank{report['rank']}.json", "w") as f:
            json.dump(report, f)
        return
    report = {"rank": dist.get_rank(), "group": type(pg).__name__,
              "backend": dist.get_backend(), "local_size": pg.placement.local_size,
              "switch_vs_gloo": switch_vs_gloo(pg, gloo, world),
              "fallbacks": fallbacks(pg, world), "collectives": collectives(world),
              "ddp": ddp(pg, gloo), "nonfinite": nonfinite(world)}
    dist.destroy_process_group()
    report["shut_down"] = pg.worker is None
    with open(f"{out}/rank{report['rank']}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    assert tb.BACKEND == "netagg"
    main(sys.argv[1], sys.argv[2:] == ["--only-switch"])
    exit_now(0)         # torch 2.13's teardown after DDP over gloo may abort (see there)
