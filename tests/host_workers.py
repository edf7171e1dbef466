"""In-process workers against the golden model, for the host driver's tests: a job's workers,
a cooperative allreduce, threads, the fixed-point error bound, the switch's counters, and a
golden model that records what it sees."""

from __future__ import annotations

import threading
import uuid

import numpy as np

from netagg.contract import wire as W
from netagg.host import Worker
from netagg.host import numerics as N
from netagg.sim.golden import GoldenSwitch


def workers(n, switch=None, **kw):
    switch = switch or GoldenSwitch()
    session = kw.pop("session", uuid.uuid4().hex)
    return [Worker(r, n, switch, session=session, **kw) for r in range(n)]


def allreduce_all(ws, inputs, **kw):
    """Cooperative in-process allreduce: start every worker, then wait."""
    handles = [w.allreduce_async(x, **kw) for w, x in zip(ws, inputs)]
    return [h.wait() for h in handles]


def in_threads(fn, n):
    out, errors = [None] * n, []

    def run(i):
        try:
            out[i] = fn(i)
        except BaseException as e:       # re-raised below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


def assert_within_bound(result, inputs, fmt, mean=False, frac=None):
    exact = np.sum([N.to_float64(x, fmt) for x in inputs], axis=0)
    if mean:
        exact = exact / len(inputs)
    got = N.to_float64(result, fmt)
    bound = N.error_bound(got, N.shared_exponents(inputs, fmt), len(inputs), fmt, frac=frac,
                          mean=mean)
    err = np.abs(got - exact)
    assert np.all(err <= bound), f"error {err.max()} beyond the bound at {np.argmax(err - bound)}"
    return err.max()


def switch_counters(switch):
    c = GoldenSwitch.counters(switch)
    return {"drop_priority": sum(p["drop_priority"] for p in c["ports"]), **c["jobs"][0]}


class RecordingSwitch(GoldenSwitch):
    """The golden model, noting the switch port and PSN of every contribution, per sender,
    and every contribution and result packet."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen = {}             # source IP -> [(port, psn)] in arrival order
        self.contributions = []    # packets, in arrival order
        self.results = []

    def send(self, port, frame, *args):
        pkt = W.parse_frame(frame)
        if pkt.opcode == W.OP_CONTRIBUTION:
            self.seen.setdefault(pkt.src.ip, []).append((port, pkt.psn))
            self.contributions.append(pkt)
        super().send(port, frame, *args)

    def run(self):
        out = super().run()
        self.results += [W.parse_frame(f) for _, f in out
                         if W.parse_frame(f).opcode == W.OP_RESULT]
        return out
