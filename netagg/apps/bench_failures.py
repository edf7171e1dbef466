"""`netagg bench failures`: how fast, and how rightly, the ranks name a switch that dies and a
job another run takes over, against `netagg sim serve` in its own process, golden and RTL.

- **The switch killed.** 4 worker processes join a run; ranks 0..2 start an allreduce that
  waits for rank 3 (open and beating, but holding back its own); `sim serve` is SIGKILLed.
  Each of ranks 0..2 must fail with `NetaggSwitchGone` naming the switch's address; the
  figure is the time from the kill to each error.
- **The job taken over.** Run A's 2 worker processes join; A's rank 1 is SIGKILLed while
  A's rank 0 waits in an allreduce; run B (a fresh session, 2 processes) configures the same
  job and allreduces, exactly. A's rank 0 must fail with `NetaggJobTakenOver` naming the job
  and B's rank 0's address (not "a peer stopped contributing"); the figure is the time from
  B's configuration to that error.

Each scenario runs `runs` times per backend; the report holds every time, the largest, and
how many errors were the right ones. Times are `time.monotonic()` in each process (one
clock on Linux). Traffic stays on loopback.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from multiprocessing import connection

import numpy as np

VALUES = 1 << 16            # int32 values of the allreduce the ranks wait in
WAIT = 60.0                 # seconds a scenario waits for any one event


def _rank(url: str, rank: int, world: int, session: str, events, hold: bool):
    """A worker process: join (an allreduce), then allreduce `VALUES` values and report
    ("ready", "submitted", "configured", "done" or "error") with the time on `events`, a pipe
    of its own; `hold`: after joining, beat and wait instead."""
    from netagg.host import Worker
    try:
        with Worker(rank, world, url, session=session, timeout=30) as w:
            events.send((rank, "configured", time.monotonic(), ""))
            w.allreduce(np.ones(10, np.int32))
            events.send((rank, "ready", time.monotonic(), ""))
            if hold:
                time.sleep(3600)
            handle = w.allreduce_async(np.full(VALUES, rank + 1, np.int32))
            events.send((rank, "submitted", time.monotonic(), ""))
            try:
                out = handle.wait()
            except Exception as e:      # (timed here: closing the worker takes a while)
                events.send((rank, "error", time.monotonic(), f"{type(e).__name__}: {e}"))
                return
            right = bool(np.all(out == sum(range(1, world + 1))))
            events.send((rank, "done", time.monotonic(), "exact" if right else "WRONG"))
    except Exception as e:
        events.send((rank, "error", time.monotonic(), f"{type(e).__name__}: {e}"))


class _Run:
    """A run's worker processes and their events, each rank's on a pipe of its own: a rank
    the scenario kills may die holding a shared queue's write lock, and then no other rank's
    event would come through."""

    def __init__(self, ctx, url: str, world: int, holding=()):
        self.session = uuid.uuid4().hex
        pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
        self.readers = [reader for reader, _ in pipes]
        self.procs = [ctx.Process(target=_rank, daemon=True,
                                  args=(url, r, world, self.session, writer, r in holding))
                      for r, (_, writer) in enumerate(pipes)]
        self.seen: dict[tuple[int, str], tuple[float, str]] = {}
        for p in self.procs:
            p.start()
        for _, writer in pipes:
            writer.close()

    def expect(self, ranks, what: str) -> dict[int, tuple[float, str]]:
        """Wait until each of `ranks` has reported `what` (or an error): their events."""
        deadline = time.monotonic() + WAIT
        while not all((r, what) in self.seen or (r, "error") in self.seen for r in ranks):
            ready = connection.wait(self.readers, max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"ranks {list(ranks)} did not report {what!r} within "
                                   f"{WAIT:.0f} s (they reported {sorted(self.seen)}; "
                                   f"exit codes {[p.exitcode for p in self.procs]})")
            for reader in ready:
                try:
                    rank, event, at, text = reader.recv()
                except EOFError:            # (the rank's process is gone)
                    self.readers.remove(reader)
                    continue
                self.seen[rank, event] = (at, text)
        return {r: self.seen.get((r, what)) or (self.seen[r, "error"][0],
                                                "error " + self.seen[r, "error"][1])
                for r in ranks}

    def errors(self, ranks) -> dict[int, tuple[float, str]]:
        got = self.expect(ranks, "error")
        return {r: (at, text.removeprefix("error ")) for r, (at, text) in got.items()}

    def stop(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def _serve(backend: str) -> tuple[subprocess.Popen, str]:
    serve = subprocess.Popen(
        [sys.executable, "-m", "netagg.apps.cli", "sim", "serve", "--backend", backend],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = serve.stdout.readline().strip()
    if not url.startswith("udp://"):
        serve.kill()
        raise RuntimeError(f"netagg sim serve --backend {backend} said {url!r}")
    return serve, url


def switch_killed(ctx, backend: str) -> dict:
    serve, url = _serve(backend)
    run = _Run(ctx, url, 4, holding={3})
    try:
        run.expect(range(4), "ready")
        run.expect(range(3), "submitted")
        time.sleep(0.2)                 # (the allreduce under way)
        os.kill(serve.pid, signal.SIGKILL)
        killed = time.monotonic()
        errors = run.errors(range(3))
    finally:
        run.stop()
        serve.kill()
        serve.wait(10)
    address = url.removeprefix("udp://")
    right = [text.startswith("NetaggSwitchGone") and address in text
             for _, text in errors.values()]
    return {"seconds": [round(at - killed, 3) for at, _ in errors.values()],
            "right": sum(right), "errors": [text for _, text in errors.values()]}


def job_taken_over(ctx, backend: str) -> dict:
    serve, url = _serve(backend)
    old = _Run(ctx, url, 2, holding={1})
    new = None
    try:
        old.expect(range(2), "ready")
        old.expect([0], "submitted")
        old.procs[1].kill()             # A's rank 1 crashed
        new = _Run(ctx, url, 2)
        configured = new.expect([0], "configured")[0][0]
        done = new.expect(range(2), "done")
        [(at, text)] = old.errors([0]).values()
    finally:
        old.stop()
        if new is not None:
            new.stop()
        serve.kill()
        serve.wait(10)
    right = text.startswith("NetaggJobTakenOver") and "configured again by another run" in text
    return {"seconds": [round(at - configured, 3)], "right": int(right), "errors": [text],
            "new_run": [t for _, t in done.values()]}


def bench_failures(backends=("golden", "rtl"), runs: int = 10, quiet: bool = False) -> dict:
    from rich.progress import Progress
    ctx = mp.get_context("spawn")
    report = {"date": datetime.date.today().isoformat(),
              "machine": f"{os.cpu_count()} cores, {platform.machine()}, Linux "
                         f"{platform.release()}", "runs": runs, "scenarios": []}
    scenarios = [("switch killed", switch_killed), ("job taken over", job_taken_over)]
    with Progress(disable=quiet, transient=True) as progress:
        task = progress.add_task("failures", total=len(backends) * len(scenarios) * runs)
        for backend in backends:
            for name, scenario in scenarios:
                each = []
                for i in range(runs):
                    progress.update(task, description=f"{backend}: {name}, run {i + 1}")
                    each.append(scenario(ctx, backend))
                    progress.advance(task)
                seconds = [s for r in each for s in r["seconds"]]
                report["scenarios"].append({
                    "backend": backend, "scenario": name, "named": len(seconds),
                    "right": sum(r["right"] for r in each), "seconds": seconds,
                    "median": round(float(np.median(seconds)), 3),
                    "largest": max(seconds),
                    "wrong": [e for r in each for e in r["errors"]
                              if not (e.startswith("NetaggSwitchGone")
                                      or e.startswith("NetaggJobTakenOver"))]})
    if not quiet:
        print(summary(report))
    return report


def summary(report: dict) -> str:
    lines = [f"failures named, {report['runs']} runs of each ({report['date']}, "
             f"{report['machine']})",
             "backend  scenario         errors right  median  largest"]
    for s in report["scenarios"]:
        lines.append(f"{s['backend']:<8} {s['scenario']:<16} {s['named']:>6} {s['right']:>5} "
                     f"{s['median']:>6.2f}s {s['largest']:>7.2f}s")
    return "\n".join(lines)
