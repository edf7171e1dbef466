"""A rank whose process is gone is named by the survivors within 2 s, from the heartbeats the
switch keeps (`host.liveness`); a rank that is only slow is not: the BEAT registers on the
golden model and the RTL, and workers in process and in their own processes over UDP through
`netagg sim serve` (golden and RTL), one of them killed or late; a hierarchical run's killed
local worker on one switch and across a leaf and spine fabric."""

from __future__ import annotations

import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import types
import uuid

import numpy as np
import pytest

from netagg.apps.probe import probe
from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import SwitchControl, Worker, liveness
from netagg.host import numerics as N
from netagg.host.errors import NetaggRankGone
from netagg.sim.golden import GoldenSwitch
from tests.host_workers import in_threads, workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMED_WITHIN = 2.5      # seconds from the kill to every survivor's error (the aim is 2 s)
STALL = 0.3             # a gap this long in a thread ticking every 10 ms: the machine stalled


class Stalls(threading.Thread):
    """The longest gap of a thread that ticks every 10 ms while the context lasts: whether
    the processes were stopped for a while (the sandbox pauses them now and then), which no
    timing can be measured through."""

    def __init__(self):
        super().__init__(daemon=True)
        self.longest, self.done = 0.0, threading.Event()

    def run(self):
        last = time.monotonic()
        while not self.done.wait(0.01):
            now = time.monotonic()
            self.longest, last = max(self.longest, now - last), now

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.join()


def named_in_time(scenario, attempts: int = 3):
    """`scenario()` (which asserts what the survivors' errors say) returns when each error
    came and when the rank was killed: all within NAMED_WITHIN, or the attempt is made again
    if the machine stalled meanwhile (a late error without a stall fails)."""
    for _ in range(attempts):
        with Stalls() as stalls:
            times, killed = scenario()
        late = [round(t - killed, 3) for t in times if t - killed >= NAMED_WITHIN]
        if not late:
            return
        assert stalls.longest > STALL, f"named {late} s after the kill, with no stall"
    pytest.fail(f"named late ({late} s) in each of {attempts} attempts, each with a stall")


# --- the registers ---------------------------------------------------------------------------

def _beats_read_back(switch, jobs: int, max_workers: int):
    """Every (job, rank)'s BEAT register reads 0 after reset and then what the manager wrote;
    beyond the switch's jobs and ranks it reads 0 and keeps nothing."""
    ctl = SwitchControl(switch)
    try:
        ctl.set_manager()
        every = [R.beat_reg(j, r) for j in range(jobs) for r in range(max_workers)]
        assert ctl.read(*every) == [0] * len(every)
        values = [(0x9E3779B9 * (i + 1)) & 0xFFFFFFFF for i in range(len(every))]
        assert ctl.write(list(zip(every, values))) == values
        assert ctl.read(*every) == values
        outside = [R.beat_reg(jobs, 0), R.beat_reg(0, max_workers), R.beat_reg(jobs - 1, 31),
                   R.BEAT_BASE + W.MAX_JOBS * R.BEAT_STRIDE]
        outside = [a for a in outside if a not in every]
        assert ctl.write([(a, 0x1234) for a in outside]) == [0] * len(outside)
        # a write and a read of one register in one request: the read sees the write
        a = every[-1]
        assert [v for _, v in ctl.control.request([(R.WRITE | a, 77), (a, 0), (every[0], 0)])] \
            == [77, 77, values[0]]
    finally:
        ctl.close()


def _beats_only_from_their_rank(switch):
    """A rank's BEAT takes a write from the address its entry holds, or the manager's: a
    stranger's write, or one to a rank whose entry holds no address, leaves it as it was and
    is counted (`control_denied`, the request's port), so no process keeps a dead rank's beat
    moving."""
    rank, stranger = SwitchControl(switch, ip="10.0.9.1"), SwitchControl(switch, ip="10.0.9.2")
    try:
        rank.write([(R.worker_reg(0, 1, R.WORKER_IP), W.ip_to_int("10.0.9.1"))])

        def denied() -> int:
            return sum(p["control_denied"] for p in rank.counters(jobs=[])["ports"].values())
        before = denied()
        assert rank.write([(R.beat_reg(0, 1), 0x101)]) == [0x101]       # its own
        assert stranger.write([(R.beat_reg(0, 1), 0x202)]) == [0x101]   # another's: refused
        assert stranger.write([(R.beat_reg(0, 2), 0x303)]) == [0]       # no rank there
        assert rank.write([(R.beat_reg(0, 2), 0x404)]) == [0]           # another rank's
        assert denied() - before == 3
        stranger.set_manager()
        assert stranger.write([(R.beat_reg(0, 1), 0x505), (R.beat_reg(0, 2), 0x606)]) \
            == [0x505, 0x606]                                            # the manager's
        assert rank.write([(R.beat_reg(0, 1), 0x707)]) == [0x707]       # and its own still
        assert denied() - before == 3
    finally:
        rank.close()
        stranger.close()


def test_beat_registers_read_back_golden():
    _beats_read_back(GoldenSwitch(jobs=3, max_workers=5), 3, 5)
    _beats_only_from_their_rank(GoldenSwitch(jobs=3, max_workers=5))


def test_beat_registers_read_back_rtl():
    from netagg.sim.model import make_switch

    with make_switch() as rtl:
        _beats_read_back(rtl, 4, 8)
    with make_switch() as rtl:
        _beats_only_from_their_rank(rtl)


# --- in process --------------------------------------------------------------------------------

def test_gone_rank_is_named_in_process():
    """4 in-process workers; rank 3 stops (its engine is no longer driven: no contribution, no
    heartbeat) after it began: the three others fail, each within 2 s, naming rank 3 of
    job 0, how long its beat stood still and which slot waits."""
    named_in_time(_stop_rank_3_in_process)


def _stop_rank_3_in_process() -> tuple[list[float], float]:
    ws = workers(4, timeout=20)
    hub = ws[0].transport.driver
    try:
        handles = [w.allreduce_async(np.full(200 * N.LANES, r + 1, np.int32))
                   for r, w in enumerate(ws)]
        while ws[3].engine.stats["packets_sent"] == 0:
            hub.drive()
        hub.engines.remove(ws[3].engine)            # rank 3 is gone
        killed, named = time.monotonic(), []
        for h in handles[:3]:
            with pytest.raises(NetaggRankGone, match=r"rank 3 of job 0 is gone: its heartbeat"
                               r" .* not moved for \d\.\d s .*waits: slot \d+ \(use"):
                h.wait()
            named.append(time.monotonic())
        assert [w.engine.failed.ranks for w in ws[:3]] == [(3,)] * 3
        assert all(w.engine.failed.job == 0 for w in ws[:3])
        return named, killed
    finally:
        for w in ws:
            w.close()


def test_slow_rank_is_not_gone_in_process():
    """Rank 3 begins its allreduce 4 s after the others (alive, its engine driven by their
    waits, so it beats): no error, the exact sum."""
    ws = workers(4, timeout=20)

    def run(r):
        if r == 3:
            time.sleep(4.0)
        return ws[r].allreduce(np.full(3 * N.LANES, r + 1, np.int32))
    try:
        results = in_threads(run, 4)
    finally:
        for w in ws:
            w.close()
    assert all(np.array_equal(x, np.full(3 * N.LANES, 10)) for x in results)
    assert ws[0].counters()["beat_reads"] >= 10


def test_a_rank_that_never_beat_is_left_to_the_timeout():
    """A beat without this session's mark (left by an earlier run, or 0) is a rank that has
    not started: it is not named gone, and the bounded wait says a peer is missing."""
    switch = GoldenSwitch()
    ctl = SwitchControl(switch)
    ctl.set_manager()                                    # (a beat takes the manager's write)
    ctl.write([(R.beat_reg(0, 2), 0x12345601), (R.REG_MANAGER, 0)])   # left by an earlier run
    session = uuid.uuid4().hex
    ws = [Worker(r, 3, switch, session=session, timeout=3.0) for r in range(2)]  # 2 never
    try:
        handles = [w.allreduce_async(np.ones(10, np.int32)) for w in ws]
        with pytest.raises(Exception, match="a peer of this job stopped contributing") as e:
            handles[0].wait()
        assert not isinstance(e.value, NetaggRankGone)
        assert ws[0].counters()["beat_reads"] >= 8
        mark = ws[0].engine.liveness.mark
        beats = ctl.read(*(R.beat_reg(0, r) for r in range(3)))
        assert [b >> liveness.COUNT_BITS for b in beats] == [mark, mark, 0x123456]
    finally:
        for w in ws:
            w.close()


def test_judging_needs_another_rank_to_move():
    """Reads every READ_PERIOD: a beat that stands still while every other also does (the
    switch or the whole machine stalled) names nobody; one that stands still for DEAD_AFTER
    while another moves is gone; a beat without the session's mark (a rank not started in
    this run) never is; a read after a gap in the watch starts it again."""
    period, tag = liveness.READ_PERIOD, 0x80ABCDEF

    def beat(count, mark=tag & 0xFFFFFF):
        return mark << liveness.COUNT_BITS | count

    def watch(live, start, reads, beats):
        for i in range(reads):
            t = start + i * period
            live.judge(t, t, beats(i))
        return t

    still = liveness.Liveness(None, job=1, rank=0, workers=3, session_tag=tag, stats={})
    watch(still, 10.0, 20, lambda i: [beat(5), beat(7), beat(9)])
    assert still.gone == []
    live = liveness.Liveness(None, job=1, rank=0, workers=4, session_tag=tag, stats={})
    needed = round(liveness.DEAD_AFTER / period)
    others = [beat(7), 0, beat(7, mark=0x5A5A5A)]       # rank 1 stops; 2, 3 not started
    t = watch(live, 10.0, needed, lambda i: [beat(i + 1), *others])
    assert live.gone == []                          # still for DEAD_AFTER - period
    live.judge(t + period, t + period, [beat(needed + 1), *others])
    assert [g.rank for g in live.gone] == [1]
    assert live.gone[0].silent == pytest.approx(liveness.DEAD_AFTER)
    assert "rank 1 of job 1 is gone" in live.describe()
    later = t + period + liveness.READ_GAP + 0.1
    live.judge(later, later, [beat(needed + 5), *others])    # after a gap: a new watch
    assert live.gone == []
    # a worker that stalls (its engine did not step for READ_GAP) starts its watch again
    engine = types.SimpleNamespace(pending_works=1, joined=True, last_progress=0.0,
                                   stuck=lambda: "slot 5 (use 2) sent 3 times")
    live.next_beat = live.next_read = math.inf      # (no requests: no control channel)
    t = watch(live, 30.0, needed + 1, lambda i: [beat(i + 1), *others])
    with pytest.raises(NetaggRankGone, match=r"rank 1 of job 1 is gone: .* 1\.5 s .*; rank 0 "
                                             r"of 4 waits: slot 5 \(use 2\)") as e:
        live.watch(engine, t)
    assert (e.value.job, e.value.ranks) == (1, (1,))
    live.watch(engine, t + liveness.READ_GAP + 0.5)
    assert live.seen == {} and live.gone == []


# --- worker processes over UDP ----------------------------------------------------------------

@pytest.fixture
def serve(request):
    """`netagg sim serve` in its own process (golden, or the RTL when the test asks)."""
    yield from _serve(request.param)


def _serve(backend: str):
    proc = subprocess.Popen(
        [sys.executable, "-m", "netagg.apps.cli", "sim", "serve", "--backend", backend],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": ROOT})
    url = proc.stdout.readline().strip()    # the RTL may be built first
    assert url.startswith("udp://127."), f"netagg sim serve said {url!r}"
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def serve_golden():
    """`netagg sim serve` with the golden model, in its own process."""
    yield from _serve("golden")


class WorkerProcess:
    """tests/liveness_job.py in its own process; its events, as they come."""

    def __init__(self, url: str, rank: int, session: str, values: int, *options: str):
        self.rank = rank
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.liveness_job", url, str(rank), str(WORLD), session,
             str(values), *options],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": ROOT})
        self.events: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put({"event": "exit", "time": time.monotonic()})

    def expect(self, event: str, within: float) -> dict:
        got = self.events.get(timeout=within)
        assert got["event"] == event, f"rank {self.rank}: {got} (expected {event})"
        return got

    def outcome(self, within: float) -> dict:
        """The allreduce's end ("done", "error", or the process's "exit"), past "submitted"."""
        while (got := self.events.get(timeout=within))["event"] == "submitted":
            pass
        return got

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


WORLD = 4


def _kill_rank_3(url: str, *options: str) -> tuple[list[dict], float]:
    """4 worker processes (`options` for each); rank 3 is SIGKILLed once it has sent part of
    its allreduce, the others in theirs (waiting on it, or hierarchical: node 0's two local
    workers). What the three others ended in, and when the kill was."""
    session = uuid.uuid4().hex
    procs = [WorkerProcess(url, r, session, 2000 * N.LANES, *options,
                           *(["--gate"] if r == 3 else [])) for r in range(WORLD)]
    try:
        for p in procs:
            p.expect("ready", 120)
        for p in procs[:2 if "--local-size" in options else 3]:
            p.expect("submitted", 60)
        procs[3].go()
        procs[3].expect("submitted", 60)
        os.kill(procs[3].proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        return [p.outcome(20 + NAMED_WITHIN) for p in procs[:3]], killed
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("serve", ["golden", "rtl"], indirect=True)
def test_killed_rank_is_named_over_udp(serve):
    """4 worker processes; rank 3 is SIGKILLed once it has sent part of its allreduce (the
    others are in theirs, waiting on it): each of the three names rank 3 of job 0 within
    2 s of the kill."""
    def scenario():
        ends, killed = _kill_rank_3(serve)
        for e in ends:
            assert e["type"] == "NetaggRankGone" and e["job"] == 0 and e["ranks"] == [3], e
            assert re.match(r"rank 3 of job 0 is gone: its heartbeat .* for \d\.\d s",
                            e["message"])
        return [e["time"] for e in ends], killed
    named_in_time(scenario)


@pytest.mark.parametrize("serve", ["golden", "rtl"], indirect=True)
def test_slow_rank_is_not_named_over_udp(serve):
    """Rank 3 joins its allreduce 4 s after the others began theirs (alive, beating): no
    error, the exact sum on every rank."""
    session = uuid.uuid4().hex
    procs = [WorkerProcess(serve, r, session, 3 * N.LANES, *(["--late", "4"] if r == 3 else []))
             for r in range(WORLD)]
    try:
        for p in procs:
            p.expect("ready", 120)
        begun = [p.expect("submitted", 60)["time"] for p in procs]
        assert begun[3] - max(begun[:3]) > 3.0
        for p in procs:
            assert p.expect("done", 30)["exact"]
        beats = probe(serve)["jobs"][0]["beats"]        # every rank beat, in this session
        assert len(beats) == WORLD and len({b >> liveness.COUNT_BITS for b in beats}) == 1
        assert beats[0] >> liveness.COUNT_BITS != 0     # this run's mark (a closed rank's
        #                                                 last beat has the count 0)
    finally:
        for p in procs:
            p.stop()


def _node_says_rank_3_is_gone(ends):
    """Rank 2, world rank 3's node peer, names its process gone; rank 0 says its local worker
    1 failed."""
    assert "ranks [3] of job 0 (local workers [1] of node 1) are gone" in \
        ends[2]["message"], ends[2]
    assert "ranks [1] of job 0 (local workers [1] of node 0) failed" in \
        ends[0]["message"], ends[0]


def test_killed_rank_is_named_in_a_hierarchical_run(serve_golden):
    """2 nodes of 2 local workers (switch jobs 0 and 1, the node as the switch rank); world
    rank 3 (node 1's local worker 1: job 1, rank 1) is SIGKILLed in its allreduce. Within
    2 s: rank 1 names rank 1 of job 1 gone (its heartbeat); rank 2, its node peer, names
    world rank 3's process gone; rank 0 says its local worker 1 failed (no incomplete
    result is returned)."""
    def scenario():
        ends, killed = _kill_rank_3(serve_golden, "--local-size", "2")
        assert all(e["event"] == "error" for e in ends), ends
        assert ends[1]["type"] == "NetaggRankGone" and ends[1]["ranks"] == [1], ends[1]
        assert ends[1]["message"].startswith("rank 1 of job 1 is gone"), ends[1]
        _node_says_rank_3_is_gone(ends)
        return [e["time"] for e in ends], killed
    named_in_time(scenario)


@pytest.fixture
def serve_fabric(tmp_path):
    """`netagg sim serve --topology 2x2`'s server (golden), its description in a file."""
    from netagg.sim.topology_serve import FabricServer
    with FabricServer(2, 2).start() as server:
        path = tmp_path / "fabric.json"
        path.write_text(json.dumps(server.describe()))
        yield str(path)


def test_killed_local_worker_is_named_in_a_hierarchical_fabric_run(serve_fabric):
    """The hierarchical case above across a 2x2 fabric: node 0 at leaf0, node 1 at leaf1,
    switch jobs 0 and 1 at every switch. World rank 3 (node 1's local worker 1: job 1, rank 0
    at leaf1) is SIGKILLed in its allreduce. Within 2 s: rank 1 (job 1 at leaf0) names it from
    its heartbeat in leaf1, by world rank, node, rank at its leaf and the leaf; rank 2, its node
    peer, names its process gone; rank 0 says its local worker 1 failed."""
    def scenario():
        ends, killed = _kill_rank_3("fabric", "--local-size", "2", "--fabric", serve_fabric)
        assert all(e["event"] == "error" for e in ends), ends
        assert ends[1]["type"] == "NetaggRankGone" and ends[1]["ranks"] == [1], ends[1]
        assert ends[1]["job"] == 1, ends[1]
        assert ends[1]["message"].startswith("rank 3 (node 1, rank 0 at leaf1) of job 1 gone: "
                                             "heartbeats in leaf1 still"), ends[1]
        _node_says_rank_3_is_gone(ends)
        return [e["time"] for e in ends], killed
    named_in_time(scenario)
