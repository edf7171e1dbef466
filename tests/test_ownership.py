"""Who may write the switch's registers (netagg/contract/regmap.py's rules), on the golden model
and the RTL alike: writes to an enabled job from neither its owner nor the manager are refused and
counted while the job aggregates, exactly; the owner and the manager may write; the manager
is set by its first write; overlapping and too long slot ranges are refused and counted, an
enabled job's range is fixed, and a disabled job's CONFIG clears no one's slots. Then the
host: a worker of a job another address owns, or of an overlapping slot range, gets a clear
error at once; foreign writes during an allreduce leave it exact; `SwitchControl` and
`netagg probe` show the manager and the owners."""

import random
import time
import uuid

import numpy as np
import pytest
from scapy.contrib.roce import BTH

from netagg.apps.probe import probe
from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import transport as T
from netagg.host.control import SwitchControl
from netagg.host.errors import NetaggError
from netagg.host.worker import Worker
from netagg.sim.golden import GoldenSwitch
from netagg.sim.serve import SimServer
from tests.host_workers import allreduce_all, workers
from tests.switch_traffic import (
    HOST_IP,
    control_frame,
    dissect,
    job_config_records,
    make_workers,
    switch_records,
)
from tests.test_fuzz import exchange

FOREIGN = "10.66.0.9"
MANAGER = "10.0.250.1"


def request(switch, records, src_ip=HOST_IP, port=0) -> list[int]:
    """A control request from `src_ip`: the values its answer carries."""
    [(_, reply)] = exchange(switch, [(port, control_frame(records, src_ip=src_ip))])
    return [v for _, v in W.unpack_records(bytes(dissect(reply)[BTH].payload))]


def counter(switch, name, index=0) -> int:
    address = R.port_counter(index, name) if name in R.PORT_COUNTERS else \
        R.job_counter(index, name)
    return request(switch, [(address, 0)])[0]


def set_up(switch, job, ws, base, count, credits=0):
    """Job `job` set up by its rank 0's address, as the host does (disabled first)."""
    records = job_config_records(job, ws, base, count, credits)
    assert request(switch, records, ws[0].ip)[-1] >> 31 == 1


def job_registers(job) -> list[tuple[int, int]]:
    return [(R.job_reg(job, f), 0) for f in (R.JOB_CONFIG, R.JOB_SLOT_BASE, R.JOB_SLOT_COUNT,
                                              R.JOB_CREDITS, R.JOB_QUORUM, R.JOB_OWNER)] + \
        [(R.worker_reg(job, r, f), 0) for r in range(3) for f in range(R.WORKER_STRIDE)]


def test_foreign_writes_are_refused_while_the_job_aggregates(switch):
    """Between the contributions of every use, requests from another host and from a worker
    of the job that is not its owner rewrite CONFIG, the slot range, credits, quorum and
    other workers' entries: every record is refused (its answer the register's value) and counted on
    the port it came in by, and every result is the exact sum."""
    request(switch, switch_records())
    ws = make_workers(0, 3, 4, random.Random(1), slot_count=4)
    set_up(switch, 0, ws, 0, 4, credits=4)
    before = request(switch, job_registers(0))
    assert before[5] == W.ip_to_int(ws[0].ip)                 # the owner: rank 0's address
    attack = [(R.job_reg(0, R.JOB_CONFIG), 0),
              (R.job_reg(0, R.JOB_CONFIG), R.CONFIG.pack(enable=1, workers=1)),
              (R.job_reg(0, R.JOB_SLOT_BASE), 8), (R.job_reg(0, R.JOB_SLOT_COUNT), 1),
              (R.job_reg(0, R.JOB_CREDITS), 1), (R.job_reg(0, R.JOB_QUORUM), 1),
              (R.worker_reg(0, 2, R.WORKER_IP), W.ip_to_int(FOREIGN)),
              (R.worker_reg(0, 2, R.WORKER_PORT), 0), (R.worker_reg(0, 0, R.WORKER_RKEY), 7)]
    rng = np.random.default_rng(2)
    denied = 0
    for use in range(2):
        for slot in range(4):
            lanes = [rng.integers(-1000, 1000, 16, dtype=np.int32) for _ in ws]
            for w, x in zip(ws[:2], lanes):
                assert exchange(switch, [(w.port, w.contribution(slot, use % 2, 0, x, 1))]) == []
            port = (use + slot) % 4
            for source in (FOREIGN, ws[1].ip):
                answer = request(switch, [(a | R.WRITE, v) for a, v in attack], source, port)
                assert answer == [before[0], before[0], before[1], before[2], before[3],
                                  before[4], before[6 + 2 * 8 + R.WORKER_IP],
                                  before[6 + 2 * 8 + R.WORKER_PORT],
                                  before[6 + R.WORKER_RKEY]]
                denied += len(attack)
            w = ws[2]
            out = exchange(switch, [(w.port, w.contribution(slot, use % 2, 0, lanes[2], 1))])
            assert sorted(dissect(f)[BTH].dqpn for _, f in out) == sorted(x.qpn for x in ws)
            total = np.sum(lanes, axis=0, dtype=np.int32).tolist()
            assert all(np.frombuffer(bytes(dissect(f)[BTH].payload)[20:], "<i4").tolist()
                       == total for _, f in out)
    assert request(switch, job_registers(0))[:5] == before[:5]
    assert request(switch, job_registers(0))[5:] == before[5:]
    assert sum(counter(switch, "control_denied", p) for p in range(4)) == denied
    assert counter(switch, "completed") == 8 and counter(switch, "config_refused") == 0


def test_the_owner_and_the_manager_may_write(switch):
    """The first write of REG_MANAGER sets it, and then only the manager writes it and the
    switch's own registers; the owner writes its job, the manager any job (re-enabling it
    keeps the owner), a worker entry the address it holds (or anyone, while it holds none);
    a job disabled by its owner or the manager is anyone's to enable."""
    ws = make_workers(0, 1, 4, random.Random(3))
    set_up(switch, 0, ws, 0, 2)
    owner = W.ip_to_int(ws[0].ip)
    assert request(switch, [(R.REG_MANAGER, 0)]) == [0]
    assert request(switch, [(R.WRITE | R.REG_MANAGER, W.ip_to_int(MANAGER))], MANAGER) == \
        [W.ip_to_int(MANAGER)]
    assert request(switch, [(R.WRITE | R.REG_MANAGER, W.ip_to_int(FOREIGN)),
                            (R.WRITE | R.REG_IP, 0x0A000002)], FOREIGN) == \
        [W.ip_to_int(MANAGER), 0]
    assert request(switch, [(R.WRITE | R.REG_IP, 0x0A000002)], MANAGER) == [0x0A000002]
    assert counter(switch, "control_denied") == 2
    assert request(switch, [(R.WRITE | R.job_reg(0, R.JOB_CREDITS), 5)], ws[0].ip) == [5]
    assert request(switch, [(R.WRITE | R.job_reg(0, R.JOB_QUORUM), 1),
                            (R.WRITE | R.worker_reg(0, 0, R.WORKER_QPN), 99)], MANAGER) == [1, 99]
    assert request(switch, [(R.WRITE | R.job_reg(0, R.JOB_CREDITS), 6)], FOREIGN) == [5]
    # a worker's entry: the address it holds writes it, anyone while it holds none
    assert request(switch, [(R.WRITE | R.worker_reg(0, 0, R.WORKER_QPN), 7)], ws[0].ip) == [7]
    assert request(switch, [(R.WRITE | R.worker_reg(0, 1, R.WORKER_QPN), 8),
                            (R.WRITE | R.worker_reg(0, 1, R.WORKER_IP), W.ip_to_int(FOREIGN)),
                            (R.WRITE | R.worker_reg(0, 1, R.WORKER_QPN), 9),
                            (R.WRITE | R.worker_reg(0, 0, R.WORKER_QPN), 10)], FOREIGN) == \
        [8, W.ip_to_int(FOREIGN), 9, 7]
    enable = R.CONFIG.pack(enable=1, workers=1)
    assert request(switch, [(R.WRITE | R.job_reg(0, R.JOB_CONFIG), enable),
                            (R.job_reg(0, R.JOB_OWNER), 0)], MANAGER) == [enable, owner]
    assert request(switch, [(R.WRITE | R.job_reg(0, R.JOB_CONFIG), 0),
                            (R.job_reg(0, R.JOB_OWNER), 0)], MANAGER) == [0, 0]
    assert request(switch, [(R.WRITE | R.job_reg(0, R.JOB_SLOT_BASE), 4),
                            (R.WRITE | R.job_reg(0, R.JOB_CONFIG), enable),
                            (R.job_reg(0, R.JOB_OWNER), 0)], FOREIGN) == \
        [4, enable, W.ip_to_int(FOREIGN)]
    assert counter(switch, "control_denied") == 4 and counter(switch, "config_refused") == 0


def test_overlapping_slot_ranges_are_refused(switch):
    """A CONFIG write that enables a range overlapping an enabled job's or running past the
    switch's slots is refused (the job stays disabled, no owner) and counted; a free range
    is taken; an enabled job's range is fixed, even for its owner. A disabled job's CONFIG
    written over an enabled job's range clears none of its slots."""
    ws = make_workers(0, 2, 4, random.Random(4), slot_count=8)
    set_up(switch, 0, ws, 0, 8)
    [other] = make_workers(1, 1, 4, random.Random(5))
    enable = R.CONFIG.pack(enable=1, workers=1)
    for base, count in ((4, 8), (60, 8), (0, 1)):
        assert request(switch, [(R.WRITE | R.job_reg(1, R.JOB_CONFIG), 0),
                                (R.WRITE | R.job_reg(1, R.JOB_SLOT_BASE), base),
                                (R.WRITE | R.job_reg(1, R.JOB_SLOT_COUNT), count),
                                (R.WRITE | R.job_reg(1, R.JOB_CONFIG), enable),
                                (R.job_reg(1, R.JOB_OWNER), 0)], other.ip) == [0, base, count, 0, 0]
    assert counter(switch, "config_refused", 1) == 3
    set_up(switch, 1, [other], 8, 8)
    assert request(switch, [(R.WRITE | R.job_reg(1, R.JOB_SLOT_BASE), 16),
                            (R.WRITE | R.job_reg(1, R.JOB_SLOT_COUNT), 1)], other.ip) == [8, 8]
    assert counter(switch, "config_refused", 1) == 5
    # job 0 has begun a use of slot 3; job 2, disabled, is written over slots 0..7
    x = np.arange(8, dtype=np.int32)
    assert exchange(switch, [(ws[0].port, ws[0].contribution(3, 0, 0, x, 1))]) == []
    assert request(switch, [(R.WRITE | R.job_reg(2, R.JOB_SLOT_BASE), 0),
                            (R.WRITE | R.job_reg(2, R.JOB_SLOT_COUNT), 8),
                            (R.WRITE | R.job_reg(2, R.JOB_CONFIG), 0)], FOREIGN) == [0, 8, 0]
    out = exchange(switch, [(ws[1].port, ws[1].contribution(3, 0, 0, x, 1))])
    assert len(out) == 2 and all(np.frombuffer(bytes(dissect(f)[BTH].payload)[20:], "<i4")
                                 .tolist() == (2 * x).tolist() for _, f in out)


# --- the host ------------------------------------------------------------------------------

def test_a_job_another_address_owns_is_a_clear_error_at_once():
    switch = GoldenSwitch()
    first = workers(2, switch)
    allreduce_all(first, [np.ones(8, np.int32)] * 2)                 # job 0: 10.1.0.1's
    for w in first:
        w.close()
    stranger = T.InProcessTransport(switch, ip="10.9.9.9")
    t0 = time.monotonic()
    with pytest.raises(NetaggError, match=r"job 0 is enabled by 10\.1\.0\.1: the switch "
                                          r"refused rank 0's configuration"):
        Worker(0, 2, stranger, session=uuid.uuid4().hex)
    assert time.monotonic() - t0 < 1
    # the owner's address sets the job up for a new run; the manager may release it
    results = allreduce_all(workers(2, switch), [np.full(8, 3, np.int32)] * 2)
    assert all((r == 6).all() for r in results)
    ctl = SwitchControl(switch, ip=MANAGER)
    with pytest.raises(NetaggError, match=r"job 0 is enabled by 10\.1\.0\.1"):
        ctl.release(0)
    ctl.set_manager()
    assert ctl.manager() == MANAGER
    ctl.release(0)
    assert ctl.owners()[0] is None
    ws = [Worker(r, 2, T.InProcessTransport(switch, ip=f"10.9.9.{9 + r}"), session="s")
          for r in range(2)]
    assert all((r == 2).all() for r in allreduce_all(ws, [np.ones(8, np.int32)] * 2))
    assert ctl.owners()[0] == "10.9.9.9"


def test_an_overlapping_job_is_a_clear_error_at_once():
    switch = GoldenSwitch(jobs=2, slots=32)
    allreduce_all(workers(2, switch), [np.ones(8, np.int32)] * 2)    # job 0: slots 0..15
    t0 = time.monotonic()
    with pytest.raises(NetaggError, match=r"job 1: its slots 8\.\.23 overlap job 0's slots "
                                          r"0\.\.15 \(enabled by 10\.1\.0\.1\)"):
        Worker(0, 2, switch, job=1, slot_base=8, slots=16, session=uuid.uuid4().hex)
    with pytest.raises(NetaggError, match=r"slots 24\.\.39 are not inside the switch's 32"):
        Worker(0, 2, switch, job=1, slot_base=24, slots=16, session=uuid.uuid4().hex)
    assert time.monotonic() - t0 < 1


def test_foreign_writes_during_an_allreduce_leave_it_exact():
    switch = GoldenSwitch()
    ws = workers(3, switch)
    ctl = SwitchControl(switch, ip=FOREIGN)
    attack = [(R.job_reg(0, R.JOB_CONFIG), 0), (R.job_reg(0, R.JOB_CREDITS), 1),
              (R.job_reg(0, R.JOB_SLOT_COUNT), 1), (R.worker_reg(0, 1, R.WORKER_IP), 1)]
    rng = np.random.default_rng(8)
    inputs = [rng.integers(-2**20, 2**20, 50_000, dtype=np.int32) for _ in ws]
    handles = [w.allreduce_async(x) for w, x in zip(ws, inputs)]
    while ctl.owners()[0] is None:          # set up while disabled: anyone's until enabled
        pass
    writes = 0
    while not all(h.done() for h in handles):
        back = ctl.write(attack)
        assert back[0] >> 31 == 1 and back[2] > 1            # refused: the job is running
        writes += 1
    expected = np.sum(inputs, axis=0, dtype=np.int32)
    assert all(np.array_equal(h.wait(), expected) for h in handles)
    ports = ctl.counters(jobs=[])["ports"].values()
    assert writes > 3 and sum(p["control_denied"] for p in ports) == writes * len(attack)


def test_probe_shows_the_manager_and_the_owners():
    with SimServer(GoldenSwitch()).start() as server:
        with Worker(0, 1, server.url, session=uuid.uuid4().hex) as w:
            assert (w.allreduce(np.ones(4, np.int32)) == 1).all()
            report = probe(server.url)
            assert report["manager"] is None
            assert report["jobs"][0]["owner"] == w.transport.local.ip
            assert report["jobs"][0]["enabled"] and report["jobs"][1]["owner"] is None
            ctl = SwitchControl(server.url)
            ctl.set_manager()
            ctl.close()
            assert probe(server.url)["manager"] == w.transport.local.ip


def test_a_rank_waits_for_its_rank_0_on_a_job_its_session_left_enabled():
    """A second run of the same session, rank 1 first: the job and rank 1's entry are the
    first run's (its tag, its address), so rank 1 waits, without sending, until rank 0
    configures the job and clears its entry; then it writes the entry and the sums are
    exact."""
    switch = GoldenSwitch()
    first = workers(2, switch, session="same")
    allreduce_all(first, [np.full(8, 5, np.int32)] * 2)
    for w in first:
        w.close()
    late = Worker(1, 2, switch, session="same")
    handle = late.allreduce_async(np.full(8, 2, np.int32))
    for _ in range(20):
        assert not handle.done()
    assert not late.engine.joined and late.counters().get("packets_sent", 0) == 0
    rank0 = Worker(0, 2, switch, session="same")
    out = [rank0.allreduce_async(np.full(8, 1, np.int32)).wait(), handle.wait()]
    assert all((r == 3).all() for r in out)
