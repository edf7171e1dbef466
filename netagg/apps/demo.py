"""`netagg demo` and `netagg bench allreduce`: worker processes against a switch.

The demo starts the simulated switch (`SimServer`, in a thread of this process) on a free
loopback address, or uses the one `--switch udp://HOST:PORT` names (a board, `netagg sim
board`, `netagg sim serve`), and `workers` processes (grouped into `nodes` nodes:
hierarchical when a node has more than one), each allreducing `values` float32 values in
`steps` tensors, and checks every worker's result against numpy (float64 sum of every
worker's input) within the fixed-point bound (`host.numerics.error_bound`) and against the
other workers' results (bit for bit). Node i's workers send from local address
`binds[i % len(binds)]`; by default the demo finds one address per switch port this host
reaches (`apps.probe.sources`), so that nodes spread over every cabled port, and it reports
the contributions each switch port took.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import queue as queue_mod
import time
import uuid

import numpy as np

from netagg.host import numerics as N


def demo_data(rank: int, values: int, seed: int, dtype: str = "float32") -> np.ndarray:
    """What worker `rank` contributes: normal values with a scale per 64K-value layer."""
    rng = np.random.default_rng([seed, rank])
    if dtype == "int32":
        return rng.integers(-(1 << 20), 1 << 20, size=values, dtype=np.int32)
    layer_scale = np.repeat(10.0 ** np.random.default_rng(seed).uniform(-3, 1, -(-values //
                                                                                 65536)), 65536)
    return (rng.standard_normal(values) * layer_scale[:values]).astype(dtype)


def check_result(result: np.ndarray, inputs: list, sizes: list[int], lost: float = 0.0) -> dict:
    """`result` (the allreduce of `inputs`, sent in tensors of `sizes` values) against
    numpy's float64 sum: int32 exactly, floats within the fixed-point bound of each tensor
    (`host.numerics.error_bound`; blocks restart at every tensor), all but the fraction
    `lost` of the values (those whose sums a loss budget let go). `ok`, `max_error`."""
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    err = np.abs(result.astype(np.float64) - exact)
    if result.dtype == np.int32:
        return {"max_error": float(err.max(initial=0)),
                "ok": bool(np.array_equal(result, exact.astype(np.int64)))}
    fmt = N.format_of(result)
    starts = np.cumsum([0] + list(sizes))
    exps = np.concatenate([N.shared_exponents([x[a:a + n] for x in inputs], fmt)
                           for a, n in zip(starts, sizes)])
    bound = N.error_bound(result.astype(np.float64), exps, len(inputs), fmt)
    return {"max_error": float(err.max(initial=0)),
            "max_relative_error": float((err / np.maximum(np.abs(exact), 1e-30)).max()),
            "ok": bool(np.mean(err > bound) <= lost)}


def worker_main(rank: int, world: int, url: str, local_size: int, session: str, values: int,
                steps: int, seed: int, dtype: str, progress, results, faults=None,
                timeout: float = 60.0, verify: bool = True, paths: int = 1,
                spray: str = "round_robin", start=None, bind: str | None = None,
                fabric: dict | None = None, recovery: str = "early"):
    """One worker process: allreduce `values` values in `steps` tensors, report. `start`: a
    barrier the workers pass together once set up, so that the timed allreduce does not
    include the processes' start-up skew (a peer still importing numpy looks to the others
    like lost packets: they retransmit until it sends). `fabric`: a leaf and spine fabric's
    description (`host.fabric`), `url` the worker's leaf."""
    from netagg.host import Worker
    try:
        data = demo_data(rank, values, seed, dtype)
        pieces = np.array_split(data, steps)
        with Worker(rank, world, url, local_size=local_size, session=session, fabric=fabric,
                    timeout=timeout, faults=faults, paths=paths, spray=spray,
                    bind=bind, recovery=recovery) as w:
            if start is not None:
                start.wait(timeout)
            t0 = time.perf_counter()
            handles = [w.allreduce_async(p) for p in pieces] if local_size == 1 else None
            outs = []
            for i, p in enumerate(pieces):
                out = handles[i].wait() if handles else w.allreduce(p)
                outs.append(out)
                with progress.get_lock():
                    progress[rank] += p.size
            seconds = time.perf_counter() - t0
            counters = w.counters()
        result = np.concatenate(outs)
        report = {"rank": rank, "seconds": seconds, "counters": counters,
                  "digest": hashlib.sha256(result.tobytes()).hexdigest()}
        if verify:
            inputs = [demo_data(r, values, seed, dtype) for r in range(world)]
            report.update(check_result(result, inputs, [len(p) for p in pieces]))
        results.put(report)
    except BaseException as e:       # the parent reports it
        if start is not None:
            start.abort()            # the others do not wait for this one
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def run_workers(url: str, *, workers: int, nodes: int, values: int, steps: int = 8,
                seed: int = 0, dtype: str = "float32", faults=None, timeout: float = 60.0,
                verify: bool = True, on_progress=None, session: str | None = None,
                paths: int = 1, spray: str = "round_robin", binds=None,
                fabric: dict | None = None, recovery: str = "early") -> dict:
    """Start the worker processes against `url`, wait for them, gather their reports.
    `paths` / `spray`: each worker sprays its packets over that many UDP source ports.
    `binds`: local addresses, node i's workers send from `binds[i % len(binds)]`. `fabric`:
    a leaf and spine fabric's description (`host.fabric`; `url` is ignored: each worker
    names the leaf its node sits on). `recovery`: the workers' (`host.retransmit.Recovery`)."""
    from netagg.host.fabric import Fabric, Placement
    if workers % nodes:
        raise ValueError(f"{workers} workers do not split into {nodes} nodes")
    urls = [url] * workers
    if fabric is not None:          # each worker at its node's leaf
        leaves = Fabric.load(fabric).leaves
        urls = [leaves[Placement.of(r, workers, len(leaves), workers // nodes).leaf].url
                for r in range(workers)]
    ctx = mp.get_context("spawn")
    progress = ctx.Array("q", workers)
    results = ctx.Queue()
    start = ctx.Barrier(workers)
    session = session or uuid.uuid4().hex
    procs = [ctx.Process(target=worker_main, daemon=True,
                         args=(r, workers, urls[r], workers // nodes, session, values, steps,
                               seed, dtype, progress, results, faults, timeout, verify, paths,
                               spray, start,
                               binds[r // (workers // nodes) % len(binds)] if binds else None,
                               fabric, recovery))
             for r in range(workers)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    reports = []
    deadline = time.monotonic() + timeout + 120
    while len(reports) < workers:
        try:
            reports.append(results.get(timeout=0.1))
        except queue_mod.Empty:
            if on_progress:
                on_progress(sum(progress[:]))
            if time.monotonic() > deadline:
                break
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead and results.empty():
                time.sleep(0.5)
                if results.empty():
                    break
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    if on_progress:
        on_progress(sum(progress[:]))
    reports.sort(key=lambda r: r["rank"])
    errors = [f"rank {r['rank']}: {r['error']}" for r in reports if "error" in r]
    missing = sorted(set(range(workers)) - {r["rank"] for r in reports})
    errors += [f"rank {r}: exited without a report" for r in missing]
    good = [r for r in reports if "error" not in r]
    agree = len({r["digest"] for r in good}) == 1 if good else False
    counters = {}
    for r in good:
        for k, v in r["counters"].items():
            counters[k] = counters.get(k, 0) + v
    seconds = max((r["seconds"] for r in good), default=0.0)
    nbytes = values * np.dtype(dtype).itemsize
    return {
        "workers": workers, "nodes": nodes, "paths": paths, "spray": spray,
        "values": values, "dtype": dtype,
        "tensor_bytes": nbytes, "steps": steps,
        "seconds": round(seconds, 3), "wall_seconds": round(wall, 3),
        "goodput_MBps": round(nbytes / seconds / 1e6, 3) if seconds else 0.0,
        "packets_sent": counters.get("packets_sent", 0),
        "packets_received": counters.get("packets_received", 0),
        "retransmissions": counters.get("retransmissions", 0),
        "gso_runs": counters.get("gso_runs", 0),
        "bytes_sent": counters.get("bytes_sent", 0),
        "bytes_received": counters.get("bytes_received", 0),
        "packets_sent_per_path": [counters.get(f"packets_sent_path{i}", 0)
                                  for i in range(paths)] if paths > 1
        else [counters.get("packets_sent", 0)],
        "max_error": max((r.get("max_error", 0.0) for r in good), default=None),
        "verified": bool(verify and not errors and agree and all(r.get("ok") for r in good)),
        "results_agree": agree,
        "digest": good[0]["digest"] if agree else None,     # sha256 of the result
        "errors": errors,
        "counters": counters,
    }


def demo(workers: int = 4, nodes: int = 2, values: int = 2_000_000, backend: str = "rtl",
         steps: int = 8, as_json: bool = False, pcap: str | None = None,
         timeout: float = 60.0, paths: int = 1, spray: str = "round_robin",
         switch: str | None = None, binds=None, switch_params: dict | None = None) -> dict:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from netagg.apps.probe import sources
    from netagg.host.control import SwitchControl

    console = Console(stderr=True, quiet=as_json)
    server = None
    if switch is None:
        from netagg.sim.serve import SimServer, make_backend
        with console.status(f"starting the {backend} switch" + (
                " (the first run builds its Verilator model: a few minutes, then cached)"
                if backend == "rtl" else "")):
            server = SimServer(make_backend(backend, **(switch_params or {})),
                               pcap=pcap).start()
        url, what = server.url, f"{backend} switch"
    else:
        url, what = switch, "switch"
    try:
        ctl = SwitchControl(url, timeout=5.0)
        binds = binds or sources(url) or None
        before = ctl.counters(jobs=[])["ports"]
        console.print(f"netagg demo: {what} on {url} ({ctl.params['ports']} ports, "
                      f"{ctl.params['jobs']} jobs, payloads of {ctl.params['max_payload']} "
                      f"bytes), {workers} workers in {nodes} nodes, {values:,} float32 "
                      "values each" + (f", sprayed over {paths} paths ({spray})" if paths > 1
                                       else "")
                      + (f", nodes sending from {', '.join(binds)}" if binds else ""))
        total = workers * values
        with Progress(TextColumn("allreduce"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task("allreduce", total=total)
            report = run_workers(url, workers=workers, nodes=nodes, values=values,
                                 steps=steps, timeout=timeout, paths=paths, spray=spray,
                                 binds=binds,
                                 on_progress=lambda done: bar.update(task, completed=done))
        after = ctl.counters(jobs=[])["ports"]
        ctl.close()
        report["backend"] = backend if server else None
        report["switch"] = url
        report["sources"] = binds
        report["port_contributions"] = [after[p]["rx"] - before[p]["rx"]
                                        - (after[p]["control"] - before[p]["control"])
                                        for p in sorted(after)]
        report["port_drops_bad_icrc"] = [after[p]["drop_bad_icrc"] - before[p]["drop_bad_icrc"]
                                         for p in sorted(after)]
        if server:
            report["server"] = dict(server.stats)
    finally:
        if server:
            server.stop()
    if not as_json:
        r = report
        lines = [
            f"workers        {r['workers']} ({r['nodes']} nodes of {r['workers'] // r['nodes']})",
            f"tensor         {r['values']:,} float32 = {r['tensor_bytes'] / 1e6:.1f} MB "
            f"per worker, in {r['steps']} tensors",
            f"time           {r['seconds']:.2f} s (wall {r['wall_seconds']:.2f} s with start-up)",
            f"goodput        {r['goodput_MBps']:.2f} MB/s per worker (tensor bytes / time)",
            f"packets        {r['packets_sent']:,} sent, {r['packets_received']:,} received",
            f"bytes          {r['bytes_sent']:,} sent, {r['bytes_received']:,} received "
            "(UDP payloads)",
            f"switch ports   contributions taken per port: "
            f"{', '.join(str(c) for c in r['port_contributions'])}",
            f"retransmitted  {r['retransmissions']:,}",
            f"max |error|    {r['max_error']:.3g} (within the fixed-point bound: "
            f"{'yes' if r['verified'] else 'NO'})" if r["max_error"] is not None else "",
            "verified       " + ("yes: every worker matches numpy and the others"
                                  if r["verified"] else "NO"),
        ]
        for e in r["errors"]:
            lines.append(f"error          {e}")
        print("\n".join(line for line in lines if line))
    return report


# The switch the RTL backend builds (sim.model.RtlSwitch's defaults, as GoldenSwitch's).
RTL_PARAMS = {"ports": 4, "width": 64, "jobs": 4, "max_workers": 8, "slots": 64}


def bench_allreduce(sizes, workers: int = 4, backend: str = "golden", transports=("inproc", "udp"),
                    quiet: bool = False, simulator: bool = True) -> dict:
    """Goodput (tensor bytes per worker / time, MB/s) of a float32 allreduce of each size,
    with `workers` in-process workers (cooperative, one process) and over UDP (one process per
    worker against `SimServer`); and, with `simulator`, the switch RTL's cycles per second
    driven from Python (frames in and out through sim.model) beside a pure C++ loop over the
    same model and the same aggregation traffic."""
    from rich.console import Console

    from netagg.host import Worker
    from netagg.sim.serve import SimServer, make_backend

    console = Console(stderr=True, quiet=quiet)
    out = {"bench": "allreduce", "backend": backend, "workers": workers, "dtype": "float32",
           "inproc": {}, "udp": {}}
    for size in sizes:
        values = max(1, size // 4)
        if "inproc" in transports:
            switch = make_backend(backend)
            ws = [Worker(r, workers, switch, session=f"bench-{size}") for r in range(workers)]
            xs = [demo_data(r, values, 1) for r in range(workers)]
            t0 = time.perf_counter()
            for h in [w.allreduce_async(x) for w, x in zip(ws, xs)]:
                h.wait()
            dt = time.perf_counter() - t0
            packets = sum(w.counters().get("packets_sent", 0) for w in ws)
            for w in ws:
                w.close()
            out["inproc"][str(size)] = {"seconds": round(dt, 4),
                                        "goodput_MBps": round(size / dt / 1e6, 3),
                                        "packets": packets}
            console.print(f"in-process {size:>10,} B: {size / dt / 1e6:8.3f} MB/s ({dt:.3f} s)")
        if "udp" in transports:
            with SimServer(make_backend(backend)).start() as server:
                r = run_workers(server.url, workers=workers, nodes=workers, values=values, steps=1,
                                seed=1, verify=False)
            if r["errors"]:
                raise SystemExit(f"UDP run of {size} bytes failed: {r['errors']}")
            out["udp"][str(size)] = {"seconds": r["seconds"], "goodput_MBps": r["goodput_MBps"],
                                     "packets": r["packets_sent"],
                                     "retransmissions": r["retransmissions"]}
            console.print(f"UDP        {size:>10,} B: {r['goodput_MBps']:8.3f} MB/s "
                          f"({r['seconds']:.3f} s, {r['retransmissions']} retransmissions)")
    if simulator:
        from netagg.sim import model
        from netagg.sim.model_traffic import switch_traffic
        with console.status("the switch RTL driven from Python and from a C++ loop ..."):
            params = dict(RTL_PARAMS)
            out["simulator"] = model.bench(
                "switch", traffic=switch_traffic(params["ports"]), **params)
        sim = out["simulator"]
        console.print(f"simulator: {sim['python_cycles_per_s']:,} cycles/s driven from Python, "
                      f"{sim['cpp_cycles_per_s']:,} in a C++ loop: ratio {sim['ratio']}")
    return out
