"""The job's key (RETH.rkey) and epoch: on the golden model and the RTL, a contribution with
another key than its job's is dropped and counted (`drop_bad_key`) before its slot and its
credit are looked at, frame for frame alike on both; the host's workers configure a fresh
epoch and key for every run, so a new run completes exactly while a crashed run's workers
still retransmit, and a flood of contributions from another port of a worker's host, as a
rank of the job and just ahead of its completed uses, stops nothing."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import SwitchControl, Worker
from netagg.host.session import JobKeys, fresh_epoch, keyed_hash
from netagg.host.transport import InProcessTransport
from netagg.sim.fuzz import Comparer
from netagg.sim.fuzz_traffic import Frame, Kind
from netagg.sim.golden import GoldenSwitch
from tests.host_workers import allreduce_all
from tests.switch_traffic import (
    control_frame,
    job_key,
    scenario,
)
from tests.test_fuzz import configure, exchange, job_counters, lanes_of


def read(switch, *addresses) -> list[int]:
    [(_, reply)] = exchange(switch, [(0, control_frame([(a, 0) for a in addresses]))])
    return [v for _, v in W.unpack_records(W.parse_frame(reply).payload)]


# --- the switch: golden model and RTL ------------------------------------------------------

def test_the_key_is_written_and_never_read(switch):
    """KEY reads 0 whatever was written (the answer to the write too); EPOCH reads back; a
    CONFIG write clears neither."""
    configure(switch, [(0, 1, 0, 1, 0)])
    [(_, reply)] = exchange(switch, [(0, control_frame([
        (R.WRITE | R.job_reg(0, R.JOB_EPOCH), 0x1234ABCD),
        (R.WRITE | R.job_reg(0, R.JOB_KEY), 0xDEADBEEF),
        (R.WRITE | R.job_reg(0, R.JOB_CONFIG), R.CONFIG.pack(enable=1, workers=1))]))])
    assert [v for _, v in W.unpack_records(W.parse_frame(reply).payload)] == \
        [0x1234ABCD, 0, R.CONFIG.pack(enable=1, workers=1)]
    assert read(switch, R.job_reg(0, R.JOB_EPOCH), R.job_reg(0, R.JOB_KEY)) == [0x1234ABCD, 0]


def test_another_key_is_dropped_before_the_slot_and_the_credit(switch):
    """Contributions of a configured rank from its own address, with the results' R_Key,
    another job's key, 0 or one bit off the key, are dropped as `drop_bad_key`, also those a
    slot out of range or a message far beyond the credit would have dropped otherwise; none
    touches a slot: the use then completes with the sums of the good ones alone."""
    a, b = configure(switch, [(0, 2, 0, 2, 1), (1, 1, 2, 1, 0)])[0]
    bad_keys = (a.rkey, job_key(1), 0, a.key ^ 1, a.key ^ 1 << 31)
    x, y = np.arange(16, dtype=np.int32), np.full(16, 7, np.int32)
    bad = [a.contribution(0, 0, 0, x + 1, 1, msn=0, key=k) for k in bad_keys]
    bad += [a.contribution(5, 0, 0, x, 2, msn=0, key=0),         # slot out of range
            b.contribution(0, 0, 0, y, 3, msn=1000, key=0)]      # far beyond the credit
    for frame in bad:
        assert exchange(switch, [(a.port, frame)]) == []
    assert exchange(switch, [(0, a.contribution(0, 0, 0, x, 4, msn=0))]) == []
    out = exchange(switch, [(1, b.contribution(0, 0, 0, y, 4, msn=0))])
    assert [lanes_of(f).tolist() for _, f in out] == [(x + y).tolist()] * 2
    c = job_counters(switch, 0)
    assert (c["drop_bad_key"], c["drop_bad_slot"], c["drop_credit"], c["contributions"],
            c["completed"]) == (len(bad), 0, 0, 2, 1)
    assert job_counters(switch, 1)["drop_bad_key"] == 0


def test_a_flood_ahead_of_completed_with_a_wrong_key_takes_nothing(switch):
    """A rank's address from another UDP port, its contributions just ahead of COMPLETED
    (within the credit) with a wrong key or the results' R_Key, before and between the
    job's own: every one is `drop_bad_key`, every use completes with the job's sums."""
    ws = configure(switch, [(0, 2, 0, 4, 4)])[0]
    rng = random.Random(1)
    flood = 0
    for use in range(3):
        for slot in range(4):
            msn = use * 4 + slot
            rogue = [(w.port, w.contribution(
                (msn + k) % 4, (msn + k) // 4 % 2, 0, np.full(8, 99, np.int32), 9, msn=msn + k,
                key=rng.choice((w.rkey, 0, w.key + 1)), ingress_sport=40000 + k))
                for w in ws for k in range(4)]
            flood += len(rogue)
            assert exchange(switch, rogue) == []
            lanes = [np.full(8, 10 * use + slot + r, np.int32) for r in range(2)]
            exchange(switch, [(0, ws[0].contribution(slot, use % 2, 0, lanes[0], 1))])
            out = exchange(switch, [(1, ws[1].contribution(slot, use % 2, 0, lanes[1], 1))])
            assert [lanes_of(f).tolist() for _, f in out] == [(lanes[0] + lanes[1]).tolist()] * 2
    c = job_counters(switch, 0)
    assert (c["drop_bad_key"], c["completed"], c["contributions"]) == (flood, 12, 24)


def _stream_with_bad_keys(seed: int) -> list[Frame]:
    """Two jobs configured as the tests do, three rounds of their uses, each round's frames
    shuffled with copies of them that carry another key (the results' R_Key, another job's,
    or 0); the comparer reads every register and counter at the end."""
    sc = scenario(random.Random(seed), ports=4, jobs=2, workers=3, slots=4, rounds=3,
                  max_lanes=64, duplicates=0.1, malformed=0.0, bad_keys=0.5)
    frames = [Frame(0, f, Kind.CONTROL) for f in sc.config]
    for batch in sc.rounds:
        for port, f in batch:
            pkt = W.parse_frame(f)
            good = pkt.rkey == job_key(W.unpack_imm(W.REQUEST_IMM, pkt.imm)["job"])
            frames.append(Frame(port, f, Kind.CONTRIBUTION if good else Kind.FIELD))
    return frames


def test_golden_and_rtl_agree_frame_for_frame_on_good_and_bad_keys(rtl_model):
    """The differential comparer on a stream of good contributions and copies with bad
    keys: every frame out, register and counter alike, the sums right."""
    rtl_model.reset()
    golden = GoldenSwitch()
    frames = _stream_with_bad_keys(3)
    s = Comparer(rtl_model, golden).run(frames)
    assert s.differences == 0 and s.wrong_sums == 0, s.text()
    bad = sum(f.kind is Kind.FIELD for f in frames)
    assert bad > 20 and sum(c["drop_bad_key"] for c in golden.job_counters) == bad
    assert sum(c["completed"] for c in golden.job_counters) == 2 * 4 * 3


# --- the host: epochs and keys -------------------------------------------------------------

def test_keys_are_keyed_hashes_of_the_session_job_and_epoch():
    keys = JobKeys.derive("s", 0, 7)
    assert keys == JobKeys.derive("s", 0, 7) and keys.key != keys.tag
    others = [JobKeys.derive(s, j, e) for s, j, e in (("t", 0, 7), ("s", 1, 7), ("s", 0, 8))]
    assert all(o.key != keys.key and o.tag != keys.tag for o in others)
    assert keyed_hash("x" * 200, 0, 1, "key") != keyed_hash("x" * 199, 0, 1, "key")
    assert len({fresh_epoch() for _ in range(100)}) == 100


def test_every_configuration_has_a_fresh_epoch_and_the_key_cannot_be_read():
    switch = GoldenSwitch()
    ctl = SwitchControl(switch)
    seen = set()
    for _ in range(3):
        ws = [Worker(r, 2, switch, session="same", timeout=5) for r in range(2)]
        allreduce_all(ws, [np.ones(10, np.int32)] * 2)
        epoch, key, tag0, tag1 = ctl.read(R.job_reg(0, R.JOB_EPOCH), R.job_reg(0, R.JOB_KEY),
                                          R.worker_reg(0, 0, R.WORKER_RKEY),
                                          R.worker_reg(0, 1, R.WORKER_RKEY))
        keys = JobKeys.derive("same", 0, epoch)
        assert key == 0 and tag0 == tag1 == keys.tag == ws[1].engine.session_tag
        assert ws[0].engine.key == ws[1].engine.key == keys.key
        seen.add(epoch)
        for w in ws:
            w.close()
    assert len(seen) == 3 and 0 not in seen


def abandon(worker: Worker, rto: float):
    """The worker's process is gone from its address (its results go to whoever binds it
    next), and its engine goes on retransmitting every `rto` seconds."""
    t = worker.transport
    t.hub.endpoints.pop((t.local.ip, t.local.port))
    e = worker.engine
    e.rto_min = e.rto_max = e.rto = rto
    e.timeout = 600


def new_run_while_a_crashed_run_retransmits(switch, seed: int, rto: float = 0.005):
    """Three workers of session "s" get ahead (24 messages over 8 slots), rank 0 dies
    mid-allreduce and the others go on retransmitting messages 24..31; then a new run of
    session "s", the same job and ranks, allreduces 48 messages, past the old ones: each
    sum exact, the old retransmissions dropped as `drop_bad_key`."""
    n = 8 * 255
    old = [Worker(r, 3, switch, session="s", timeout=30, slots=8) for r in range(3)]
    for k in range(3):
        allreduce_all(old, [np.full(n, k, np.int32)] * 3)
    for w in old[1:]:
        w.allreduce_async(np.full(n, 1000, np.int32))
    old[0].close()
    for w in old[1:]:
        abandon(w, rto)
    ctl = SwitchControl(switch)
    before = ctl.counters(jobs=[0])["jobs"][0]["drop_bad_key"]
    new = [Worker(r, 3, switch, session="s", timeout=10, slots=8) for r in range(3)]
    rng = np.random.default_rng(seed)
    try:
        for _ in range(6):
            inputs = [rng.integers(-2**20, 2**20, n, dtype=np.int32) for _ in range(3)]
            for r in allreduce_all(new, inputs):
                assert np.array_equal(r, np.sum(inputs, axis=0))
        assert ctl.counters(jobs=[0])["jobs"][0]["drop_bad_key"] > before
    finally:
        for w in new + old[1:]:
            w.close()
        ctl.close()


@pytest.mark.parametrize("seed", [*range(3), *(pytest.param(s, marks=pytest.mark.slow)
                                             for s in range(3, 100))])
def test_a_new_run_completes_while_a_crashed_run_retransmits(seed):
    new_run_while_a_crashed_run_retransmits(GoldenSwitch(), seed)


@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow)
                                      for s in range(1, 10))])
def test_a_new_run_completes_while_a_crashed_run_retransmits_on_the_rtl(rtl_model, seed):
    rtl_model.reset()
    new_run_while_a_crashed_run_retransmits(rtl_model, seed, rto=0.05)


@pytest.mark.parametrize("backend", ["golden", "rtl"])
def test_a_flood_from_another_port_of_a_workers_host_stops_nothing(request, backend):
    """While two workers allreduce, a process on rank 1's host (its IPv4 address, another
    UDP port) sends contributions as rank 1 of the job, as fast as it can, each just ahead
    of the job's COMPLETED (within the credit) with a wrong key or the results' R_Key: the
    sums are exact, and every one of its contributions is counted as `drop_bad_key`."""
    if backend == "rtl":
        switch = request.getfixturevalue("rtl_model")
        switch.reset()
    else:
        switch = GoldenSwitch()
    ws = [Worker(r, 2, switch, session="t", timeout=10, slots=8) for r in range(2)]
    rogue = InProcessTransport(switch, ws[1].transport.local.ip, 9999)
    ctl = SwitchControl(switch)
    sent, stop = [0], threading.Event()
    [tag] = ctl.read(R.worker_reg(0, 1, R.WORKER_RKEY))       # as any process may read it
    rng = random.Random(2)

    def flood():
        while not stop.is_set():
            [completed] = ctl.read(R.job_reg(0, R.JOB_COMPLETED))
            for k in range(8):
                msn = completed + k
                rogue.send(W.contribution(
                    job=0, rank=1, slot=msn % 8, version=msn // 8 % 2, offset=0,
                    lanes=bytes(4), psn=msn, src=rogue.local, dst=rogue.switch, msn=msn,
                    key=rng.choice((tag, 0, rng.getrandbits(32)))).datagram())
                sent[0] += 1
    x = [np.arange(40 * 255, dtype=np.int32) * (r + 1) for r in range(2)]
    # Rank 1 writes its entry when it joins (`host.job_setup`): a contribution as rank 1
    # before then is a bad worker's, not a bad key's. The flood starts after both joined.
    for r in allreduce_all(ws, x):
        assert np.array_equal(r, x[0] * 3)
    thread = threading.Thread(target=flood)
    thread.start()
    try:
        for _ in range(3):
            for r in allreduce_all(ws, x):
                assert np.array_equal(r, x[0] * 3)
    finally:
        stop.set()
        thread.join()
    rogue.close()
    assert sent[0] > 0
    assert ctl.counters(jobs=[0])["jobs"][0]["drop_bad_key"] == sent[0]
    for w in ws:
        w.close()
    ctl.close()
