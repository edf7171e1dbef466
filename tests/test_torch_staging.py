"""The staging of accelerator tensors through pinned host memory (netagg/host/torch_staging.py), run
on CPU tensors through a stand-in device whose streams are threads (tests/staging_standin.py):
the chunk plan, sums bit for bit those of the host path (int32 exact against numpy) with the
producer's writes landing late on its stream, the order of copies, events and allreduces
(chunk k+1 on its way in before chunk k's sum is back, chunk k back after it, the future
last, no device-wide synchronisation), a failed chunk failing the future, and the backend
routing through the staging (the DDP hook too), refusing what neither it nor gloo takes,
and keeping every rank's allreduces in one order. `netagg gpu-check` refuses to run
without CUDA, saying so.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="pip install -e .[torch]")
import torch.distributed as dist  # noqa: E402

from netagg.host import numerics as N  # noqa: E402
from netagg.host.errors import NetaggError, NetaggTimeout  # noqa: E402
from netagg.host.torch_staging import Piece, Staging, plan  # noqa: E402
from netagg.host.torch_work import Completer, Done, Pending  # noqa: E402
from tests.host_workers import in_threads, workers  # noqa: E402
from tests.staging_standin import StandIn  # noqa: E402

BLOCK = N.LANES * N.DEFAULT_BLOCK           # values per exponent block: 4080
SIZES = [2 * BLOCK + 17, 5, 3 * BLOCK, 700]  # cut, packed, whole blocks, a tail
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
         "int32": torch.int32}


def inputs(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each rank's tensors, of `SIZES`, values over 6 decades (blocks of other exponents)."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for n in SIZES:
        if dtype == torch.int32:
            t = torch.randint(-(1 << 20), 1 << 20, (n,), generator=g, dtype=torch.int32)
        else:
            scale = torch.logspace(-3, 3, n, dtype=torch.float64)
            t = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
        out.append(t)
    return out


def test_plan_cuts_tensors_at_whole_blocks_and_packs_small_ones():
    block, chunk = 10, 30
    sizes = [25, 4, 3, 61, 0, 9]
    chunks = plan(sizes, chunk, block)
    covered = {i: [] for i in range(len(sizes))}
    for pieces in chunks:
        assert sum(p.size for p in pieces) <= chunk
        fill = 0
        for p in pieces:
            assert p.offset == fill and p.size > 0
            fill += p.size
            assert p.start % block == 0 and (p.stop % block == 0 or p.stop == sizes[p.tensor])
            covered[p.tensor].append((p.start, p.stop))
    for i, n in enumerate(sizes):         # every value once, in order
        assert [v for s, e in sorted(covered[i]) for v in range(s, e)] == list(range(n))
    # 25 | 5 of 61 ... small tensors share a chunk; a tensor's tail starts the next one
    assert chunks[0] == [Piece(0, 0, 25, 0), Piece(1, 0, 4, 25)]
    assert len(chunks) == 4
    with pytest.raises(ValueError, match="not a multiple of the block"):
        plan(sizes, 25, block)


class Recording:
    """A worker's chunk allreduce, recorded in the stand-in's log: started, and done."""

    def __init__(self, worker, device: StandIn, op: str, dtype: str):
        self.worker, self.device, self.op, self.dtype = worker, device, op, dtype
        self.chunks = 0

    def __call__(self, arrays, pieces):
        k = self.chunks
        self.chunks += 1
        self.device.note("allreduce", k)
        handle = self.worker.allreduce_async(arrays, self.op, self.dtype, out=arrays)
        outer = self

        class Handle:
            def wait(self, timeout=None):
                result = handle.wait(timeout)
                outer.device.note("allreduce done", k)
                return result
        return Handle()


def staged_and_host(dtype_name: str, op: str, chunk_bytes: int):
    """2 in-process workers (golden model) in threads: each rank's tensors through the
    staging (written late on the producer's stream) and through the host path. Per rank:
    (staged results, host results, its stand-in device)."""
    dtype = TORCH[dtype_name]
    ws = workers(2, timeout=30)
    devices = [StandIn() for _ in ws]

    def rank(r):
        w, d = ws[r], devices[r]
        staging = Staging(d, w.lanes * w.block, chunk_bytes)
        mine = inputs(r, dtype)
        tensors = [torch.zeros_like(t) for t in mine]
        tensors[1] = torch.zeros(10, dtype=dtype)[::2]          # non-contiguous

        def produce():              # the producer's kernels, late: the copies must wait
            time.sleep(0.05)
            for t, m in zip(tensors, mine):
                t.copy_(m.reshape(t.shape))
        d.producer.put(produce)
        staged = staging.prepare(tensors)
        done = staging.run(staged, Recording(w, d, op, dtype_name), 30)
        assert done is staged.tensors
        host = [np.ascontiguousarray(a) for a in
                w.allreduce([_array(m) for m in mine], op, dtype_name)]
        return [_array(t).copy() for t in tensors], host, staging

    try:
        return in_threads(rank, 2), devices
    finally:
        for w in ws:
            w.close()
        for d in devices:
            d.close()


def _array(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().reshape(-1)


@pytest.mark.parametrize("dtype_name,op", [("float32", "sum"), ("float16", "mean"),
                                           ("bfloat16", "sum"), ("int32", "sum")])
def test_staged_sums_are_the_host_paths_bit_for_bit(dtype_name, op):
    """Chunks of 2 blocks (cutting tensors, packing small ones): the sums are the host
    path's to the bit; int32's are numpy's."""
    per_rank, _ = staged_and_host(dtype_name, op, 2 * BLOCK * TORCH[dtype_name].itemsize)
    for staged, host, staging in per_rank:
        assert len(staged) == len(host) == len(SIZES)
        for s, h in zip(staged, host):
            assert s.dtype == h.dtype and np.array_equal(s, h)
        assert staging.stats.allreduces == 1
        assert staging.stats.chunks == len(plan(SIZES, 2 * BLOCK, BLOCK)) == 4
    if dtype_name == "int32":
        exact = [sum(_array(t).astype(np.int64) for t in ts)
                 for ts in zip(*(inputs(r, torch.int32) for r in range(2)))]
        for s, e in zip(per_rank[0][0], exact):
            assert np.array_equal(s, e)
    # the sums are not the inputs: the results came back through the buffers
    assert not np.array_equal(per_rank[0][0][0], _array(inputs(0, TORCH[dtype_name])[0]))


def test_the_pipeline_overlaps_its_copies_and_orders_them_by_events(monkeypatch):
    """Chunks of one block: the log of rank 0's device and allreduces. The side streams wait
    for the producer's event before any copy; chunk k+1's copy in is queued before chunk
    k's sum is back and chunk k's copy back after it, a buffer refilled only after its last
    copy back (a stream waits on that event, not the host); the host waits for events
    alone, the future's value is set last, on the copy-back stream."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("device-wide sync"))
    per_rank, devices = staged_and_host("float32", "sum", chunk_bytes=BLOCK * 4)
    staging, log = per_rank[0][2], devices[0].log
    n = staging.stats.chunks
    assert n == len(plan(SIZES, BLOCK, BLOCK)) >= 6
    to_host, to_device = staging.to_host.name, staging.to_device.name

    def at(*entry):
        return log.index(entry)

    ready = log[0]
    assert ready[:2] == ("record", 0) and ready[2] == "producer"
    first_copy = min(i for i, e in enumerate(log) if e[0] == "launch")
    assert at("wait", to_host, 0) < first_copy and at("wait", to_device, 0) < first_copy
    in_events = {}
    for k in range(n):
        launches = [i for i, e in enumerate(log) if e == ("launch", f"in {k}", to_host)]
        backs = [i for i, e in enumerate(log) if e == ("launch", f"back {k}", to_device)]
        assert launches and backs
        done = at("allreduce done", k)
        assert min(backs) > done                                  # back after its sum
        if k + 1 < n:                                             # k+1 in before k's sum
            assert min(i for i, e in enumerate(log) if e == ("launch", f"in {k + 1}",
                                                             to_host)) < done
        record = next(i for i in range(max(launches), len(log)) if log[i][0] == "record")
        in_events[k] = log[record][1]
        assert at("synchronize", in_events[k]) < at("allreduce", k)   # on the host first
        if k >= staging.depth:      # its buffer's previous chunk is back: a stream waits
            back_record = next(i for i in range(max(
                j for j, e in enumerate(log) if e == ("launch", f"back {k - staging.depth}",
                                                      to_device)), len(log))
                if log[i][0] == "record")
            assert ("wait", to_host, log[back_record][1]) in log[back_record:min(launches)]
    # the copies ran in the order they were queued on each stream
    ran = [e[1] for e in log if e[0] == "ran" and e[1].startswith("in ")]
    assert ran == sorted(ran, key=lambda w: int(w.split()[1]))
    # the end: the last copy back recorded, the host waits for it alone
    last = [e for e in log if e[0] != "ran"][-1]
    assert last[0] == "synchronize"
    assert ("record", last[1], to_device) in log
    assert all(e[0] != "synchronize" or isinstance(e[1], int) for e in log)
    # three pinned buffers, made once
    assert [e for e in log if e[0] == "host_buffer"] == [("host_buffer", BLOCK * 4)] * 3


def test_the_ring_is_reused_across_allreduces_and_dropped_after_a_failure():
    """A chunk allreduce whose handle fails (a gone switch, say) fails the run: no value,
    the ring dropped, the next run allocates a new one. Before that, two runs share one
    ring."""
    d = StandIn()
    staging = Staging(d, block=8, chunk_bytes=8 * 4)

    class Summed:                   # the allreduce of a world of one: the values themselves
        def __init__(self, fail_at=None):
            self.calls, self.fail_at = 0, fail_at

        def __call__(self, arrays, pieces):
            k, self.calls = self.calls, self.calls + 1
            fail = k == self.fail_at

            class Handle:
                def wait(self, timeout=None):
                    if fail:
                        raise NetaggTimeout("allreduce not finished after 1 s")
                    return arrays
            return Handle()

    try:
        x = torch.arange(40, dtype=torch.float32)
        staging.run(staging.prepare([x]), Summed(), 1)
        ring = list(staging._ring)
        staging.run(staging.prepare([x]), Summed(), 1)
        assert staging._ring == ring and torch.equal(x, torch.arange(40, dtype=torch.float32))
        y = torch.zeros(40)
        with pytest.raises(NetaggTimeout):
            staging.run(staging.prepare([y]), Summed(fail_at=2), 1)
        assert staging._ring == [] and staging.stats.allreduces == 2
        staging.run(staging.prepare([x]), Summed(), 1)
        assert len(staging._ring) == 3 and staging._ring[0] is not ring[0]
    finally:
        d.close()


def test_a_host_allreduce_behind_a_staged_one_starts_after_it():
    """Every rank must start its allreduces in one order: one the caller could start at once
    waits, while one submitted before it is still for the completer's thread to start."""
    completer = Completer("netagg rank 0 of 1, job 0", timeout=10)
    order, gate = [], threading.Event()

    def staged():
        gate.wait(10)
        order.append("staged")
        return Done("staged")

    def host():
        order.append("host")
        return Done("host")
    try:
        first = completer.submit(Pending(torch.futures.Future(), lambda v: v, start=staged))
        second = completer.submit(Pending(torch.futures.Future(), lambda v: v, start=host),
                                  now=True)
        time.sleep(0.1)
        assert order == []              # not started by the caller
        gate.set()
        assert (first.wait(), second.wait()) == ("staged", "host")
        assert order == ["staged", "host"]
        third = completer.submit(Pending(torch.futures.Future(), lambda v: v, start=host),
                                 now=True)
        assert order[-1] == "host" and third.wait() == "host"    # nothing ahead: at once
    finally:
        completer.close()


def test_the_backend_stages_device_tensors_and_refuses_what_nothing_takes(served_switch,
                                                                            monkeypatch):
    """A group of one whose staging device is the stand-in for CPU tensors (as CUDA's is
    for CUDA tensors): all_reduce of each dtype through the staging (sent to the switch,
    the sums the values, a non-contiguous tensor too, an async Work's future the tensor),
    the DDP hook's buckets through it, float64 still gloo's, AVG of int32 or float64 an
    error naming the dtype, the op and the device, nothing sent; send, recv and
    all_reduce_coalesced of a tensor off the CPU refused, naming its device."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from netagg.host.torch_backend import NetaggOptions
    from netagg.host.torch_hook import register
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("netagg", store=dist.HashStore(), rank=0, world_size=1,
                            pg_options=NetaggOptions(switch=served_switch, timeout=10.0,
                                                     staging_bytes=BLOCK * 4))
    device = StandIn()
    try:
        pg = dist.group.WORLD
        pg.staging_device = lambda d: device if d.type == "cpu" else None
        for name, t in TORCH.items():       # values a block's fixed point holds exactly
            x = (torch.arange(SIZES[0]) % 200 - 100).to(t)
            expected, before = x.clone(), pg.counters().get("packets_sent", 0)
            dist.all_reduce(x)
            assert torch.equal(x, expected), name       # a world of one: the values
            assert pg.counters()["packets_sent"] - before >= x.numel() // N.LANES, name
        staging = pg.staging["cpu"]
        assert staging.stats.allreduces == 4 and staging.stats.chunks == 3 + 2 + 2 + 3
        m = torch.arange(600, dtype=torch.float32).reshape(20, 30).t()
        work = dist.all_reduce(m, op=dist.ReduceOp.AVG, async_op=True)
        assert work.get_future().wait()[0] is m and work.is_completed()
        assert torch.equal(m, torch.arange(600, dtype=torch.float32).reshape(20, 30).t())
        # the hook: a bucket's gradients through the staging, as a CUDA bucket's would go
        def net():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.ReLU(),
                                       torch.nn.Linear(300, 10))
        model, alone = DDP(net()), net()
        register(model)
        chunks = staging.stats.chunks
        x, y = torch.randn(16, 40), torch.randint(0, 10, (16,))
        for m in (model, alone):
            torch.nn.functional.cross_entropy(m(x), y).backward()
        assert staging.stats.chunks > chunks
        assert max(float((p.grad - q.grad).abs().max()) for p, q in
                   zip(model.parameters(), alone.parameters())) < 1e-6
        before = pg.counters()["packets_sent"]
        z = torch.full((3,), 0.5, dtype=torch.float64)
        dist.all_reduce(z)
        assert torch.equal(z, torch.full((3,), 0.5, dtype=torch.float64))
        for dtype in (torch.int32, torch.float64):
            with pytest.raises(NetaggError, match=rf"netagg rank 0: all_reduce AVG of "
                                                  rf"{str(dtype)[6:]} tensors on cpu: .*"
                                                  rf"gloo, which takes the rest, has no AVG"):
                dist.all_reduce(torch.ones(3, dtype=dtype), op=dist.ReduceOp.AVG)
        assert pg.counters()["packets_sent"] == before
        # gloo would send a device tensor's addresses as host memory: refused, named
        elsewhere = torch.empty(4, device="meta")
        for name, call in (("send", lambda: pg.send([elsewhere], 0, 0)),
                           ("recv", lambda: pg.recv([elsewhere], 0, 0)),
                           ("allreduce_coalesced",
                            lambda: pg.allreduce_coalesced([elsewhere],
                                                           dist.AllreduceCoalescedOptions()))):
            with pytest.raises(NetaggError, match=rf"netagg rank 0: {name} of tensors on "
                                                  rf"meta: gloo's {name} reads and writes "
                                                  rf"host memory only"):
                call()
    finally:
        dist.destroy_process_group()
        device.close()


def test_gpu_check_refuses_without_cuda(capsys):
    """Without CUDA, `netagg gpu-check` starts nothing and says why, exit status 2."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run")
    from netagg.apps.cli import main
    assert main(["gpu-check", "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["command"] == "gpu-check" and not report["verified"]
    assert "no CUDA device" in report["error"]


def test_gpu_check_verdicts_fail_a_failed_or_disagreeing_rank():
    """The check's verdicts from its ranks' reports: a section that failed with an error (a
    dict of strings), a sum not bit for bit, or replicas whose weights differ fail it."""
    from netagg.apps.gpu_check import verdicts
    good = {"all_reduce": {"float32_SUM": {"bit_for_bit": True, "packets": 9}},
            "ordering": {"late_producer": True, "consumer_after_future": True,
                         "future_value_is_tensor": True},
            "fallbacks": {k: {"right": True, "packets": 0}
                          for k in ("float64_SUM", "int64_SUM", "float32_MAX")}
            | {"float64_AVG_refused": "netagg rank 0: all_reduce AVG of float64 tensors",
               "send_refused": "netagg rank 0: send of tensors on cuda:0: gloo's send..."},
            "ddp": {"plain_vs_gloo": 1e-7, "hook_vs_gloo": 2e-7, "loss_plain_vs_gloo": 0.0,
                    "loss_hook_vs_gloo": 1e-8, "digest_plain": "a", "digest_hook": "b"},
            "staging": {"cuda_allreduce_s": 0.5}, "shut_down": True}
    assert all(verdicts([good, good]).values())
    failed = good | {"ordering": {"error": "RuntimeError: x", "traceback": "..."}}
    assert verdicts([good, failed]) == {**verdicts([good, good]), "ordering": False}
    stale = good | {"all_reduce": {"float32_SUM": {"bit_for_bit": False, "packets": 9}}}
    assert not verdicts([stale, good])["all_reduce"]
    apart = good | {"ddp": good["ddp"] | {"digest_hook": "c"}}
    assert not verdicts([good, apart])["ddp"] and not verdicts([good, {}])["shut_down"]
