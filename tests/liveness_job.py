"""One worker process of tests/test_liveness.py over UDP:

    python -m tests.liveness_job URL RANK WORLD SESSION VALUES [--gate] [--late SECONDS]
                                 [--local-size L] [--fabric FILE]

joins the switch at URL as RANK of WORLD (hierarchical with `--local-size`; with `--fabric`,
the leaf and spine fabric FILE describes, at the leaf its rank sits on, URL unused), says so,
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


def say(event: str, when: float | None = None, **fields):
    when = time.monotonic() if when is None else when
    print(json.dumps({"event": event, "time": when, **fields}), flush=True)


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
    p.add_argument("--fabric")
    a = p.parse_args()
    with Worker(a.rank, a.world, None if a.fabric else a.url, session=a.session, timeout=30,
                local_size=a.local_size, fabric=a.fabric) as w:
        say("ready")
        if a.gate:
            sys.stdin.readline()
        time.sleep(a.late)
        handle = w.allreduce_async(np.full(a.values, a.rank + 1, np.int32))
        outcome = {}
        waiter = threading.Thread(target=wait, args=(handle, outcome))
        waiter.start()          # (a hierarchical allreduce goes on the network in its wait)
        while w.counters().get("packets_sent", 0) == 0 and waiter.is_alive():
            time.sleep(0.001)
        say("submitted")
        waiter.join()
        e = outcome.get("error")
        if e is not None:
            c = w.counters()
            say("error", outcome["when"], type=type(e).__name__, message=str(e),
                job=getattr(e, "job", None), ranks=list(getattr(e, "ranks", ())),
                counters={k: c.get(k, 0) for k in ("beats", "beat_reads", "retransmissions",
                                                   "control_retransmissions")})
        else:
            expected = a.world * (a.world + 1) // 2
            say("done", outcome["when"],
                exact=bool(np.array_equal(outcome["total"], np.full(a.values, expected))))


def wait(handle, outcome: dict):
    """The allreduce's end, and when (the main thread says it, after "submitted")."""
    try:
        outcome["total"] = handle.wait()
    except Exception as e:
        outcome["error"] = e
    outcome["when"] = time.monotonic()


if __name__ == "__main__":
    main()
