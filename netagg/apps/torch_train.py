"""One process of `netagg train`: a small CNN on scikit-learn's 8x8 digits, data-parallel with
torch's DDP, under torchrun, with gloo or with netagg.

    torchrun --nproc-per-node 2 -m netagg.apps.torch_train --backend netagg --data digits.npz \\
        --out run.json [--loss-budget 0.05] [--epochs 15] [--batch 16] [--seed 0]
        [--channels 16 --hidden 128]

The data (`digits`): the 1,797 images of `sklearn.datasets.load_digits` (bundled with
scikit-learn, nothing is downloaded), pixels scaled to [0, 1], split by a seeded permutation
into 1,347 training and 450 test images; `netagg train` writes them once to `--data` (an
.npz), so that the processes do not each import scikit-learn.

The model (`DigitsCNN`, 22,602 parameters at its default width): conv 3x3 1->C, ReLU,
max-pool 2; conv 3x3 C->2C, ReLU, max-pool 2; linear 8C->H, ReLU; linear H->10, with C =
`--channels` (16) and H = `--hidden` (128); 64 and 2048 make 1,145,610 parameters (4.6 MB of
float32 gradients a step), most of them the first linear layer's, for links where the
gradients, not the compute, set a step's time. `torch.manual_seed(seed)` before it is built,
so every run starts from the same weights (and DDP broadcasts rank 0's).
SGD with momentum, mean cross-entropy. Each epoch, every rank draws the same seeded
permutation of the training set and takes its share (`perm[rank::world]`), in batches of
`batch`, the same number of steps on every rank. With `--backend netagg` the gradients go
through `host.torch_hook` (DLCP classes, `--loss-budget`); with gloo, DDP's own allreduce.

Measured in each process, before the training loop: a step's compute, the median seconds of
a forward and backward pass of one batch without DDP's allreduce (`no_sync`; the gradients
then zeroed, the weights unchanged). Over the training loop (which starts after a barrier):
seconds and seconds per step, the loss and the seconds since the loop's start at the end of
every step, the process's CPU seconds (every thread's), the bytes it sent to the switch (the
worker's `bytes_sent`: RoCEv2 UDP payloads) and over TCP (gloo's connections:
`tcp_bytes_sent`, the kernel's count of bytes the peers acknowledged, TCP payload). At the
end, the ranks gather all of it (through gloo), rank 0 measures the test accuracy and checks
that every rank holds the same weights, and writes one JSON object to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time

import numpy as np
import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

TEST_SHARE = 0.25
TCPI_BYTES_ACKED = 120      # offset of tcpi_bytes_acked (u64) in Linux's struct tcp_info


def digits(seed: int) -> dict[str, np.ndarray]:
    """scikit-learn's digits, split by `seed`: x_train, y_train, x_test, y_test."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = round(len(y) * TEST_SHARE)
    test, train = perm[:n_test], perm[n_test:]
    return {"x_train": x[train], "y_train": y[train], "x_test": x[test], "y_test": y[test]}


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions (`channels`, twice as many), each pooled, and two linear layers
    (`hidden` wide) on 8x8 images; 10 classes."""

    def __init__(self, channels: int = 16, hidden: int = 128):
        super().__init__()
        if channels < 1 or hidden < 1:
            raise ValueError(f"a DigitsCNN has channels and hidden >= 1, not {channels}, "
                             f"{hidden}")
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc1 = nn.Linear(2 * channels * 4, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def tcp_bytes_sent() -> int:
    """Bytes this process has sent on its established TCP connections, as the peers
    acknowledged them (Linux's TCP_INFO); 0 where the kernel does not say."""
    total = 0
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.fd < 0 or c.status != psutil.CONN_ESTABLISHED:
            continue
        try:
            with socket.socket(fileno=os.dup(c.fd)) as s:
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            continue
        if len(info) >= TCPI_BYTES_ACKED + 8:
            total += struct.unpack_from("=Q", info, TCPI_BYTES_ACKED)[0]
    return total


def compute_seconds(model, x, y, repeat: int = 3) -> float:
    """The median seconds of a forward and backward pass of (x, y) on DDP `model` without
    its allreduce; the gradients are zeroed after, the weights left as they are."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        with model.no_sync():
            F.cross_entropy(model(x), y).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad()
    return float(np.median(times))


def _worker_counters(group) -> dict:
    return group.counters() if hasattr(group, "counters") else {}


def train(args) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = {k: torch.from_numpy(v) for k, v in np.load(args.data).items()}
    torch.manual_seed(args.seed)
    model = nn.parallel.DistributedDataParallel(DigitsCNN(args.channels, args.hidden))
    if args.backend == "netagg":
        from netagg.host.torch_hook import register
        register(model, loss_budget=args.loss_budget)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    n = len(data["y_train"])
    group = dist.group.WORLD
    compute = compute_seconds(model, data["x_train"][:args.batch], data["y_train"][:args.batch])
    losses, ends = [], []
    dist.barrier()
    before, tcp0, cpu0 = _worker_counters(group), tcp_bytes_sent(), time.process_time()
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + epoch))
        share = perm[rank::world]
        for i in range(0, len(share) // args.batch * args.batch, args.batch):
            idx = share[i:i + args.batch]
            opt.zero_grad()
            loss = F.cross_entropy(model(data["x_train"][idx]), data["y_train"][idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            ends.append(time.perf_counter() - t0)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after, tcp1 = _worker_counters(group), tcp_bytes_sent()
    figures = {"rank": rank, "seconds": seconds, "steps": len(losses), "losses": losses,
               "ends": ends, "compute_seconds": compute, "cpu_seconds": cpu,
               "switch_bytes": after.get("bytes_sent", 0) - before.get("bytes_sent", 0),
               "tcp_bytes": tcp1 - tcp0,
               "packets_sent": after.get("packets_sent", 0) - before.get("packets_sent", 0),
               **{k: after.get(k, 0) - before.get(k, 0)
                  for k in ("droppable_sent", "given_up", "lost_contributions",
                            "rescaled_chunks", "filled_chunks", "retransmissions")},
               "weights": [float(p.detach().double().sum()) for p in model.parameters()]}
    gathered = [None] * world
    dist.all_gather_object(gathered, figures)
    if rank != 0:
        return None
    with torch.no_grad():
        predicted = model.module(data["x_test"]).argmax(1)
    accuracy = float((predicted == data["y_test"]).double().mean())
    steps = gathered[0]["steps"]
    return {
        "backend": args.backend, "loss_budget": args.loss_budget, "world_size": world,
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "epochs": args.epochs, "batch_per_worker": args.batch, "steps": steps,
        "channels": args.channels, "hidden": args.hidden,
        "parameters": sum(p.numel() for p in model.parameters()),
        "test_accuracy": accuracy,
        "time_per_step": max(g["seconds"] for g in gathered) / steps,
        "compute_per_step": max(g["compute_seconds"] for g in gathered),
        "seconds_at_step": np.max([g["ends"] for g in gathered], axis=0).tolist(),
        "bytes_sent_per_worker": {
            "switch": float(np.mean([g["switch_bytes"] for g in gathered])),
            "tcp": float(np.mean([g["tcp_bytes"] for g in gathered]))},
        "loss_per_step": np.mean([g["losses"] for g in gathered], axis=0).tolist(),
        "replicas_identical": all(g["weights"] == gathered[0]["weights"] for g in gathered),
        "ranks": [{k: v for k, v in g.items() if k not in ("losses", "ends", "weights")}
                  for g in gathered],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m netagg.apps.torch_train", description=__doc__)
    p.add_argument("--backend", choices=["gloo", "netagg"], required=True)
    p.add_argument("--data", required=True, help=".npz of digits() (netagg train writes it)")
    p.add_argument("--out", required=True, help="rank 0 writes the run's JSON here")
    p.add_argument("--loss-budget", type=float, default=0.0)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch", type=int, default=16, help="images per worker per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--channels", type=int, default=16, help="the first convolution's channels")
    p.add_argument("--hidden", type=int, default=128, help="the hidden linear layer's width")
    args = p.parse_args(argv)
    if args.backend == "netagg":
        import netagg.host.torch_backend  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend)
    try:
        report = train(args)
        if report is not None:
            with open(args.out, "w") as f:
                json.dump(report, f)
    finally:
        dist.destroy_process_group()
    return 0


def exit_now(code: int):
    """End the process without the interpreter's teardown: with torch 2.13, a process that
    ran DDP over gloo aborts in it, now and then, after `destroy_process_group` ("terminate
    called without an active exception", SIGABRT or SIGSEGV: 3 of 4 runs of 4 processes in
    2 torchrun agents), which torchrun reports as the job's failure; gloo's threads still
    hold Work objects with Python tensors when the interpreter finalizes (the mechanism
    pytorch/pytorch#179291 describes). Everything is written and the group destroyed by
    then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
