"""Failures named right and in seconds: a switch that stops answering mid-allreduce is named
by every rank (`NetaggSwitchGone`, its address and its last answer) 2 s after its last
answer, over UDP through `netagg sim serve`'s server (in a thread, and its process killed)
and in process, up to torch's `Work.wait()`; a switch slow under load is not; a host that
cannot reach the switch (no route, its address gone, its link down mid-run) is a
`NetaggUnreachable` naming the rank, the job, the switch and the OS's reason, at once, while a
full buffer only loses a packet; the bounded wait names the ranks that never joined; and a
switch that never answers (nothing serves at its address, or a process there that never
answers) is named within 2 s of joining, not after the 20 s timeout."""

from __future__ import annotations

import errno
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
import uuid

import numpy as np
import pytest

from netagg.contract import wire as W
from netagg.host import Worker, liveness
from netagg.host import numerics as N
from netagg.host import transport as T
from netagg.host.errors import (
    NetaggError,
    NetaggJobTakenOver,
    NetaggRankGone,
    NetaggSwitchGone,
    NetaggTimeout,
    NetaggUnreachable,
)
from netagg.sim.golden import GoldenSwitch
from netagg.sim.serve import SimServer, make_backend
from tests.host_workers import in_threads, workers
from tests.test_liveness import ROOT, STALL, Stalls, WorkerProcess

NAMED_WITHIN = 6.0      # seconds from the switch's death to every rank's error (aim: 1.5)


def in_time(scenario, within: float = NAMED_WITHIN, attempts: int = 3):
    """`scenario()` returns when each error came and when the switch died: all within
    `within`, or the attempt is made again if the machine stalled meanwhile (a late error
    without a stall fails)."""
    for _ in range(attempts):
        with Stalls() as stalls:
            times, died = scenario()
        late = [round(t - died, 3) for t in times if t - died >= within]
        if not late:
            return [round(t - died, 3) for t in times]
        assert stalls.longest > STALL, f"named {late} s after the switch died, with no stall"
    pytest.fail(f"named late ({late} s) in each of {attempts} attempts, each with a stall")


class DyingSwitch(GoldenSwitch):
    """The golden model, which stops answering for good (takes nothing, sends nothing)
    once it has sent `frames` more frames (set once the workers are set up); `died`: when."""

    frames = math.inf
    died = None

    def send(self, port, frame, *args):
        if self.died is None:
            super().send(port, frame, *args)

    def run(self):
        if self.died is not None:
            return []
        out = super().run()
        self.frames -= len(out)
        if self.frames <= 0:
            self.died = time.monotonic()
        return out


class SlowSwitch(GoldenSwitch):
    """The golden model whose every frame leaves `delay` seconds after it was made: its
    answers come, late."""

    delay = 0.0

    def __init__(self, **kw):
        super().__init__(**kw)
        self.held: list[tuple[float, int, bytes]] = []

    def run(self):
        now = time.monotonic()
        self.held += [(now + self.delay, port, frame) for port, frame in super().run()]
        out = [(port, frame) for due, port, frame in self.held if due <= now]
        self.held = [h for h in self.held if h[0] > now]
        return out


SWITCH_GONE = (r"the switch at {address} is gone: rank {rank} of job 0 has had no answer from "
               r"it for (\d+\.\d) s while asking \(the last answer was to (a beat write|a beat "
               r"read|a join check|a contribution|a request it had stopped waiting for) "
               r"(\d+\.\d) s ago\); the switch, or the path to it, is down")


def assert_switch_gone(e: BaseException, address: str, rank: int):
    assert isinstance(e, NetaggSwitchGone), repr(e)
    m = re.fullmatch(SWITCH_GONE.format(address=re.escape(address), rank=rank), str(e))
    assert m, str(e)
    assert float(m[1]) >= liveness.SILENT_AFTER and float(m[3]) >= liveness.SILENT_AFTER
    assert (e.switch, e.job, e.rank) == (address, 0, rank) and e.silent >= liveness.SILENT_AFTER


# --- the switch gone --------------------------------------------------------------------------

def test_a_switch_stopped_mid_allreduce_is_named_by_every_rank_over_udp():
    """3 workers over UDP through `netagg sim serve`'s server (in a thread); the switch stops
    answering mid-allreduce and its server closes: every rank's wait raises NetaggSwitchGone
    naming the switch's address, 1.5 s or more after its last answer (up to 6 s on a loaded
    machine)."""
    def scenario():
        switch = DyingSwitch()
        server = SimServer(switch).start()
        address = f"{server.bound_ip}:{server.address[1]}"
        session = uuid.uuid4().hex
        ws = [Worker(r, 3, server.url, session=session, timeout=30) for r in range(3)]
        try:
            switch.frames = 300
            handles = [w.allreduce_async(np.full(1 << 18, r + 1, np.int32))
                       for r, w in enumerate(ws)]
            while switch.died is None:
                time.sleep(0.005)
            server.stop()                   # its sockets closed, as a killed process's
            ends = in_threads(lambda r: _end(handles[r]), 3)
            for r, (e, _) in enumerate(ends):
                assert_switch_gone(e, address, r)
            assert all(not h.works[0].done for h in handles)
            return [t for _, t in ends], switch.died
        finally:
            server.stop()
            for w in ws:
                w.close()
    took = in_time(scenario)
    assert all(t >= liveness.SILENT_AFTER - 0.3 for t in took), took


def _end(handle) -> tuple[BaseException | None, float]:
    try:
        handle.wait()
    except Exception as e:
        return e, time.monotonic()
    return None, time.monotonic()


@pytest.mark.parametrize("backend", ["golden", "rtl"])
def test_a_killed_switch_process_is_named_by_every_waiting_rank(backend):
    """`netagg sim serve` in its own process, 4 worker processes: ranks 0..2 in their
    allreduce (waiting on rank 3, which is open and beating but has not begun its own); the
    switch process is SIGKILLed: each of the three fails with NetaggSwitchGone naming the
    switch's address, 1.5 s or more after the kill (up to 6 s on a loaded machine), long
    before its 30 s timeout."""
    def scenario():
        serve = subprocess.Popen(
            [sys.executable, "-m", "netagg.apps.cli", "sim", "serve", "--backend", backend],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": ROOT})
        procs = []
        try:
            url = serve.stdout.readline().strip()
            assert url.startswith("udp://127."), f"netagg sim serve said {url!r}"
            address = url.removeprefix("udp://")
            session = uuid.uuid4().hex
            procs = [WorkerProcess(url, r, session, 2000 * N.LANES,
                                   *(["--gate"] if r == 3 else [])) for r in range(4)]
            for p in procs:
                p.expect("ready", 120)
            for p in procs[:3]:
                p.expect("submitted", 60)
            os.kill(serve.pid, signal.SIGKILL)
            killed = time.monotonic()
            ends = [p.outcome(30) for p in procs[:3]]
            for r, e in enumerate(ends):
                assert e["event"] == "error" and e["type"] == "NetaggSwitchGone", e
                m = re.fullmatch(SWITCH_GONE.format(address=re.escape(address), rank=r),
                                 e["message"])
                assert m, e["message"]
            return [e["time"] for e in ends], killed
        finally:
            for p in procs:
                p.stop()
            serve.kill()
            serve.wait(10)
    took = in_time(scenario)
    assert all(t >= liveness.SILENT_AFTER - 0.3 for t in took), took


def test_a_switch_gone_is_named_in_process():
    """3 in-process workers: the backend stops answering mid-allreduce; every wait raises
    NetaggSwitchGone naming the in-process switch's address, 1.5 s or more after its death
    (up to 6 s on a loaded machine)."""
    def scenario():
        switch = DyingSwitch()
        ws = workers(3, switch, timeout=30)
        try:
            switch.frames = 60
            handles = [w.allreduce_async(np.full(200 * N.LANES, r + 1, np.int32))
                       for r, w in enumerate(ws)]
            ends = [_end(h) for h in handles]
            for r, (e, _) in enumerate(ends):
                assert_switch_gone(e, f"{T.SWITCH_IP}:4791", r)
            return [t for _, t in ends], switch.died
        finally:
            for w in ws:
                w.close()
    in_time(scenario)


def test_a_switch_gone_fails_the_torch_work():
    """The switch gone in an allreduce fails the torch Work the group's completer waits on:
    `Work.wait()` raises NetaggSwitchGone itself, prefixed with the rank and the job."""
    torch = pytest.importorskip("torch")
    from netagg.host.torch_work import Completer, NetaggWork, Pending

    switch = DyingSwitch()
    ws = workers(2, switch, timeout=30)
    switch.frames = 20
    handles = [w.allreduce_async(np.ones(100 * N.LANES, np.int32)) for w in ws]
    completer = Completer("netagg rank 0 of 2, job 0", timeout=30)
    try:
        work = NetaggWork(completer.submit(Pending(torch.futures.Future(), lambda r: r,
                                                   handles[0])))
        with pytest.raises(NetaggSwitchGone, match=r"^netagg rank 0 of 2, job 0: "
                                                   r"NetaggSwitchGone: the switch at 10\.0\.0\.1"
                                                   r":4791 is gone: rank 0 of job 0") as e:
            work.wait()
        assert (e.value.switch, e.value.job, e.value.rank) == ("10.0.0.1:4791", 0, 0)
    finally:
        completer.close()
        for w in ws:
            w.close()


def test_a_switch_slow_under_load_is_not_gone():
    """Over UDP, every frame of the switch a third of the watch's silence late, 0.5 s (its
    answers come, thousands of times later than a loopback round trip; the workers
    retransmit meanwhile): the allreduces complete, exact, and nobody names the switch. (A
    third, not a half: on a loaded machine the server's and the workers' own delays come on
    top, and at a half one full run's took the silence past 1.5 s.)"""
    switch = SlowSwitch()
    with SimServer(switch).start() as server:
        session = uuid.uuid4().hex
        ws = [Worker(r, 3, server.url, session=session, timeout=30) for r in range(3)]
        try:
            switch.delay = liveness.SILENT_AFTER / 3
            t0 = time.monotonic()
            results = in_threads(
                lambda r: ws[r].allreduce(np.full(30 * N.LANES, r + 1, np.int32)), 3)
            took = time.monotonic() - t0
        finally:
            switch.delay = 0.0
            for w in ws:
                w.close()
    assert all(np.array_equal(x, np.full(30 * N.LANES, 6)) for x in results)
    assert took > 2 * liveness.SILENT_AFTER / 3     # late answers (a join, then results)
    assert all(w.engine.failed is None for w in ws)
    assert all(w.counters()["control_retransmissions"] > 0 for w in ws)


def test_the_switch_watch_needs_silence_while_asking_and_a_driven_engine():
    """SwitchWatch: silence just short of SILENT_AFTER names nothing, SILENT_AFTER does; a
    request that has waited less than SILENT_AFTER / 2 (the worker did not ask), no works
    waiting, or an engine that did not step for READ_GAP (a stalled worker) start nothing or
    start the watch again; an answer, late or not, starts the silence again."""
    silent = liveness.SILENT_AFTER
    control = types.SimpleNamespace(asking=None)
    heard = {"at": 100.0, "what": "a beat read"}
    engine = types.SimpleNamespace(
        pending_works=1, control=control, job=2, rank=1, me=lambda: "rank 1 of job 2",
        transport=types.SimpleNamespace(switch=types.SimpleNamespace(ip="127.9.9.9",
                                                                     port=4791)),
        last_answer=lambda: (heard["at"], heard["what"]))
    watch = liveness.SwitchWatch()

    def steps(start, until, every=0.1):
        t = start
        while t <= until + 1e-9:
            watch.watch(engine, t)
            t += every
        return t

    steps(100.0, 100.0)                     # the watch begins with the works
    control.asking = 100.1
    steps(100.1, 100.0 + silent - 0.05)     # just short of it
    said = re.escape(f"{silent:.1f}")
    with pytest.raises(NetaggSwitchGone, match=rf"^the switch at 127\.9\.9\.9:4791 is gone: "
                                               rf"rank 1 of job 2 has had no answer from it for "
                                               rf"{said} s while asking \(the last answer was to "
                                               rf"a beat read {said} s ago\)") as e:
        watch.watch(engine, 100.0 + silent)
    assert (e.value.switch, e.value.job, e.value.rank) == ("127.9.9.9:4791", 2, 1)
    control.asking = 100.0 + silent - 0.5   # (a request sent half a second ago: not asked)
    watch.watch(engine, 100.0 + silent)
    heard["at"] = 102.5                     # a late answer came: silence from then on
    control.asking = 102.6
    steps(102.6, 102.5 + silent - 0.05)
    watch.watch(engine, 106.0)              # the engine did not step for 1.5 s: a new watch
    steps(106.1, 106.0 + silent - 0.05)
    with pytest.raises(NetaggSwitchGone):
        watch.watch(engine, 106.0 + silent)
    engine.pending_works = 0                # nothing waits: no watch
    steps(110.0, 111.0)
    engine.pending_works = 1
    steps(111.1, 111.0 + silent - 0.05)
    with pytest.raises(NetaggSwitchGone):
        watch.watch(engine, 111.0 + silent)
    control.asking = None                   # not asking: nothing to judge
    watch.watch(engine, 120.0)


# --- the switch unreachable --------------------------------------------------------------------

def test_no_route_to_the_switch_is_named_at_once(monkeypatch):
    """A host whose route to the switch is gone (its link down): the worker's constructor
    raises NetaggUnreachable naming its rank, the job, the switch and the OS's reason."""
    def no_route(addr):
        raise OSError(errno.ENETUNREACH, os.strerror(errno.ENETUNREACH))
    monkeypatch.setattr(T, "route_source", no_route)
    t0 = time.monotonic()
    with pytest.raises(NetaggUnreachable) as e:
        Worker(1, 3, "udp://127.77.0.1:4791", session=uuid.uuid4().hex, timeout=20)
    assert time.monotonic() - t0 < 1.0
    assert str(e.value) == ("rank 1 of job 0 cannot reach the switch at 127.77.0.1:4791: "
                            "Network is unreachable (is this host's link down?)")
    assert e.value.errno == errno.ENETUNREACH and isinstance(e.value.__cause__, OSError)


def test_an_address_not_of_this_host_is_named_at_once():
    """`bind=` an address this host does not have: the kernel refuses it (EADDRNOTAVAIL),
    and the constructor says so, naming the address, without a packet sent."""
    with pytest.raises(NetaggUnreachable, match=r"^rank 0 of job 0 cannot reach the switch at "
                                                r"127\.77\.0\.1:4791: Cannot assign requested "
                                                r"address \(is 192\.0\.2\.7 an address of "
                                                r"this host\?\)$"):
        Worker(0, 1, "udp://127.77.0.1:4791", bind="192.0.2.7", timeout=20)


class FailingSocket:
    """A worker's socket whose sends fail with `error`: those numbered in `failing` (from
    0; by default all)."""

    def __init__(self, sock: socket.socket, error: int, failing: range | None = None):
        self.sock, self.error, self.failing, self.sends = sock, error, failing, 0

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def fileno(self):
        return self.sock.fileno()

    def _fail(self, send, *args):
        self.sends += 1
        if self.failing is None or self.sends - 1 in self.failing:
            raise OSError(self.error, os.strerror(self.error))
        return send(*args)

    def sendto(self, *args):
        return self._fail(self.sock.sendto, *args)

    def sendmsg(self, *args):
        return self._fail(self.sock.sendmsg, *args)


def _fail_sends(w: Worker, error: int, failing: range | None = None) -> list[FailingSocket]:
    t = w.transport
    with w._engine_lock():
        t.socks = [FailingSocket(s, error, failing) for s in t.socks]
        t.sock = t.socks[0]
    return t.socks


def test_a_link_down_mid_run_is_named_at_once_and_its_rank_gone_by_the_others(monkeypatch):
    """2 workers over UDP, after an allreduce together; rank 1's link goes down (its sends
    fail with ENETUNREACH) before its next: that allreduce raises NetaggUnreachable at
    once, naming rank 1, the job, the switch and the reason (no OSError traceback); its
    heartbeat stops, so rank 0 names it gone within 2 s. (Python steps only: the compiled
    step sends from the socket's descriptor, past the failing socket.)"""
    monkeypatch.setenv("NETAGG_COMPILED", "0")
    with SimServer(GoldenSwitch()).start() as server:
        address = f"{server.bound_ip}:{server.address[1]}"
        session = uuid.uuid4().hex
        ws = [Worker(r, 2, server.url, session=session, timeout=30) for r in range(2)]
        try:
            in_threads(lambda r: ws[r].allreduce(np.ones(10, np.int32)), 2)     # joined
            handles = [ws[0].allreduce_async(np.full(3 * N.LANES, 1, np.int32))]
            _fail_sends(ws[1], errno.ENETUNREACH)
            t0 = time.monotonic()
            with pytest.raises(NetaggUnreachable) as e:
                ws[1].allreduce(np.full(3 * N.LANES, 2, np.int32))
            assert time.monotonic() - t0 < 1.0
            assert str(e.value) == (f"rank 1 of job 0 cannot reach the switch at {address}: "
                                    f"Network is unreachable (is this host's link down?)")
            with pytest.raises(NetaggRankGone, match=r"^rank 1 of job 0 is gone") as gone:
                handles[0].wait()
            assert gone.value.ranks == (1,)
            assert time.monotonic() - t0 < liveness.DEAD_AFTER + 2.5
        finally:
            for w in ws:
                w.close()


def test_a_full_send_buffer_only_loses_the_packet(monkeypatch):
    """Rank 1's sends fail with ENOBUFS for a while (the kernel's buffer full), its third
    to its fifth system call (a window's packets leave in one): those packets are lost and
    sent again; the sums are exact."""
    monkeypatch.setenv("NETAGG_COMPILED", "0")
    with SimServer(GoldenSwitch()).start() as server:
        session = uuid.uuid4().hex
        ws = [Worker(r, 2, server.url, session=session, timeout=30) for r in range(2)]
        try:
            socks = _fail_sends(ws[1], errno.ENOBUFS, failing=range(2, 5))
            results = in_threads(
                lambda r: ws[r].allreduce(np.full(40 * N.LANES, r + 1, np.int32)), 2)
        finally:
            for w in ws:
                w.close()
    assert all(np.array_equal(x, np.full(40 * N.LANES, 3)) for x in results)
    assert socks[0].sends > 5                   # and more were sent after them
    assert ws[1].counters()["retransmissions"] > 0


# --- a rank that never came ---------------------------------------------------------------------

def test_the_timeout_names_the_ranks_that_never_joined():
    """Ranks 1 and 3 of 4 never come (their processes died before they joined, say): the
    bounded wait of ranks 0 and 2 says the switch answers and names ranks 1 and 3, from
    their heartbeats, which carry no beat of this run."""
    switch, session = GoldenSwitch(), uuid.uuid4().hex
    ws = [Worker(r, 4, switch, session=session, timeout=2.0) for r in (0, 2)]
    try:
        handles = [w.allreduce_async(np.ones(10, np.int32)) for w in ws]
        for h, rank in zip(handles, (0, 2)):
            with pytest.raises(NetaggTimeout, match=rf"in job 0 \(rank {rank} of 4\): .*; the "
                                                    r"switch answers .*: a peer of this job "
                                                    r"stopped contributing: ranks 1, 3 have not "
                                                    r"joined this run") as e:
                h.wait()
            assert not isinstance(e.value, (NetaggSwitchGone, NetaggRankGone))
    finally:
        for w in ws:
            w.close()


@pytest.mark.parametrize("there", ["nothing", "a silent socket"])
def test_a_switch_that_never_answers_is_named_within_2_s_of_joining(there):
    """Nothing serves at the switch's address (a server that closed), or a process holds
    its port and never answers: a worker joining with the default 20 s timeout, and
    `SwitchControl`, fail with `NetaggSwitchGone` naming the address within 2 s of asking."""
    from netagg.host import SwitchControl
    with SimServer(GoldenSwitch()) as server:
        url, address = server.url, server.address
    silent = None
    if there == "a silent socket":
        silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        silent.bind(address)
    try:
        for join in (lambda: Worker(0, 2, url, session=uuid.uuid4().hex),
                     lambda: SwitchControl(url)):
            t0 = time.monotonic()
            with pytest.raises(NetaggSwitchGone, match=rf"no switch answers at "
                               rf"{re.escape(address[0])}:4791 .*none answered; nothing "
                               r"serves there, or the path to it is down") as e:
                join()
            took = time.monotonic() - t0
            assert 2.0 <= took < 3.0
            assert e.value.switch == f"{address[0]}:4791" and e.value.silent >= 2.0
    finally:
        if silent is not None:
            silent.close()


def test_errors_keep_their_fields_across_processes():
    """The new errors pickle with their fields (a hierarchical node's peers, torch's
    completer)."""
    import pickle

    gone = NetaggSwitchGone("the switch at 127.1.1.1:4791 is gone", "127.1.1.1:4791", 0, 2, 2.1)
    back = pickle.loads(pickle.dumps(gone))
    assert (type(back), str(back), back.switch, back.rank, back.silent) == \
        (NetaggSwitchGone, str(gone), "127.1.1.1:4791", 2, 2.1)
    assert isinstance(back, NetaggTimeout) and isinstance(back, NetaggError)
    far = NetaggUnreachable("127.1.1.1:4791", "Network is unreachable", errno.ENETUNREACH)
    named = pickle.loads(pickle.dumps(far.named("rank 1 of job 0")))
    assert str(named) == "rank 1 of job 0 cannot reach the switch at 127.1.1.1:4791: " \
        "Network is unreachable"
    assert named.named("rank 2 of job 0") is named


# --- a job taken over -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["golden", "rtl"])
def test_a_job_taken_over_by_another_run_is_named_within_2_s(backend):
    """Run A (2 workers over UDP) has joined job 0; its rank 1 stops (its process crashed,
    say) and run B, a fresh session, configures the same job at once and allreduces, exact.
    Rank 0 of A, which waits for rank 1, fails with NetaggJobTakenOver naming the job and
    the new owner's address, within 2 s of B's configuration (again if the machine stalled),
    long before its 30 s timeout."""
    in_time(lambda: _taken_over(backend), within=2.0)


def _taken_over(backend: str) -> tuple[list[float], float]:
    with SimServer(make_backend(backend)).start() as server:
        old = workers(2, server.url, timeout=30)
        new = []
        try:
            in_threads(lambda r: old[r].allreduce(np.ones(10, np.int32)), 2)    # A joined
            waiting = old[0].allreduce_async(np.ones(4 * N.LANES, np.int32))
            old[1].close()
            new = workers(2, server.url, timeout=30)
            sums = in_threads(lambda r: new[r].allreduce(np.full(10, 3, np.int32)), 2)
            assert [x.tolist() for x in sums] == [[6] * 10] * 2
            configured, owner = time.monotonic(), new[0].transport.local.ip
            with pytest.raises(NetaggJobTakenOver, match=(
                    rf"^job 0 was configured again by another run \(epoch 0x[0-9a-f]{{8}}, "
                    rf"enabled by {re.escape(owner)}\) while rank 0 of 2 of this run used "
                    r"it")) as e:
                waiting.wait()
            named = time.monotonic()
            assert e.value.job == 0 and e.value.owner == W.ip_to_int(owner)
            return [named], configured
        finally:
            for w in old + new:
                w.close()
