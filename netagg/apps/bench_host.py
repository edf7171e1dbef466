"""`netagg bench host`: the host software alone, beside torch.distributed's gloo.

Every figure comes from worker processes on this machine, timed inside each process between
a barrier all ranks pass together and the end of the operation (the run's time is the
slowest rank's); CPU is the process's own (`resource.getrusage`: user + system time of all
its threads, the worker's background progress thread included) over the same interval.
netagg's allreduces are in place (`allreduce(x, out=x)`), as gloo's `all_reduce` is. The
switches run as `netagg sim serve` processes of their own on a free 127.x.y.z, gloo over the
loopback interface: no traffic leaves the machine. Every process runs with one BLAS/OpenMP
thread, and every wait has a timeout.

1. **One worker against the echo switch** (`sim serve --backend echo --jobs 1`, which
   answers each contribution at once; world size 1; one job with all 64 slots, the window a
   Versa board gives its one job), a tensor of the largest size asked for, float32 and
   int32: tensor MB/s, packets/s, and the worker's CPU µs per packet sent. Measured as
   gloo's in 3. is: one warm-up allreduce at that size, then the median of 3 runs (the run
   of the median CPU seconds; seconds their median), so that the ratio in 2. sets figures
   of one procedure side by side.
2. **CPU per byte**: that worker's CPU seconds per MB allreduced beside gloo's, per process,
   in the gloo run of 3. at the largest size, and their ratio.
3. **The allreduce of `workers` processes through the golden switch** (`sim serve --backend
   golden`, flat: one node per worker, float32) at each size, and gloo's allreduce of
   `workers` processes of the same size right after it, each group kept running between
   sizes: seconds, CPU per MB per process, and the ratio netagg / gloo. gloo's figure is
   the median of 3 runs after one warm-up; netagg's one run after a 64 KB warm-up.
4. **The golden switch's contributions per second** over UDP
   (`sim.bench.contributions_per_second("golden")`).
5. **Overlap**: in each worker process, an allreduce alone (T_comm), a compute loop alone
   calibrated to about T_comm (T_comp; its length corrected once by a trial at full length,
   the ranks computing together), then `allreduce_async`, the compute loop and `wait()`
   (T_both); hidden = (T_comm + T_comp - T_both) / min(T_comm, T_comp), clipped to [0, 1],
   is the share of the shorter of the two hidden behind the other. With matrix multiplies in
   numpy (which release the GIL) and with a pure Python loop (which holds it); for 2 workers
   against the golden switch, and for the one worker of 1. against the echo switch. Each
   phase's CPU seconds are given too: compute and background progress overlap only as far
   as the GIL lets them and the machine has a core free for each (the switch needs one).

Without torch (`pip install -e .[bench]`) the gloo figures are skipped, with the reason.
MB are 10^6 bytes (sizes as given: 1M is 2^20 bytes). On a machine shared with other work,
compare figures of one run.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue as queue_mod
import resource
import shutil
import statistics
import tempfile
import time
import uuid

import numpy as np
import psutil

from netagg.apps.demo import demo_data

MB = 1e6
DEFAULT_SIZES = [1 << 20, 8 << 20, 32 << 20]
OVERLAP_SIZE = 8 << 20          # the overlap's tensor, unless the sizes asked for are smaller
OVERLAP_WORKERS = 2
REPEAT = 3                      # runs of a measure after its warm-up (gloo's, the one worker's)
WARMUP = 64 << 10               # netagg's warm-up allreduce, bytes
COMPUTE = ("numpy", "python")
ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def torch_missing() -> str | None:
    """Why torch.distributed's gloo cannot run here, or None when it can."""
    try:
        import torch.distributed as dist
    except Exception as e:
        return f"torch is not importable ({type(e).__name__}: {e}); pip install -e .[bench]"
    return None if dist.is_available() and dist.is_gloo_available() else "torch has no gloo"


# --- inside the processes ---------------------------------------------------------------

class _Meter:
    """Wall and CPU seconds (user, system) of this process over a `with` block."""

    def __enter__(self):
        self.t0, self.r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.user, self.sys = r.ru_utime - self.r0.ru_utime, r.ru_stime - self.r0.ru_stime

    def figures(self) -> dict:
        return {"seconds": self.seconds, "cpu_seconds": self.user + self.sys,
                "user_seconds": self.user, "sys_seconds": self.sys}


def _compute(kind: str, units: int):
    """`units` units of compute: a 256 x 256 float32 matrix multiply each in numpy (BLAS
    releases the GIL), or 10,000 iterations of a Python loop (which holds it)."""
    if kind == "numpy":
        a = np.full((256, 256), 0.5, np.float32)
        out = np.empty_like(a)
        for _ in range(units):
            np.matmul(a, a, out=out)
        return
    for _ in range(units):
        s = 0
        for i in range(10_000):
            s += i * i


def _calibrate(kind: str, seconds: float) -> int:
    """The units of `_compute(kind)` that take about `seconds` here and now."""
    units = 4
    while True:
        t0 = time.perf_counter()
        _compute(kind, units)
        dt = time.perf_counter() - t0
        if dt >= min(0.2, seconds / 4) or units >= 1 << 24:
            return max(1, round(units * seconds / dt))
        units *= 4


class _NetaggRank:
    """A netagg worker over UDP: flat allreduces and the overlap measurement."""

    def __init__(self, rank, world, setup, start, timeout):
        from netagg.host import Worker
        self.rank, self.start, self.timeout = rank, start, timeout
        self.worker = Worker(rank, world, setup["url"], session=setup["session"],
                             timeout=min(timeout, 60.0))
        self.worker.allreduce(demo_data(rank, WARMUP // 4, 0), timeout=timeout)

    def allreduce(self, nbytes: int, dtype: str = "float32", seed: int = 1,
                  repeat: int = 0) -> dict:
        """One allreduce's figures; with `repeat`, one at this size first and then `repeat`
        runs' (`runs`), as `_GlooRank.allreduce` measures."""
        x = demo_data(self.rank, nbytes // 4, seed, dtype)
        if not repeat:
            return self._measured(x)
        y = x.copy()
        self.worker.allreduce(y, timeout=self.timeout, out=y)       # warm-up at this size
        runs = []
        for _ in range(repeat):
            y[...] = x
            runs.append(self._measured(y))
        return {"runs": runs}

    def _measured(self, x: np.ndarray) -> dict:
        before = self.worker.counters()
        self.start.wait(self.timeout)
        with _Meter() as m:
            self.worker.allreduce(x, timeout=self.timeout, out=x)
        after = self.worker.counters()
        return m.figures() | {k: after.get(k, 0) - before.get(k, 0)
                              for k in ("packets_sent", "packets_received", "retransmissions")}

    def overlap(self, nbytes: int, compute: str, seed: int = 2) -> dict:
        x, w, t = demo_data(self.rank, nbytes // 4, seed), self.worker, self.timeout
        self.start.wait(t)
        y = x.copy()
        with _Meter() as comm:
            w.allreduce(y, timeout=t, out=y)
        units = _calibrate(compute, comm.seconds)
        for trial in (True, False):     # a trial at full length corrects the units
            self.start.wait(t)
            with _Meter() as comp:
                _compute(compute, units)
            if trial:
                units = max(1, round(units * comm.seconds / comp.seconds))
        self.start.wait(t)
        resent = w.counters().get("retransmissions", 0)
        y[...] = x
        with _Meter() as both:
            handle = w.allreduce_async(y, out=y)
            _compute(compute, units)
            computed = time.perf_counter() - both.t0
            handle.wait(t)
        return {"comm_seconds": comm.seconds, "compute_seconds": comp.seconds,
                "both_seconds": both.seconds, "wait_seconds": both.seconds - computed,
                "comm_cpu_seconds": comm.figures()["cpu_seconds"],
                "compute_cpu_seconds": comp.figures()["cpu_seconds"],
                "both_cpu_seconds": both.figures()["cpu_seconds"], "units": units,
                "retransmissions": w.counters().get("retransmissions", 0) - resent}

    def close(self):
        self.worker.close()


class _GlooRank:
    """A torch.distributed process of a gloo group (a FileStore for the rendezvous, the
    loopback interface for the connections)."""

    def __init__(self, rank, world, setup, start, timeout):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        self.rank, self.start, self.timeout = rank, start, timeout
        dist.init_process_group("gloo", init_method=f"file://{setup['store']}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        dist.all_reduce(torch.ones(WARMUP // 4))    # the connections are up
        ips = {a.ip for c in psutil.Process().net_connections(kind="inet")
               for a in (c.laddr, c.raddr) if a}
        away = sorted(ip for ip in ips if not (ip.startswith("127.") or ip == "::1"))
        if away:
            raise RuntimeError(f"gloo connected over {', '.join(away)}, not loopback alone")

    def allreduce(self, nbytes: int, dtype: str = "float32", seed: int = 1,
                  repeat: int = REPEAT) -> dict:
        x = self.torch.from_numpy(demo_data(self.rank, nbytes // 4, seed, dtype))
        y = x.clone()
        self.dist.all_reduce(y)         # warm-up at this size
        runs = []
        for _ in range(repeat):
            y.copy_(x)
            self.start.wait(self.timeout)
            with _Meter() as m:
                self.dist.all_reduce(y)
            runs.append(m.figures())
        return {"runs": runs}

    def close(self):
        self.dist.destroy_process_group()


def _rank_main(kind, rank, world, setup, inbox, outbox, start, timeout):
    """One process of a group: set up, say so, then run the parent's commands until None."""
    member = None
    try:
        member = (_NetaggRank if kind == "netagg" else _GlooRank)(rank, world, setup, start,
                                                                   timeout)
        outbox.put({"rank": rank})
        idle_until = time.monotonic() + setup["idle"]
        while time.monotonic() < idle_until and mp.parent_process().is_alive():
            try:
                command = inbox.get(timeout=1.0)
            except queue_mod.Empty:
                continue
            if command is None:
                break
            op = command.pop("op")
            outbox.put({"rank": rank, **getattr(member, op)(**command)})
            idle_until = time.monotonic() + setup["idle"]
    except BaseException as e:          # the parent reports it
        start.abort()                   # the others do not wait for this one
        outbox.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
    finally:
        if member is not None:
            with contextlib.suppress(Exception):
                member.close()


class _Group(contextlib.AbstractContextManager):
    """`world` processes of one kind ("netagg" or "gloo"), started together and kept running;
    `run(op, ...)` has each run `op` and returns their replies, by rank."""

    def __init__(self, kind: str, world: int, setup: dict, timeout: float):
        ctx = mp.get_context("spawn")
        self.kind, self.world, self.timeout = kind, world, timeout
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        start = ctx.Barrier(world)
        setup = {"idle": 4 * timeout, **setup}
        self.procs = [ctx.Process(target=_rank_main, daemon=True, name=f"{kind}-{r}",
                                  args=(kind, r, world, setup, self.inboxes[r], self.outbox,
                                        start, timeout))
                      for r in range(world)]
        saved = {k: os.environ.pop(k, None) for k in ONE_THREAD}
        os.environ.update(dict.fromkeys(ONE_THREAD, "1"))   # inherited: one BLAS thread each
        try:
            for p in self.procs:
                p.start()
        finally:
            for k, v in saved.items():
                del os.environ[k]
                if v is not None:
                    os.environ[k] = v
        try:
            self._gather("set-up")
        except BaseException:
            self.close()
            raise

    def _gather(self, what: str) -> list[dict]:
        replies, deadline = [], time.monotonic() + self.timeout
        while len(replies) < self.world:
            try:
                replies.append(self.outbox.get(timeout=0.2))
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    break
                if any(p.exitcode is not None for p in self.procs) and self.outbox.empty():
                    time.sleep(0.5)
                    if self.outbox.empty():
                        break
        errors = [f"rank {r['rank']}: {r['error']}" for r in replies if "error" in r]
        missing = sorted(set(range(self.world)) - {r["rank"] for r in replies})
        errors += [f"rank {r}: exited (code {self.procs[r].exitcode}) without an answer"
                   if self.procs[r].exitcode is not None else
                   f"rank {r}: no answer within {self.timeout:.0f} s" for r in missing]
        if errors:
            raise RuntimeError(f"{self.kind} {what} failed: " + "; ".join(errors))
        return sorted(replies, key=lambda r: r["rank"])

    def run(self, op: str, **args) -> list[dict]:
        for inbox in self.inboxes:
            inbox.put({"op": op, **args})
        return self._gather(op)

    def close(self):
        for inbox in self.inboxes:
            with contextlib.suppress(Exception):
                inbox.put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def _switch(backend: str, workers: int, jobs: int | None = None):
    """`netagg sim serve --backend NAME` in a process of its own: its URL."""
    from netagg.sim.bench import start_server
    proc, url = start_server(backend, max_workers=max(8, workers), jobs=jobs)
    try:
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(Exception):
            proc.wait(10)
        proc.kill()                     # if it is still there
        proc.wait(5)
        proc.stdout.close()


# --- the figures ------------------------------------------------------------------------

def _single(replies: list[dict], nbytes: int) -> dict:
    """Figure 1 from the one worker's runs: the run of the median CPU seconds, the median
    seconds, the retransmissions of all."""
    runs = replies[0]["runs"]
    r = sorted(runs, key=lambda run: run["cpu_seconds"])[len(runs) // 2]
    packets, cpu = r["packets_sent"], r["cpu_seconds"]
    seconds = statistics.median(run["seconds"] for run in runs)
    return {"tensor_bytes": nbytes, "MBps": nbytes / MB / seconds, "packets": packets,
            "packets_per_second": packets / seconds, "cpu_us_per_packet": cpu / packets * 1e6,
            "cpu_s_per_MB": cpu / (nbytes / MB), "seconds": seconds,
            **{k: r[k] for k in ("cpu_seconds", "user_seconds", "sys_seconds")},
            "runs_cpu_seconds": [run["cpu_seconds"] for run in runs],
            "retransmissions": sum(run["retransmissions"] for run in runs)}


def _netagg_run(replies: list[dict], nbytes: int) -> dict:
    seconds = max(r["seconds"] for r in replies)
    return {"seconds": seconds, "MBps": nbytes / MB / seconds,
            "cpu_s_per_MB": statistics.mean(r["cpu_seconds"] for r in replies) / (nbytes / MB),
            "packets": sum(r["packets_sent"] for r in replies),
            "retransmissions": sum(r["retransmissions"] for r in replies)}


def _gloo_run(replies: list[dict], nbytes: int) -> dict:
    """The median of the runs, each as long as its slowest rank."""
    runs = list(zip(*(r["runs"] for r in replies)))
    seconds = [max(x["seconds"] for x in run) for run in runs]
    cpu = [statistics.mean(x["cpu_seconds"] for x in run) for run in runs]
    median = statistics.median(seconds)
    return {"seconds": median, "MBps": nbytes / MB / median,
            "cpu_s_per_MB": statistics.median(cpu) / (nbytes / MB),
            "runs_seconds": seconds}


def _overlap(replies: list[dict], nbytes: int, compute: str) -> dict:
    hidden = []
    for r in replies:
        comm, comp, both = r["comm_seconds"], r["compute_seconds"], r["both_seconds"]
        hidden.append(min(1.0, max(0.0, (comm + comp - both) / min(comm, comp))))
        r["hidden"] = hidden[-1]
    mean = {k: statistics.mean(r[k] for r in replies) for k in (
        "comm_seconds", "compute_seconds", "both_seconds", "wait_seconds", "comm_cpu_seconds",
        "compute_cpu_seconds", "both_cpu_seconds")}
    return {"compute": {"numpy": "256 x 256 float32 matmuls in numpy (the GIL released)",
                        "python": "a pure Python loop (the GIL held)"}[compute],
            "tensor_bytes": nbytes, **mean, "hidden": statistics.mean(hidden),
            "ranks": [{k: v for k, v in r.items() if k != "rank"} for r in replies]}


def _overlaps(group: _Group, nbytes: int) -> dict:
    return {"workers": group.world} | {
        compute: _overlap(group.run("overlap", nbytes=nbytes, compute=compute), nbytes, compute)
        for compute in COMPUTE}


def _size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n / 1024:g} KiB"


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def bench_host(sizes=None, workers: int = 4, quiet: bool = False, timeout: float = 300.0,
               rate_seconds: float = 2.0) -> dict:
    """The figures of the module's docstring, as one dict; a summary on stderr unless
    `quiet`. `timeout`: seconds any one step (a set-up, an allreduce) may take."""
    from rich.console import Console

    from netagg.sim.bench import contributions_per_second

    console = Console(stderr=True, quiet=quiet, soft_wrap=True)
    sizes = sorted(sizes or DEFAULT_SIZES)
    if sizes[0] < 4 or workers < 1:
        raise ValueError(f"sizes of 4 bytes or more and 1 worker or more, not {sizes}, {workers}")
    largest = sizes[-1]
    missing = torch_missing()
    out = {"bench": "host", "sizes": sizes, "workers": workers,
           "machine": {"cpus": os.cpu_count(), "loadavg_before": list(os.getloadavg())}}

    n = min(largest, OVERLAP_SIZE)
    out["overlap"] = {}
    with console.status("one worker against the echo switch ...") as status, \
            _switch("echo", 1, jobs=1) as url, \
            _Group("netagg", 1, {"url": url, "session": uuid.uuid4().hex}, timeout) as one:
        out["single_worker"] = {
            dtype: _single(one.run("allreduce", nbytes=largest, dtype=dtype,
                                   repeat=REPEAT), largest)
            for dtype in ("float32", "int32")}
        status.update(f"overlap: 1 worker, echo switch, {_size_text(n)} ...")
        out["overlap"]["echo"] = _overlaps(one, n)

    store = tempfile.mkdtemp(prefix="netagg-gloo-")
    out["allreduce"] = {}
    try:
        with _switch("golden", workers) as url:
            with contextlib.ExitStack() as stack:
                status = stack.enter_context(console.status("starting the workers ..."))
                netagg = stack.enter_context(_Group("netagg", workers, {
                    "url": url, "session": uuid.uuid4().hex}, timeout))
                gloo = None if missing else stack.enter_context(_Group(
                    "gloo", workers, {"store": os.path.join(store, "store")}, timeout))
                for size in sizes:
                    status.update(f"{workers} workers, {_size_text(size)}: netagg ...")
                    row = {"netagg": _netagg_run(netagg.run("allreduce", nbytes=size), size)}
                    if gloo is not None:
                        status.update(f"{workers} workers, {_size_text(size)}: gloo ...")
                        row["gloo"] = _gloo_run(gloo.run("allreduce", nbytes=size), size)
                        row["ratio"] = row["netagg"]["seconds"] / row["gloo"]["seconds"]
                    out["allreduce"][str(size)] = row
            with console.status(f"overlap: {OVERLAP_WORKERS} workers, golden switch, "
                                f"{_size_text(n)} ..."), \
                    _Group("netagg", OVERLAP_WORKERS, {"url": url,
                                                       "session": uuid.uuid4().hex},
                           timeout) as pair:
                out["overlap"]["golden"] = _overlaps(pair, n)
    finally:
        shutil.rmtree(store, ignore_errors=True)

    mine = out["single_worker"]["float32"]["cpu_s_per_MB"]
    if missing:
        out["gloo"] = {"skipped": missing}
        out["cpu_per_MB"] = {"netagg_s_per_MB": mine, "gloo": {"skipped": missing}}
    else:
        g = out["allreduce"][str(largest)]["gloo"]
        out["cpu_per_MB"] = {"netagg_s_per_MB": mine, "gloo_s_per_MB_per_process":
                             g["cpu_s_per_MB"], "gloo_processes": workers,
                             "gloo_seconds": g["seconds"], "tensor_bytes": largest,
                             "ratio": mine / g["cpu_s_per_MB"] if g["cpu_s_per_MB"] else None}
    with console.status("the golden switch's contributions per second ..."):
        rate = contributions_per_second("golden", seconds=rate_seconds)
    out["golden_switch"] = {k: rate[k] for k in (
        "contributions_per_second", "senders", "payload_bytes", "switch_cpu_seconds",
        "retransmissions", "errors")}
    out["machine"]["loadavg_after"] = list(os.getloadavg())
    out = _rounded(out)
    _summary(console, out)
    return out


def _summary(console, out: dict):
    from rich.markup import escape

    m = out["machine"]
    console.print(f"[bold]netagg bench host[/]: {m['cpus']} CPUs, load average "
                  f"{m['loadavg_before'][0]:.1f} before, {m['loadavg_after'][0]:.1f} after")
    for dtype, s in out["single_worker"].items():
        console.print(f"1 worker, echo, {_size_text(s['tensor_bytes'])} {dtype}: "
                      f"{s['MBps']:.2f} MB/s, {s['packets_per_second']:,.0f} packets/s, "
                      f"{s['cpu_us_per_packet']:.1f} CPU µs/packet")
    c = out["cpu_per_MB"]
    gloo = (f"gloo {c['gloo_s_per_MB_per_process']:.4f} per process ({c['gloo_processes']} "
            f"processes): ratio {c['ratio'] or float('nan'):.3g}") if "ratio" in c \
        else f"gloo skipped: {escape(out['gloo']['skipped'])}"
    console.print(f"CPU s/MB: netagg worker {c['netagg_s_per_MB']:.4f}, {gloo}")
    for size, row in out["allreduce"].items():
        n = row["netagg"]
        line = (f"{out['workers']} workers, golden, {_size_text(int(size))}: netagg "
                f"{n['seconds']:.3f} s")
        if "gloo" in row:
            line += f", gloo {row['gloo']['seconds']:.4f} s: ratio {row['ratio']:.3g}"
        console.print(line)
    for switch, runs in out["overlap"].items():
        for compute in COMPUTE:
            o = runs[compute]
            console.print(f"overlap {runs['workers']} x {switch}, {compute}: T_comm/comp/both "
                          f"{o['comm_seconds']:.2f}/{o['compute_seconds']:.2f}/"
                          f"{o['both_seconds']:.2f} s (CPU {o['both_cpu_seconds']:.2f} s): "
                          f"hidden {o['hidden']:.0%}")
    g = out["golden_switch"]
    console.print(f"golden switch over UDP: {g['contributions_per_second']:,.0f} "
                  f"contributions/s")
