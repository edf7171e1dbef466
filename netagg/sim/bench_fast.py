"""How many contributions a second the fast switch (`sim.fast`) takes: in memory on one core,
and over UDP through `netagg sim serve --backend fast`.

`in_memory` configures one job of `workers` workers over `slots` slots through control
frames, and builds `uses` uses of every slot by every worker beforehand (`lanes` int32 lanes
each, rank r's lanes all r + 1, MSN use * slots + slot, versions alternating): frames as a
worker's kernel sends them, with the canonical headers. Each worker's window, one use of
every slot, is one run (`send_run`, as `sim serve` hands the switch a GRO run), the workers
in turn, the last worker's run completing every use of the window, whose results go to every
worker (taken with `sent_runs`, as `sim serve` takes them: a `FrameRun` per destination).
When every use has been sent the job is configured again (CONFIG clears its slots and
COMPLETED) and the uses are sent again, until `seconds` have passed. Every result's first
lane is checked (the sum of the ranks' r + 1) and every result counted. The figures are
contributions per second of the switch's calls (`send_run` and `sent_runs`, timed; the
checks apart), and per CPU second of this process, which runs one thread.

`bench_fast` gives both: `in_memory`'s and `sim.bench.contributions_per_second("fast")`'s
(`workers` worker-like senders over UDP on loopback, each with a use of every one of
`slots` slots in flight, the switch in a process of its own).
"""

from __future__ import annotations

import time

import numpy as np

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.model import BENCH_KEY

SWITCH = W.Endpoint("10.0.0.1", W.ROCEV2_PORT, 0x02AA00000001)
MANAGER = W.Endpoint("10.0.255.254", 0xD000, 0x02BB000000FE)


def _worker(rank: int) -> W.Endpoint:
    return W.Endpoint(f"10.0.1.{rank + 1}", 0xC100 + rank, 0x020000000100 + rank)


def _control(switch, records):
    switch.send(0, W.control_request(records, 0, MANAGER, SWITCH).frame())
    switch.run()


def _configure(switch, workers: int, slots: int):
    """One job (job 0) of `workers` workers over slots 0 .. slots - 1, no credit limit."""
    _control(switch, [(R.WRITE | R.REG_MAC_HI, SWITCH.mac >> 32),
                      (R.WRITE | R.REG_MAC_LO, SWITCH.mac & 0xFFFFFFFF),
                      (R.WRITE | R.REG_IP, W.ip_to_int(SWITCH.ip)),
                      (R.WRITE | R.job_reg(0, R.JOB_CONFIG), 0)])
    for rank in range(workers):
        _control(switch, [(R.WRITE | a, v) for a, v in W.entry_records(
            0, rank, rank % switch.ports, _worker(rank), 0x100 + rank, va=rank << 40,
            rkey=0x5EED0000 + rank)])
    _control(switch, [(R.WRITE | R.job_reg(0, reg), value) for reg, value in (
        (R.JOB_SLOT_BASE, 0), (R.JOB_SLOT_COUNT, slots), (R.JOB_CREDITS, 0),
        (R.JOB_QUORUM, 0), (R.JOB_KEY, BENCH_KEY),
        (R.JOB_CONFIG, R.CONFIG.pack(enable=1, workers=workers)))])


def _windows(workers: int, slots: int, lanes: int, uses: int) -> list[list[tuple]]:
    """Per use, per worker: (switch port, heads, datagrams, length) of its window."""
    out = []
    for use in range(uses):
        row = []
        for rank in range(workers):
            payload = np.full(lanes, rank + 1, "<i4").tobytes()
            frames = [W.contribution(job=0, rank=rank, slot=slot, version=use % 2,
                                     offset=slot * len(payload), lanes=payload, psn=use,
                                     src=_worker(rank), dst=SWITCH, key=BENCH_KEY,
                                     msn=use * slots + slot).frame()
                      for slot in range(slots)]
            size = len(frames[0]) - W.BTH_OFFSET
            row.append((rank % 4, tuple(f[:W.BTH_OFFSET] for f in frames),
                        b"".join(f[W.BTH_OFFSET:] for f in frames), size))
        out.append(row)
    return out


def in_memory(workers: int = 8, lanes: int = 256, slots: int = 64, uses: int = 8,
              seconds: float = 2.0) -> dict:
    """The fast switch's contributions per second in memory (see the module)."""
    from netagg.sim.fast import FastSwitch

    switch = FastSwitch(ports=4, jobs=1, max_workers=max(8, workers), slots=slots)
    windows = _windows(workers, slots, lanes, uses)
    want = workers * (workers + 1) // 2
    contributions = results = errors = 0
    busy = 0.0
    cpu, wall = time.process_time(), time.perf_counter()
    while busy < seconds:
        _configure(switch, workers, slots)
        for row in windows:
            for port, heads, body, size in row:
                t0 = time.perf_counter()
                switch.send_run(port % switch.ports, heads, body, size)
                runs = switch.sent_runs()
                busy += time.perf_counter() - t0
                contributions += len(heads)
                for run in runs:
                    first = np.frombuffer(run.body, "<i4").reshape(len(run), -1)[
                        :, (W.WRITE_IMM_HEAD_LEN) // 4]
                    errors += int((first != want).sum())
                    results += len(run)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"contributions": contributions, "results": results, "errors": errors,
            "switch_seconds": round(busy, 3),
            "contributions_per_second": contributions / busy,
            "contributions_per_cpu_second": contributions / cpu, "wall_seconds": round(wall, 3),
            "workers": workers, "payload_bytes": 4 * lanes, "slots": slots,
            "compiled_rows": switch.paths.compiled, "golden_frames": switch.paths.golden}


def bench_fast(workers: int = 8, seconds: float = 2.0, slots: int = 64,
               quiet: bool = False) -> dict:
    """`in_memory` and `sim.bench.contributions_per_second("fast")`, `workers` workers and
    `slots` slots each."""
    from rich.console import Console

    from netagg.sim.bench import contributions_per_second
    console = Console(stderr=True, quiet=quiet)
    with console.status("the fast switch in memory ..."):
        memory = in_memory(workers=workers, slots=slots, seconds=seconds)
    with console.status(f"the fast switch over UDP, {workers} senders ..."):
        udp = contributions_per_second("fast", senders=workers, seconds=seconds, slots=slots)
    return {"in_memory": memory, "udp": udp}
