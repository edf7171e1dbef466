"""One process of `netagg gpu-check` (netagg/apps/gpu_check.py), under torchrun, on cuda:0 (every
rank shares it): `init_process_group("netagg")` against `netagg sim serve`, then

- `all_reduce`: each dtype and op the switch takes, a CUDA tensor against the same values
  on the CPU through the host path (bit for bit), of `VALUES` values (several staging
  chunks); a non-contiguous CUDA tensor too;
- `ordering`: a tensor written late on a side stream (`torch.cuda._sleep` first) and
  all_reduced with that stream current, its sums then read on that stream; and an async
  all_reduce whose future's value is read on another stream;
- `fallbacks`: float64, int64 and MAX on CUDA tensors through gloo (right, no packet sent),
  AVG of float64 on CUDA refused with an error naming it, and send of a CUDA tensor refused
  naming its device;
- `ddp`: 3 SGD steps of a small model on CUDA through netagg (DDP's own allreduce, and the
  netagg hook) and through a gloo group: the largest weight and loss differences, and a
  digest of the weights (the replicas must agree);
- `staging`: the time of an all_reduce of `--values` float32 values on the CPU and on CUDA,
  the speed of a pinned copy each way (CUDA events), and the seconds the staging waited on
  copies;
- `collectives`: what gloo does with CUDA tensors in the other collectives (ok, or its
  error).

Each rank writes `<out>/rank<r>.json` after every section, so a hang leaves what came
before it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from netagg.apps.torch_train import exit_now
from netagg.host import torch_backend as tb
from netagg.host.torch_hook import register

VALUES = 2_500_000          # float32: 3 chunks of 4 MiB; 16-bit: 2
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int32": torch.int32}


def inputs(rank: int, dtype: torch.dtype, n: int = VALUES) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + rank)
    if dtype == torch.int32:
        return torch.randint(-(1 << 20), 1 << 20, (n,), generator=g, dtype=torch.int32)
    scale = torch.logspace(-3, 3, n, dtype=torch.float64)
    return (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)


def sent(pg) -> int:
    return pg.counters().get("packets_sent", 0)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (torch.float16, torch.bfloat16):
        a, b = a.view(torch.int16), b.view(torch.int16)
    elif a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return bool(torch.equal(a, b))


def all_reduce(pg, dev) -> dict:
    out = {}
    cases = [(d, op) for d in ("float32", "float16", "bfloat16") for op in ("SUM", "AVG")]
    for name, op in cases + [("int32", "SUM")]:
        host = inputs(dist.get_rank(), DTYPES[name])
        cuda = host.to(dev)
        dist.all_reduce(host, op=getattr(dist.ReduceOp, op))
        before = sent(pg)
        dist.all_reduce(cuda, op=getattr(dist.ReduceOp, op))
        out[f"{name}_{op}"] = {"bit_for_bit": same_bits(cuda, host),
                               "packets": sent(pg) - before}
    host = inputs(dist.get_rank(), torch.float32, 6000).view(100, 60)
    cuda = host.to(dev).t()                         # not contiguous
    dist.all_reduce(host)
    dist.all_reduce(cuda)
    out["float32_SUM_non_contiguous"] = {"bit_for_bit": same_bits(cuda.t(), host),
                                         "packets": None}
    return out


def ordering(dev, world: int) -> dict:
    """A producer that writes late on its stream and a consumer after the future."""
    rank, n = dist.get_rank(), 1_000_000
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(200_000_000)          # the producer is late
        x = torch.full((n,), float(rank + 1), device=dev)
        dist.all_reduce(x)
        late = bool(torch.all(x * 2 == world * (world + 1)).item())
    y = torch.arange(n, device=dev, dtype=torch.float32) % 1000
    work = dist.all_reduce(y, async_op=True)
    other = torch.cuda.Stream(dev)
    with torch.cuda.stream(other):
        value = work.get_future().wait()[0]
        consumed = value.sum(dtype=torch.float64).item()
    expected = float(world * (torch.arange(n, dtype=torch.float64) % 1000).sum())
    return {"late_producer": late, "consumer_after_future": consumed == expected,
            "future_value_is_tensor": value is y}


def fallbacks(pg, dev, world: int) -> dict:
    rank = dist.get_rank()
    cases = {
        "float64_SUM": (torch.full((3,), rank + 0.5, dtype=torch.float64), dist.ReduceOp.SUM,
                        torch.full((3,), world * world / 2, dtype=torch.float64)),
        "int64_SUM": (torch.full((3,), 1 << 40, dtype=torch.int64), dist.ReduceOp.SUM,
                      torch.full((3,), world << 40, dtype=torch.int64)),
        "float32_MAX": (torch.tensor([rank, -rank], dtype=torch.float32), dist.ReduceOp.MAX,
                        torch.tensor([world - 1, 0], dtype=torch.float32)),
    }
    out = {}
    for name, (t, op, expected) in cases.items():
        t = t.to(dev)
        before = sent(pg)
        dist.all_reduce(t, op=op)
        out[name] = {"right": bool(torch.equal(t.cpu(), expected)),
                     "packets": sent(pg) - before}
    try:
        dist.all_reduce(torch.ones(3, dtype=torch.float64, device=dev), op=dist.ReduceOp.AVG)
        out["float64_AVG_refused"] = "not refused"
    except Exception as e:          # the refusal, as the caller sees it
        out["float64_AVG_refused"] = str(e)
    try:                            # refused before anything is sent: no peer waits
        dist.send(torch.ones(3, device=dev), dst=(rank + 1) % world)
        out["send_refused"] = "not refused"
    except Exception as e:
        out["send_refused"] = str(e)
    return out


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def ddp(gloo, dev) -> dict:
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(40, 1000), nn.ReLU(), nn.Linear(1000, 10)).to(dev)

    plain = DDP(model(), device_ids=[dev.index])
    hooked = DDP(model(), device_ids=[dev.index])
    ref = DDP(model(), device_ids=[dev.index], process_group=gloo)
    register(hooked)
    models = (plain, hooked, ref)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    g = torch.Generator().manual_seed(dist.get_rank())
    losses: list[list[float]] = [[], [], []]
    for _ in range(3):
        x, y = torch.randn(16, 40, generator=g), torch.randint(0, 10, (16,), generator=g)
        x, y = x.to(dev), y.to(dev)
        for i, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            losses[i].append(loss.item())

    def diff(a, b):
        return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))
    return {"plain_vs_gloo": diff(plain, ref), "hook_vs_gloo": diff(hooked, ref),
            "loss_plain_vs_gloo": max(abs(a - b) for a, b in zip(losses[0], losses[2])),
            "loss_hook_vs_gloo": max(abs(a - b) for a, b in zip(losses[1], losses[2])),
            "losses_gloo": losses[2],
            "digest_plain": digest(plain), "digest_hook": digest(hooked)}


def copy_speed(dev, nbytes: int) -> tuple[float, float]:
    """GB/s of one pinned copy of `nbytes` to the host and one back (CUDA events)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream(dev)
    speeds = []
    for dst, s in ((pinned, src), (src, pinned)):
        for _ in range(2):          # the second one counts
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                dst.copy_(s, non_blocking=True)
                end.record(stream)
            end.synchronize()
        speeds.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return speeds[0], speeds[1]


def staging(pg, dev, values: int) -> dict:
    host = torch.randn(values)
    cuda = host.to(dev)
    torch.cuda.synchronize(dev)     # (the check's own timing, not the backend's)
    times = {}
    for name, t in (("host", host), ("cuda", cuda)):
        for _ in range(2):          # the second one counts
            dist.barrier()
            began = time.perf_counter()
            dist.all_reduce(t)
            times[name] = time.perf_counter() - began
    stats = pg.staging[str(dev)].stats
    d2h, h2d = copy_speed(dev, values * 4)
    copies = values * 4 / (d2h * 1e9) + values * 4 / (h2d * 1e9)
    return {"values": values, "bytes": values * 4, "host_allreduce_s": times["host"],
            "cuda_allreduce_s": times["cuda"],
            "cuda_over_host": times["cuda"] / times["host"],
            "d2h_GBps": d2h, "h2d_GBps": h2d, "copies_alone_s": copies,
            "copies_over_allreduce": copies / times["host"],
            "staging_chunks": stats.chunks, "staging_copy_wait_s": stats.copy_wait_seconds}


def collectives(dev, world: int) -> dict:
    """Each other collective on CUDA tensors: "ok", "wrong", or gloo's error."""
    rank = dist.get_rank()

    def broadcast():
        t = torch.full((4,), float(rank), device=dev)
        dist.broadcast(t, src=world - 1)
        return bool(torch.all(t == world - 1))

    def all_gather():
        out = [torch.zeros(2, device=dev) for _ in range(world)]
        dist.all_gather(out, torch.full((2,), float(rank), device=dev))
        return all(bool(torch.all(o == r)) for r, o in enumerate(out))

    def reduce():
        t = torch.full((3,), float(rank + 1), device=dev)
        dist.reduce(t, dst=0)
        return rank != 0 or bool(torch.all(t == world * (world + 1) / 2))

    def all_to_all_single():
        t = torch.arange(world, dtype=torch.float32, device=dev) + 10 * rank
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t)
        return bool(torch.equal(out.cpu(), torch.arange(world) * 10.0 + rank))

    def gather():
        out = [torch.zeros(2, device=dev) for _ in range(world)] if rank == 0 else None
        dist.gather(torch.full((2,), float(rank), device=dev), out, dst=0)
        return rank != 0 or all(bool(torch.all(o == r)) for r, o in enumerate(out))

    def scatter():
        t = torch.zeros(2, device=dev)
        parts = [torch.full((2,), float(r), device=dev) for r in range(world)]
        dist.scatter(t, parts if rank == 0 else None, src=0)
        return bool(torch.all(t == rank))

    def reduce_scatter_tensor():
        out = torch.zeros(2, device=dev)
        dist.reduce_scatter_tensor(out, torch.ones(2 * world, device=dev))
        return bool(torch.all(out == world))

    def barrier():
        dist.barrier()
        return True

    out = {}
    for check in (broadcast, all_gather, reduce, all_to_all_single, gather, scatter,
                  reduce_scatter_tensor, barrier):
        try:
            out[check.__name__] = "ok" if check() else "wrong"
        except Exception as e:      # gloo's refusal, reported
            out[check.__name__] = f"error: {type(e).__name__}: {str(e).splitlines()[0]}"
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--values", type=int, default=4 << 20)
    args = parser.parse_args(argv)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("netagg")
    pg, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    report = {"rank": rank, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev),
              "local_size": pg.placement.local_size}

    def save():
        with open(f"{args.out}/rank{rank}.json", "w") as f:
            json.dump(report, f)

    sections = [("all_reduce", lambda: all_reduce(pg, dev)),
                ("ordering", lambda: ordering(dev, world)),
                ("fallbacks", lambda: fallbacks(pg, dev, world)),
                ("ddp", lambda: ddp(gloo, dev)),
                ("staging", lambda: staging(pg, dev, args.values)),
                ("collectives", lambda: collectives(dev, world))]
    for name, section in sections:
        began = time.perf_counter()
        try:
            report[name] = section()
        except Exception as e:      # reported; the driver marks the check failed
            report[name] = {"error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-2000:]}
        report.setdefault("seconds", {})[name] = time.perf_counter() - began
        save()
    dist.destroy_process_group()
    report["shut_down"] = pg.worker is None
    save()


if __name__ == "__main__":
    assert tb.BACKEND == "netagg"     # importing it registered the backend
    main()
    exit_now(0)
