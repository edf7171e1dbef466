"""The compiled step (netagg.host.compiled, netagg/host/cpp/step.cpp): a worker over UDP runs
its plain window's steps in C++, and gets what the Python window gives, bit for bit, in every
format; what is not the plain case (a stray datagram, a peer late enough to need retransmission)
goes to the Python path and still ends exact; without a compiler, or with
NETAGG_COMPILED=0, the Python path alone runs and passes."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import numpy as np
import pytest

from netagg.contract import wire as W
from netagg.host import Worker, compiled_build, job_setup
from netagg.host import compiled as compiled_module
from netagg.host import numerics as N
from netagg.host.wire_arrays import write_imm_dtype
from netagg.sim.serve import SimServer, make_backend

pytestmark = pytest.mark.skipif(compiled_build.library() is None,
                                reason=f"{compiled_build.unavailable()}")


def _inputs(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    if dtype == "int32":
        return rng.integers(-2**20, 2**20, n, dtype=np.int32)
    # magnitudes over a wide range, so that blocks get different exponents, and blocks of
    # the largest and the smallest (their scale outside float32's normal range)
    x = rng.standard_normal(n) * np.exp2(rng.integers(-12, 12, n))
    per = N.LANES * N.DEFAULT_BLOCK
    if dtype == "float32" and n > 3 * per:
        x[:per] *= 2.0 ** 100
        x[per:2 * per] *= 2.0 ** -120
    if dtype == "bfloat16":
        return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(dtype)


def _allreduce(url: str, arrays: list, compiled: bool, monkeypatch, **kw) -> tuple:
    monkeypatch.setenv("NETAGG_COMPILED", "1" if compiled else "0")
    with Worker(0, 1, url, session=uuid.uuid4().hex, timeout=20) as w:
        before = w.counters()
        out = [w.allreduce(a, timeout=30, **kw) for a in arrays]
        after = w.counters()
    return out, {k: after.get(k, 0) - before.get(k, 0) for k in after}


@pytest.mark.parametrize("dtype,op", [("int32", "sum"), ("float32", "sum"),
                                      ("float32", "mean"), ("float16", "sum"),
                                      ("bfloat16", "mean")])
def test_the_compiled_step_gives_the_python_windows_bits(dtype, op, monkeypatch):
    rng = np.random.default_rng(7)
    arrays = [_inputs(rng, dtype, n) for n in (255 * 700 + 17, 255 * 64, 1000)]
    kw = {"op": op} | ({"dtype": "bfloat16"} if dtype == "bfloat16" else {})
    if dtype == "float16" and not compiled_build.library().step_float16():
        pytest.skip("the compiler has no _Float16")
    with SimServer(make_backend("echo")).start() as server:
        fast, c = _allreduce(server.url, arrays, True, monkeypatch, **kw)
        slow, p = _allreduce(server.url, arrays, False, monkeypatch, **kw)
    for a, b in zip(fast, slow):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if dtype == "int32":
        assert all(np.array_equal(a, x) for a, x in zip(fast, arrays))
    # the compiled step sent most packets; the Python window none
    assert c["compiled_packets"] > 0.8 * c["packets_sent"]
    assert p.get("compiled_packets", 0) == 0 and p["packets_sent"] == c["packets_sent"]
    assert c.get("retransmissions", 0) == 0 and c.get("window_fallbacks", 0) == 0


def _peers(url: str, arrays: list, delays: list[float], **kw) -> list:
    session = uuid.uuid4().hex
    out: list = [None] * len(arrays)

    def rank(r):
        with Worker(r, len(arrays), url, session=session, timeout=20) as w:
            time.sleep(delays[r])
            out[r] = (w.allreduce(arrays[r], timeout=30, **kw), w.counters(), w)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(arrays))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(o is not None for o in out)
    return out


def test_two_workers_through_the_golden_switch_one_late():
    """A peer 0.6 s late: the other's window times out and sends its packets again, each
    timeout twice the last, without leaving to the engine's message path; the late peer's
    compiled step carries its allreduce; int32 sums exact on both."""
    rng = np.random.default_rng(3)
    arrays = [rng.integers(-2**24, 2**24, 255 * 300 + 5, dtype=np.int32) for _ in range(2)]
    with SimServer(make_backend("golden")).start() as server:
        out = _peers(server.url, arrays, [0.0, 0.6])
    total = arrays[0] + arrays[1]
    for got, _, _ in out:
        assert np.array_equal(got, total)
    # a few retries each, with backoff, and the window kept
    assert 0 < out[0][1]["retransmissions"] <= 6 * 64
    assert out[0][1].get("window_fallbacks", 0) == 0
    assert out[1][1]["compiled_packets"] > 0.8 * out[1][1]["packets_sent"]


def test_two_workers_floats_equal_on_both_ranks():
    rng = np.random.default_rng(4)
    arrays = [_inputs(rng, "float32", 255 * 200 + 100) for _ in range(2)]
    with SimServer(make_backend("golden")).start() as server:
        out = _peers(server.url, arrays, [0.0, 0.0])
    assert out[0][0].tobytes() == out[1][0].tobytes()
    exact = arrays[0].astype(np.float64) + arrays[1]
    bound = N.error_bound(out[0][0], N.shared_exponents(arrays, N.FLOAT32), 2, N.FLOAT32)
    assert (np.abs(out[0][0] - exact) <= bound).all()
    assert out[0][1]["compiled_packets"] > 0


def test_stray_datagrams_during_a_run_are_counted_not_taken(monkeypatch):
    """Datagrams from another socket reach the worker while the C++ waits: it hands them to
    the transport, which counts them as stray; the sums stay exact."""
    monkeypatch.setenv("NETAGG_COMPILED", "1")
    rng = np.random.default_rng(5)
    x = rng.integers(-2**20, 2**20, 255 * 3000, dtype=np.int32)
    with SimServer(make_backend("echo")).start() as server:
        with Worker(0, 1, server.url, session=uuid.uuid4().hex, timeout=20) as w:
            local = w.transport.local
            stop = threading.Event()
            sent = []

            def stray():
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    while not stop.is_set():
                        s.sendto(b"\x00" * 64, (local.ip, local.port))
                        sent.append(1)
                        time.sleep(0.002)
            th = threading.Thread(target=stray)
            th.start()
            try:
                got = w.allreduce(x, timeout=30)
            finally:
                stop.set()
                th.join(5)
            counters = w.counters()
            strays = w.transport.stray
    assert np.array_equal(got, x)
    assert sent and strays > 0
    assert counters["compiled_packets"] > 0


def test_without_a_compiler_or_when_turned_off_the_python_window_runs(monkeypatch,
                                                                       tmp_path):
    rng = np.random.default_rng(6)
    x = _inputs(rng, "float32", 255 * 100)
    with SimServer(make_backend("echo")).start() as server:
        want, c = _allreduce(server.url, [x], True, monkeypatch)
        assert c["compiled_packets"] > 0
        got, p = _allreduce(server.url, [x], False, monkeypatch)
        assert compiled_build.library() is None
        assert compiled_build.unavailable() == "NETAGG_COMPILED=0"
        assert p.get("compiled_packets", 0) == 0 and got[0].tobytes() == want[0].tobytes()
        monkeypatch.setenv("NETAGG_COMPILED", "1")
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
        monkeypatch.setenv("NETAGG_CACHE", str(tmp_path))
        compiled_build.LIBRARY.forget()
        try:
            assert compiled_build.library() is None
            assert compiled_build.unavailable() == "no C++ compiler"
            with Worker(0, 1, server.url, session=uuid.uuid4().hex, timeout=20) as w:
                got = w.allreduce(x, timeout=30)
                assert w.counters().get("compiled_packets", 0) == 0
            assert got.tobytes() == want[0].tobytes()
        finally:
            monkeypatch.undo()
            compiled_build.LIBRARY.forget()
    assert compiled_build.library() is not None


def test_the_interface_is_generated_from_its_declaration():
    header = compiled_build.abi_header()
    for name, _ in compiled_build.RUN_FIELDS:
        assert f" {name};" in header
    for status in compiled_build.Status:
        assert f"ST_{status.name} = {status.value}" in header


def _contributions(pcap, size: int) -> list[bytes]:
    """Every contribution in a pcap of `SimServer`, less its PSN and ICRC, in order."""
    from scapy.utils import rdpcap

    udp = W.ETH_LEN + W.IP_LEN
    rows = []
    for frame in rdpcap(str(pcap)):
        raw = bytes(frame)
        body = raw[udp + W.UDP_LEN:]
        if int.from_bytes(raw[udp + 2:udp + 4], "big") == W.ROCEV2_PORT \
                and len(body) == size and body[0] != W.OP_CONTROL:
            rows.append(body[:8] + body[12:-W.ICRC_LEN])
    return sorted(rows)


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_the_compiled_step_sends_the_python_windows_packets(dtype, monkeypatch, tmp_path):
    """With the same session and epoch, the contributions of the compiled step and of the
    Python window are the same, field for field and lane for lane (the PSN and the ICRC,
    which covers it, aside: control requests take PSNs too, as timing has it)."""
    monkeypatch.setattr(job_setup, "fresh_epoch", lambda: 0x5EED)   # rank 0 draws it there
    rng = np.random.default_rng(8)
    x = _inputs(rng, dtype, 255 * 150 + 9)
    sent = {}
    for compiled in (True, False):
        monkeypatch.setenv("NETAGG_COMPILED", "1" if compiled else "0")
        pcap = tmp_path / f"{compiled}.pcap"
        with SimServer(make_backend("echo"), pcap=str(pcap)).start() as server:
            with Worker(0, 1, server.url, session="same", timeout=20) as w:
                w.allreduce(x, timeout=30)
                counters = w.counters()
        assert (counters.get("compiled_packets", 0) > 0) == compiled
        sent[compiled] = _contributions(pcap, write_imm_dtype(N.LANES).itemsize)
    assert len(sent[True]) == len(sent[False]) > 150
    assert sent[True] == sent[False]


def test_a_caller_that_wants_the_engine_has_the_compiled_run_return():
    """`ProgressLock`: while a thread waits for the lock another holds, the engine's
    `wanted` count (which a compiled run reads between its steps) is not 0; a thread that
    gets the lock at once does not count."""
    from netagg.host.progress import ProgressLock, wanted

    class Engine:
        pass
    engine = Engine()
    lock = ProgressLock(engine)
    cell = wanted(engine)
    with lock:
        assert cell[0] == 0
    seen = []
    held = threading.Event()

    def hold():
        with lock:
            held.set()
            time.sleep(0.2)
            seen.append(int(cell[0]))
    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    assert not lock.acquire(False) and cell[0] == 0
    with lock:
        pass
    t.join(5)
    assert seen == [1] and cell[0] == 0


def test_a_waiting_caller_leaves_the_engine_to_the_compiled_run():
    """`wait` sleeps on the progress thread's `finished` condition and never takes the
    engine's lock (which would cut the compiled run short); the result is there when it
    returns."""
    rng = np.random.default_rng(11)
    x = _inputs(rng, "int32", 255 * 2000)
    with SimServer(make_backend("echo")).start() as server, \
            Worker(0, 1, server.url, session=uuid.uuid4().hex, timeout=20) as w:
        lock, takers = w.progress.lock, []
        acquire = lock.acquire

        def counted(*args, **kw):
            takers.append(threading.current_thread() is threading.main_thread())
            return acquire(*args, **kw)
        handle = w.allreduce_async(x)
        lock.acquire = counted
        got = handle.wait(30)
        lock.acquire = acquire
    assert np.array_equal(got, x)
    assert takers and not any(takers)       # the progress thread's steps only


def test_the_caller_sends_a_fresh_tensors_exponent_messages(monkeypatch):
    """At submission to an idle window, the caller's thread sends the tensor's exponent
    messages (`PlainWindow.lead`), before the progress thread steps: with the thread not
    woken, they are out (and nothing else: the data waits for their results); woken, the
    allreduce completes."""
    x = _inputs(np.random.default_rng(12), "float32", 255 * 600)
    with SimServer(make_backend("echo")).start() as server, \
            Worker(0, 1, server.url, session=uuid.uuid4().hex, timeout=20) as w:
        want = w.allreduce(x, timeout=30)
        e = w.engine
        # the thread sees nothing to do: it idles, and does not step
        monkeypatch.setattr(e, "busy", lambda: False)
        monkeypatch.setattr(e.liveness, "beat_due", lambda now: False)
        time.sleep(0.1)
        before = w.counters()["packets_sent"]
        handle = w.allreduce_async(x)
        time.sleep(0.1)
        sent = w.counters()["packets_sent"] - before
        monkeypatch.undo()
        w.progress.kick()
        got = handle.wait(30)
    assert sent == 1                # one exponent message: 64 slots, blocks of 256 chunks
    assert got.tobytes() == want.tobytes()


def test_the_compiled_steps_own_crc_is_zlibs(monkeypatch):
    """Without zlib-ng's CRC-32 to call, the C++ computes the ICRCs itself: the switch takes
    every contribution (a bad ICRC is dropped, and would time out), the results are
    checked and taken by the C++."""
    monkeypatch.setattr(compiled_module, "crc32_address", lambda: 0)
    rng = np.random.default_rng(9)
    x = _inputs(rng, "int32", 255 * 500 + 3)
    with SimServer(make_backend("echo")).start() as server:
        got, c = _allreduce(server.url, [x], True, monkeypatch)
    assert np.array_equal(got[0], x)
    assert c["compiled_packets"] > 0.8 * c["packets_sent"]
    assert c.get("retransmissions", 0) == 0 and c.get("window_fallbacks", 0) == 0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_compiled_block_proposals_are_numerics(dtype):
    """One pass over the bits gives `numerics.block_proposals`, block for block: zeros,
    subnormals, the largest magnitudes, NaN and infinities of either sign, a short tail."""
    rng = np.random.default_rng(9)
    per = N.LANES * N.DEFAULT_BLOCK
    x = _inputs(rng, "float32", 6 * per + 77).astype(np.float64)
    x[per:2 * per] = 0.0
    x[2 * per:3 * per] *= 2.0 ** -140           # subnormal in float32, 0 in the others
    x[3 * per + 5], x[4 * per + 9], x[5 * per] = np.nan, -np.inf, np.inf
    x[-1] = -3e38
    with np.errstate(over="ignore"):            # (float16: the largest become infinities)
        values = x.astype(np.float32).astype(dtype) if dtype != "bfloat16" else \
            (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    fmt = {"float32": N.FLOAT32, "float16": N.FLOAT16, "bfloat16": N.BFLOAT16}[dtype]
    for n in (len(values), per, 1):
        want = N.block_proposals(values[:n], fmt, per)
        got = compiled_module.block_proposals(values[:n], fmt, per)
        assert got.tolist() == want.tolist()
    assert (want := N.block_proposals(values, fmt, per))[3] == N.EXP_NONFINITE \
        and want[1] == N.EXP_MIN
