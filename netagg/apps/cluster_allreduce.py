"""One host's part of `netagg bench cluster`: timed allreduces through netagg or torch's gloo.

``python -m netagg.apps.cluster_allreduce {netagg,gloo} RANK WORLD --sizes 1048576,...``
runs in a host's namespace of the emulated cluster (`sim.cluster`). For each size (bytes of
float32) it allreduces the worker's `apps.demo.demo_data` once untimed (checked against the
float64 sum of every rank's data: within the fixed-point bound through netagg, float32's
rounding through gloo) and then `--repeat` times, each time after a barrier (a one-value
allreduce through the same library, whose result reaches every rank at once), timing each
from the barrier's end to the result, and checking each result after its time is taken. It
prints one JSON object: per size, its times, whether its results were right (and their
largest relative error), the packets netagg sent again in the timed allreduces, and
when each timed allreduce began (the wall clock, seconds since the epoch).

netagg: `host.Worker` over UDP to `--switch`, session `--session`, from `--paths` source
ports (more than one: its packets may come back out of order), its packets in priority class
`--priority`, `--loss-budget` of each tensor's chunks droppable (in the classes below). With
a loss budget a result is right when no more than each worker's budget of its values are
beyond the fixed-point bound (the chunks whose sum lost a contribution); `error` is its
relative error (L2) either way. gloo: torch.distributed
with a TCP store at `--master` (host 0's address), over the same links.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from netagg.apps.demo import check_result, demo_data


def _expected(world: int, values: int, seed: int) -> list[np.ndarray]:
    return [demo_data(r, values, seed) for r in range(world)]


class _Check:
    """Whether a result of `library` is right for `inputs` (netagg's: all but the fraction
    `lost` of its values within the fixed-point bound), and its relative error."""

    def __init__(self, library: str, inputs: list[np.ndarray], lost: float):
        self.library, self.inputs, self.lost = library, inputs, lost
        self.exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)

    def __call__(self, result: np.ndarray) -> tuple[bool, float]:
        exact = self.exact
        error = float(np.linalg.norm(result - exact) / np.linalg.norm(exact))
        if self.library == "gloo":
            return bool(np.allclose(result, exact, rtol=1e-5,
                                    atol=1e-6 * np.abs(exact).max())), error
        return check_result(result, self.inputs, [len(exact)], lost=self.lost)["ok"], error


class Netagg:
    def __init__(self, rank: int, world: int, args):
        from netagg.host import Worker
        self.worker = Worker(rank, world, args.switch, session=args.session,
                             timeout=args.timeout, paths=args.paths)
        self.one = np.ones(1, np.int32)
        self.loss = {"loss_budget": args.loss_budget, "priority": args.priority}

    def barrier(self):
        self.worker.allreduce(self.one)

    def allreduce(self, x: np.ndarray) -> np.ndarray:
        return self.worker.allreduce(x, **self.loss)

    def retransmissions(self) -> int:
        return self.worker.counters().get("retransmissions", 0)

    def counters(self) -> dict:
        c = self.worker.counters()
        return {k: c.get(k, 0) for k in ("given_up", "droppable_sent", "probes")}

    def close(self):
        self.worker.close()


class Gloo:
    def __init__(self, rank: int, world: int, args):
        import datetime
        import os

        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        host, port = args.master.rsplit(":", 1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")     # the host's one NIC
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))

    def barrier(self):
        self.dist.barrier()

    def allreduce(self, x: np.ndarray) -> np.ndarray:
        t = self.torch.from_numpy(x)
        self.dist.all_reduce(t)
        return t.numpy()

    def retransmissions(self) -> int:
        return 0            # TCP's own, in the kernel

    def counters(self) -> dict:
        return {}

    def close(self):
        self.dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("library", choices=["netagg", "gloo"])
    p.add_argument("rank", type=int)
    p.add_argument("world", type=int)
    p.add_argument("--sizes", required=True, help="bytes of float32, comma-separated")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--switch", default=None)
    p.add_argument("--session", default="cluster")
    p.add_argument("--master", default=None, help="gloo: host 0's address:port")
    p.add_argument("--paths", type=int, default=1, help="netagg: source ports sprayed over")
    p.add_argument("--priority", type=int, default=4, help="netagg: the tensors' class")
    p.add_argument("--loss-budget", type=float, default=0.0,
                   help="netagg: the fraction of chunks a worker may have dropped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    lib = (Netagg if args.library == "netagg" else Gloo)(args.rank, args.world, args)
    out = {"library": args.library, "rank": args.rank, "sizes": []}
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            values = size // 4
            mine = demo_data(args.rank, values, args.seed)
            check = _Check(args.library, _expected(args.world, values, args.seed),
                           args.world * args.loss_budget)
            lib.barrier()
            checks = [check(lib.allreduce(mine.copy()))]
            counted = lib.counters()
            times, cpu, started, sent_again = [], [], [], lib.retransmissions()
            for _ in range(args.repeat):
                x = mine.copy()
                lib.barrier()
                started.append(time.time())
                t0, c0 = time.perf_counter(), time.process_time()
                result = lib.allreduce(x)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                checks.append(check(result))
            out["sizes"].append({"bytes": size, "seconds": times, "cpu_seconds": cpu,
                                 "started": started,
                                 "verified": all(ok for ok, _ in checks),
                                 "error": max(e for _, e in checks),
                                 "retransmissions": lib.retransmissions() - sent_again,
                                 **{k: v - counted[k] for k, v in lib.counters().items()}})
    finally:
        lib.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
