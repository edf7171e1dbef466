"""One worker process of tests/test_liveness.py over UDP:

    python -m tests.liveness_job URL RANK WORLD SESSION VALUES [--gate] [--late SECONDS]
                                 [--local-size L]

joins the switch at URL as RANK of WORLD (hierarchical with `--local-size`), says so,
waits for a line on stdin (`--gate`) or `--late` seconds (alive all the while, so beating),
starts an allreduce (int32 sum) of VALUES values (rank r's are all r + 1), says so once it
has sent a contribution, and waits for it. It writes one JSON object a line to stdout:
{"event": "ready"}, {"event": "submitted"}, then {"event": "done", "exact": ...} or
{"event": "error", "type", "message", "job", "ranks"}, each with "time", the machine's
monotonic clock (the test's too)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np
from netagg.host import Worker


def say(event: str, **fields):
    line = json.dumps({"event": event, "time": time.monotonic(), **fields}) + "\n"
    sys.stdout.write(line)          # one write: the waiting thread says things too
    sys.stdout.flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("rank", type=int)
    p.add_argument("world", type=int)
    p.add_argument("session")
    p.add_argument("values", type=int)
    p.add_argument("--gate", action="store_true")
    p.add_argument("--late", type=float, default=0.0)
    p.add_argument("--local-size", type=int, default=1)
    a = p.parse_args()
    with Worker(a.rank, a.world, a.url, session=a.session, timeout=30,
                local_size=a.local_size) as w:
        say("ready")
        if a.gate:
            sys.stdin.readline()
        time.sleep(a.late)
        handle = w.allreduce_async(np.full(a.values, a.rank + 1, np.int32))
        waiter = threading.Thread(target=wait, args=(handle, a.world, a.values))
        waiter.start()          # (a hierarchical allreduce goes on the network in its wait)
        while w.counters().get("packets_sent", 0) == 0 and waiter.is_alive():
            time.sleep(0.001)
        say("submitted")
        waiter.join()


def wait(handle, world: int, values: int):
    try:
        total = handle.wait()
    except Exception as e:
        say("error", type=type(e).__name__, message=str(e),
            job=getattr(e, "job", None), ranks=list(getattr(e, "ranks", ())))
    else:
        expected = world * (world + 1) // 2
        say("done", exact=bool(np.array_equal(total, np.full(values, expected))))


if __name__ == "__main__":
    main()
