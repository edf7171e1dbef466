"""`netagg demo --topology LxS`: workers allreduce over a simulated leaf and spine fabric.

The fabric (`sim.topology.Topology`, golden or the RTL's leaves and spines) runs in this process
with the workers (in-process `host.Worker`s with `fabric=`, their ranks in blocks over the
leaves, driven cooperatively): each allreduces `values` float32 (or int32) values in `steps`
tensors, and every worker's result is checked against numpy (float64 sum: int32 exactly,
floats within the fixed-point bound, `apps.demo.check_result`) and against the others' (bit
for bit). `uplink_down_at` (0..1): once that share of the tensors is complete (the rest are
submitted then, so that uses are in flight), the last spine fails while it holds a use: its
links are cut the moment it sends down the result of a use in flight (partials it took whose
result has not reached every leaf: `sim.topology_watch.SpineUses.cut_at_result`), that
result lost with them, and every leaf marks its uplink down (`Topology.cut`); the uses it
held complete through the workers' retransmissions (the leaves re-send their partials to the
spine that remains, which pulls the leaves that are done: the report's `cut` and fabric
counters).

`demo_described(fabric)`: worker processes over UDP against a fabric that runs elsewhere
(`netagg sim serve --topology 2x2 --describe fabric.json`, or boards described by hand),
each naming its leaf (`netagg demo --fabric fabric.json`), checked in the same way
(`apps.demo.run_workers`).

The report: verified, the time, the partials each leaf sent up each uplink (the spines'
balance), frames between switches, retransmissions, the leaves' and spines' fabric counters
and, with `uplink_down_at`, the cut: its spine, after how many tensors, and the uses it held
in flight.
"""

from __future__ import annotations

import hashlib
import math
import time
import uuid

import numpy as np

from netagg.apps.demo import check_result, demo_data
from netagg.contract import regmap as R


def fabric_counters(topology, job: int = 0) -> dict:
    """Every switch's fabric counters (and completed uses) of `job`, by switch name."""
    names = ("completed", "contributions", "replays") + R.FABRIC_COUNTERS
    out = {}
    for name in topology.nodes:
        values = topology.control(name, [(R.job_counter(job, n), 0) for n in names])
        out[name] = {n: v for n, (_, v) in zip(names, values) if v}
    return out


def cut_spine(topology, spine: int, watch) -> dict:
    """Spine `spine` fails while it holds a use: `watch` (the topology's `SpineUses`) cuts its
    links as it sends down the result of a use in flight, the in-process workers driven until
    it has; then every leaf marks its uplink down (`Topology.cut`). What it held at the cut.

    No clock places the cut: the workers are driven until the tap has cut (the works pending
    need the spine's uses, which it answers), or until every engine has failed or finished
    (each fails on its own `timeout` without progress); then the cut did not happen, and that
    is a `NetaggError` naming why, not a cut that holds nothing."""
    from netagg.host.errors import NetaggError
    from netagg.host.fabric import hub_for
    from netagg.sim.topology import Notice
    name = f"spine{spine}"
    hub = hub_for(topology)
    watch.cut_at_result(name, lambda: topology.cut(spine, Notice.NONE))
    while name not in watch.frozen:
        waiting = [e for e in hub.engines if e.pending_works and not e.failed]
        if not waiting:
            watch.cuts.pop(name, None)
            failed = [e.failed for e in hub.engines if e.failed]
            raise NetaggError(f"{name} sent down no result of a use it held before "
                              + (f"the workers failed: {failed[0]}" if failed else
                                 "the works pending were done"))
        hub.drive()
    topology.cut(spine)
    held = watch.held.get(name, [])
    return {"spine": name, "uses_in_flight": len(held),
            "partials_taken": len(watch.up.get(name, {}))}


def demo_fabric(shape: str = "2x2", workers: int = 8, values: int = 200_000, steps: int = 8,
                backend: str = "golden", uplink_down_at: float | None = None,
                quiet: bool = False, seed: int = 0, dtype: str = "float32", make=None,
                faults=None, timeout: float = 60.0) -> dict:
    from rich.console import Console

    from netagg.host import Worker
    from netagg.sim.topology import Topology
    from netagg.sim.topology_serve import parse_shape
    from netagg.sim.topology_watch import SpineUses

    console = Console(stderr=True, quiet=quiet)
    leaves, spines = parse_shape(shape)
    if uplink_down_at is not None and not 0 <= uplink_down_at < 1:
        raise ValueError(f"--uplink-down-at is a share of the run in [0, 1), not "
                         f"{uplink_down_at}")
    report = {"topology": shape, "leaves": leaves, "spines": spines, "backend": backend,
              "transport": "in-process", "workers": workers, "values": values,
              "dtype": dtype, "steps": steps, "uplink_down_at": uplink_down_at,
              "verified": False, "errors": []}
    try:
        topology = Topology(leaves, spines, backend, make=make, faults=faults,
                            max_workers=max(8, -(-workers // leaves)))
    except NotImplementedError as e:
        report["errors"].append(str(e))
        console.print(f"netagg demo --topology: {e}")
        return report
    console.print(f"netagg demo: {workers} workers over {leaves} leaves and {spines} spines "
                  f"({backend}), {values:,} {dtype} values each in {steps} tensors"
                  + (f"; the last spine's uplinks go down at {uplink_down_at:.0%}"
                     if uplink_down_at is not None else ""))
    session = uuid.uuid4().hex
    inputs = [demo_data(r, values, seed, dtype) for r in range(workers)]
    pieces = [np.array_split(x, steps) for x in inputs]
    outs: list[list] = [[] for _ in range(workers)]
    ws: list = []
    cut_at = cut = None
    watch = SpineUses() if uplink_down_at is not None else None
    topology.tap = watch
    t0 = time.perf_counter()
    try:
        for r in range(workers):        # each one made is closed below, whatever fails
            ws.append(Worker(r, workers, None, session=session, fabric=topology,
                             timeout=timeout))
        t0 = time.perf_counter()
        # with a cut, the tensors after it go in flight once the ones before are complete,
        # so that the spine fails holding some of them
        split = steps if uplink_down_at is None else max(1, math.ceil(uplink_down_at * steps))
        handles = [[w.allreduce_async(p) for p in ps[:split]] for w, ps in zip(ws, pieces)]
        for step in range(steps):
            if step == split:
                for w, ps, hs in zip(ws, pieces, handles):
                    hs += [w.allreduce_async(p) for p in ps[split:]]
                cut = cut_spine(topology, spines - 1, watch)
                cut_at = split
            for r in range(workers):
                outs[r].append(handles[r][step].wait(timeout))
    except Exception as e:          # the report says what failed
        report["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        seconds = time.perf_counter() - t0
        counters = []
        for w in ws:
            try:
                counters.append(w.counters())
            except Exception as e:
                report["errors"].append(f"rank {w.rank}'s counters: {type(e).__name__}: {e}")
            finally:
                w.close()
    report.update(seconds=round(seconds, 3), cut_after_tensors=cut_at, cut=cut,
                  partials=topology.partials(), frames_between_switches=topology.hops,
                  links_lost=sum(link.lost for link in topology.link_list),
                  retransmissions=sum(c.get("retransmissions", 0) for c in counters),
                  packets_sent=sum(c.get("packets_sent", 0) for c in counters),
                  fabric_counters=fabric_counters(topology))
    if not report["errors"]:
        results = [np.concatenate(o) for o in outs]
        checks = [check_result(res, inputs, [len(p) for p in pieces[0]]) for res in results]
        digests = {hashlib.sha256(res.tobytes()).hexdigest() for res in results}
        report.update(max_error=max(c["max_error"] for c in checks),
                      results_agree=len(digests) == 1,
                      verified=all(c["ok"] for c in checks) and len(digests) == 1)
    if not quiet:
        print(f"verified       {'yes' if report['verified'] else 'NO'} ({workers} workers, "
              f"{leaves}x{spines}, {seconds:.2f} s)\n"
              f"partials up    {report['partials']}\n"
              f"between        {report['frames_between_switches']:,} frames, "
              f"{report['links_lost']:,} lost\n"
              f"retransmitted  {report['retransmissions']:,}"
              + (f"\ncut            {cut['spine']} after {cut_at} tensors, with "
                 f"{cut['uses_in_flight']} uses in flight" if cut else "")
              + "".join(f"\nerror          {e}" for e in report["errors"]))
    return report


def demo_described(fabric, workers: int = 8, values: int = 200_000, steps: int = 8,
                   quiet: bool = False, timeout: float = 60.0) -> dict:
    """Worker processes over UDP against the fabric `fabric` describes (`host.fabric`: its
    JSON, its file or a dict), each naming its leaf; the report of `apps.demo.run_workers`."""
    from rich.console import Console

    from netagg.apps.demo import run_workers
    from netagg.host.fabric import Fabric
    described = Fabric.load(fabric)
    console = Console(stderr=True, quiet=quiet)
    console.print(f"netagg demo: {workers} worker processes over "
                  + ", ".join(f"{leaf.name} ({leaf.url})" for leaf in described.leaves)
                  + f" and {len(described.spines)} spines, {values:,} float32 values each")
    report = run_workers(None, workers=workers, nodes=workers, values=values, steps=steps,
                         timeout=timeout, fabric=described.to_dict())
    report["fabric"] = described.to_dict()
    if not quiet:
        print(f"verified       {'yes' if report['verified'] else 'NO'} ({workers} workers, "
              f"{report['seconds']:.2f} s, {report['goodput_MBps']:.2f} MB/s per worker)"
              + "".join(f"\nerror          {e}" for e in report["errors"]))
    return report
