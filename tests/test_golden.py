"""The golden model against scapy and numpy: configuration through the control path,
aggregation of scenarios with duplicates, reordering, malformed, stale and beyond-credit
frames, replays after a lost result or an early close, credits and the results' PSN, quorum,
null contributions from the priority drop, saturation, counters."""

import collections
import random

import numpy as np
import pytest
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.contract.headers import Verdict
from netagg.sim import golden as G
from netagg.sim.golden import GoldenSwitch
from netagg.sim.scapy_frames import ImmDt
from tests.switch_traffic import (
    check_results,
    control_frame,
    dissect,
    job_config_records,
    make_workers,
    run_rounds,
    scapy_rebuilds,
    scenario,
    switch_records,
)


def configure(sw, sc):
    for f in sc.config:
        out = sw.receive(0, f)
        assert len(out) == 1 and out[0][0] == 0


def control(sw, records, port=0):
    """Apply control records; the values of the reply."""
    [(_, reply)] = sw.receive(port, control_frame(records))
    return [v for _, v in W.unpack_records(bytes(dissect(reply)[BTH].payload))]


def setup(workers=2, slots=4, credits=0, quorum=0, ports=2, seed=0):
    """A switch with job 0 of `workers` workers over slots 0..slots-1."""
    sw = GoldenSwitch(ports=ports, jobs=2, max_workers=8, slots=16)
    ws = make_workers(0, workers, ports, random.Random(seed), slot_count=slots)
    control(sw, switch_records())
    control(sw, job_config_records(0, ws, 0, slots, credits, quorum))
    return sw, ws


def result(frame):
    """(destination IP, BTH.psn, RESULT_IMM fields, int32 lanes) of a result frame."""
    assert scapy_rebuilds(frame)
    pkt = dissect(frame)
    body = bytes(pkt[BTH].payload)
    imm = W.unpack_imm(W.RESULT_IMM, ImmDt(body[16:20]).data)
    return pkt[IP].dst, pkt[BTH].psn, imm, np.frombuffer(body[20:], "<i4")


def lanes(*values):
    return np.array(values, np.int32)


def test_control_reads_and_writes():
    sw = GoldenSwitch(ports=4, jobs=2, max_workers=4, slots=16, width=256)
    recs = [(R.REG_MAGIC, 0), (R.REG_PARAMS, 0), (R.REG_SLOTS, 0),
            (R.WRITE | R.REG_IP, 0x0A000001), (R.WRITE | R.job_reg(1, R.JOB_CONFIG), 0x8000003F),
            (R.job_reg(5, R.JOB_CONFIG), 0), (R.WRITE | R.REG_MAGIC, 7),
            (R.WRITE | R.REG_PORT, 1)]
    [(port, reply)] = sw.receive(2, control_frame(recs, psn=77))
    assert port == 2 and scapy_rebuilds(reply)
    pkt = dissect(reply)
    assert pkt[BTH].opcode == W.OP_CONTROL and pkt[BTH].psn == 77 and pkt[UDP].dport == 0xD000
    values = [v for _, v in W.unpack_records(bytes(pkt[BTH].payload))]
    assert values == [R.MAGIC, (4 << 24) | (2 << 16) | (4 << 8) | 4, 16, 0x0A000001,
                      0x80000004, 0, R.MAGIC, 2]     # REG_PORT: the request's port
    assert sw.read(R.port_counter(2, "control")) == 1
    assert control(sw, [(R.REG_PORT, 0)], port=3) == [3]


def test_new_registers():
    sw = GoldenSwitch(ports=2, jobs=2, max_workers=4, slots=16)
    thresholds = [R.drop_threshold(c) for c in range(R.PRIORITY_CLASSES)]
    assert control(sw, [(a, 0) for a in thresholds]) == [R.NEVER_DROP] * 8
    assert control(sw, [(R.WRITE | a, 0x10000 | (c * 100)) for c, a in enumerate(thresholds)]
                   ) == [c * 100 for c in range(8)]
    assert R.drop_threshold(8) == R.REG_DROP_THRESHOLD + 8
    assert control(sw, [(R.WRITE | R.drop_threshold(8), 5), (R.drop_threshold(8), 0)]) == [0, 0]
    job = [(R.WRITE | R.job_reg(1, R.JOB_CREDITS), 0x12345),
           (R.WRITE | R.job_reg(1, R.JOB_QUORUM), 0xFF),
           (R.WRITE | R.job_reg(1, R.JOB_COMPLETED), 9),
           (R.job_reg(0, R.JOB_CREDITS), 0), (R.job_reg(0, R.JOB_QUORUM), 0)]
    assert control(sw, job) == [0x2345, 0x3F, 0, 0, 0]
    # CONFIG leaves CREDITS and QUORUM alone
    assert control(sw, [(R.WRITE | R.job_reg(1, R.JOB_CONFIG), 0x80000002),
                        (R.job_reg(1, R.JOB_CREDITS), 0), (R.job_reg(1, R.JOB_QUORUM), 0)]
                   ) == [0x80000002, 0x2345, 0x3F]
    # the new counters, in netagg/contract/regmap.py's order
    assert R.PORT_COUNTERS.index("drop_priority") == 9
    assert R.JOB_COUNTERS.index("drop_stale") == 4
    assert R.JOB_COUNTERS.index("drop_credit") == 9


def _stale_frames(sc, batch, rnd, jobs):
    """The frames of a batch that the credit or stale check must drop: good frames of a
    configured job, rank, key and slot whose MSN is not their use's."""
    n = 0
    for _, frame in batch:
        if G.parse(frame)[0] != Verdict.OK:
            continue
        pkt = W.parse_frame(frame)
        req = W.unpack_imm(W.REQUEST_IMM, pkt.imm)
        ws = sc.workers.get(req["job"], [])
        if req["job"] >= jobs or req["rank"] >= len(ws) or req["slot"] >= sc.slots:
            continue
        w = ws[req["rank"]]
        if w.ip == pkt.src.ip and pkt.rkey == w.key and \
                W.split_va(pkt.va)[0] != rnd * sc.slots + req["slot"]:
            n += 1
    return n


@pytest.mark.parametrize("seed", range(4))
def test_scenario_sums(seed):
    rng = random.Random(seed)
    slots, rounds, workers = 8, 3, 3
    credits = slots if seed % 2 else 0
    sc = scenario(rng, ports=4, jobs=2, workers=workers, slots=slots, rounds=rounds,
                  credits=credits, stale=0.15, droppable=0.3)
    sw = GoldenSwitch(ports=4, jobs=2, max_workers=4, slots=32)
    configure(sw, sc)
    outputs = run_rounds(sw, sc)
    seen = check_results(sc, outputs)
    # A result reaches its worker once per use, unless a duplicate arrived after completion.
    replays = sum(c["replays"] for c in sw.job_counters)
    assert sum(len(v) for v in seen.values()) == len(seen) + replays
    # Results carry the credit limit: the k-th use completed sends CREDITS + k to every
    # worker; a replay sends the current limit.
    for j, c in enumerate(sw.job_counters):
        psns = collections.Counter(dissect(f)[BTH].psn for _, _, f in outputs
                                   if dissect(f)[IP].dst in {w.ip for w in sc.workers[j]})
        assert set(psns) == {credits + k for k in range(1, rounds * slots + 1)}
        assert min(psns.values()) >= workers
        assert psns.total() == rounds * slots * workers + c["replays"]
    stale = sum(_stale_frames(sc, batch, rnd, 2) for rnd, batch in enumerate(sc.rounds))
    dropped = sum(c["drop_stale"] + c["drop_credit"] for c in sw.job_counters)
    assert stale > 0 and dropped == stale
    assert (sum(c["drop_credit"] for c in sw.job_counters) > 0) == bool(credits)
    for c in sw.job_counters:
        assert c["completed"] == slots * rounds and c["contributions"] == slots * rounds * 3
    assert sum(c["drop_priority"] for c in sw.port_counters) == 0
    assert sw.read(R.job_reg(1, R.JOB_COMPLETED)) == slots * rounds


def test_saturation_sets_overflow():
    rng = random.Random(5)
    sw = GoldenSwitch(ports=2, jobs=1, max_workers=4, slots=8)
    # Two workers: a saturating sum of two is the clipped total whatever the order.
    sc = scenario(rng, ports=2, jobs=1, workers=2, slots=4, rounds=1, saturate=True,
                  duplicates=0, malformed=0)
    configure(sw, sc)
    check_results(sc, run_rounds(sw, sc))
    assert sw.job_counters[0]["overflows"] == sum(
        ov for (_, j, s, r), (_, ov) in sc.expected.items() if r == 0)
    assert sw.job_counters[0]["overflows"] > 0


def test_lost_result_is_sent_again():
    sw, ws = setup(workers=2, slots=4)
    a, b = np.arange(8, dtype=np.int32), np.full(8, -3, np.int32)
    fa, fb = ws[0].contribution(1, 0, 0, a, 0), ws[1].contribution(1, 0, 0, b, 0)
    assert W.split_va(W.parse_frame(fa).va)[0] == W.split_va(W.parse_frame(fb).va)[0] == 1
    assert sw.receive(0, fa) == []
    assert sw.receive(0, fa) == []                 # duplicate before completion
    done = sw.receive(1, fb)
    assert len(done) == 2
    again = sw.receive(1, fb)                      # b lost its result and sends again
    assert len(again) == 1 and result(again[0][1])[0] == ws[1].ip
    np.testing.assert_array_equal(result(again[0][1])[3], a + b)
    c = sw.job_counters[0]
    assert (c["duplicates"], c["replays"], c["completed"]) == (1, 1, 1)
    # a moves on to the slot's next use (version 1, MSN 5); b lost the result again, and
    # still gets it: the copies are independent.
    fa1 = ws[0].contribution(1, 1, 0, b, 1)
    assert W.split_va(W.parse_frame(fa1).va) == (5, 0)
    assert sw.receive(0, fa1) == []
    again = sw.receive(1, fb)
    assert len(again) == 1 and result(again[0][1])[0] == ws[1].ip
    np.testing.assert_array_equal(result(again[0][1])[3], a + b)
    # b moves on too: version 1 completes with a fresh sum.
    out = sw.receive(1, ws[1].contribution(1, 1, 0, a, 1))
    np.testing.assert_array_equal(result(out[0][1])[3], a + b)
    assert sw.job_counters[0]["completed"] == 2
    # The third use (version 0 again, MSN 9) overwrites use 0: b's old message is stale now.
    assert sw.receive(0, ws[0].contribution(1, 0, 0, a, 2)) == []
    assert sw.receive(1, fb) == []
    assert (c["drop_stale"], c["replays"]) == (1, 2)


def test_drops_are_counted():
    sw, ws = setup(workers=2, slots=4)
    one = np.ones(4, np.int32)
    good = ws[0].contribution(0, 0, 0, one, 0)
    bad_icrc = good[:-1] + bytes([good[-1] ^ 1])
    cases = [
        (bad_icrc, "port", "drop_bad_icrc"),
        (good[:50], "port", "drop_truncated"),
        (ws[0].contribution(0, 0, 0, one, 0, job=3, msn=0), "port", "drop_bad_job"),
        (ws[0].contribution(0, 0, 0, one, 0, job=1, msn=0), "port", "drop_bad_job"),
        (ws[0].contribution(0, 0, 0, one, 0, length=8, msn=0), "port", "drop_bad_payload"),
        (ws[0].contribution(4, 0, 0, one, 0, msn=4), "job", "drop_bad_slot"),
        (ws[0].contribution(0, 0, 0, one, 0, rank=1, msn=0), "job", "drop_bad_worker"),
        (ws[0].contribution(0, 0, 0, one, 0, rank=2, msn=0), "job", "drop_bad_worker"),
    ]
    for frame, where, name in cases:
        before = sw.counters()
        assert sw.receive(1, frame) == []
        after = sw.counters()
        table = "ports" if where == "port" else "jobs"
        index = 1 if where == "port" else 0
        assert after[table][index][name] == before[table][index][name] + 1, name
        changed = {(t, i, k) for t in after for i, cs in enumerate(after[t]) for k in cs
                   if cs[k] != before[t][i][k]}
        assert changed <= {(table, index, name), ("ports", 1, "rx")}, changed
    assert all(not c.bitmap for pair in sw.state for c in pair)
    assert sw.receive(0, good) == []
    out = sw.receive(1, ws[1].contribution(0, 0, 0, one, 0))
    np.testing.assert_array_equal(result(out[0][1])[3], 2 * one)
    # a different length from the slot's first contribution
    assert sw.receive(0, ws[0].contribution(2, 0, 0, one, 0)) == []
    assert sw.receive(1, ws[1].contribution(2, 0, 0, lanes(1, 2), 0)) == []
    assert sw.job_counters[0]["drop_bad_length"] == 1


def test_credit_limit():
    sw, ws = setup(workers=2, slots=4, credits=2)
    x = lanes(1, 2, 3)
    # COMPLETED 0: MSNs 0 and 1 may be open, 2 is beyond the limit
    assert sw.receive(0, ws[0].contribution(2, 0, 0, x, 0)) == []          # MSN 2
    assert sw.job_counters[0]["drop_credit"] == 1
    assert all(not c.bitmap for c in sw.state[2])                          # untouched
    assert sw.receive(0, ws[0].contribution(1, 0, 0, x, 0)) == []          # MSN 1
    assert sw.receive(0, ws[0].contribution(0, 0, 0, x, 0)) == []          # MSN 0
    out = sw.receive(1, ws[1].contribution(0, 0, 0, x, 0))
    assert [result(f)[1] for _, f in out] == [3, 3]                        # 1 + 2
    assert control(sw, [(R.job_reg(0, R.JOB_COMPLETED), 0)]) == [1]
    # COMPLETED 1: MSN 2 is allowed now, 3 is not
    assert sw.receive(1, ws[1].contribution(3, 0, 0, x, 0)) == []          # MSN 3
    assert sw.job_counters[0]["drop_credit"] == 2
    assert sw.receive(1, ws[1].contribution(2, 0, 0, x, 0, msn=2)) == []
    assert sw.job_counters[0]["drop_credit"] == 2 and sw.state[2][0].count == 1
    # a retransmission of MSN 0, behind COMPLETED, passes the credit check: replayed
    [(_, f)] = sw.receive(0, ws[0].contribution(0, 0, 0, x, 0, msn=0))
    assert result(f)[:2] == (ws[0].ip, 3) and sw.job_counters[0]["replays"] == 1
    # MSN 1 completes: the limit is 4, in every copy
    out = sw.receive(1, ws[1].contribution(1, 0, 0, x, 0, msn=1))
    assert [result(f)[1] for _, f in out] == [4, 4]


def test_no_credit_limit():
    sw, ws = setup(workers=1, slots=4, credits=0)
    out = sw.receive(0, ws[0].contribution(0, 0, 0, lanes(5), 0, msn=100_000))
    assert len(out) == 1 and result(out[0][1])[1] == 1                     # PSN = COMPLETED
    assert sw.job_counters[0]["drop_credit"] == 0


def test_credit_check_wraps_at_32_bits():
    sw, ws = setup(workers=1, slots=4, credits=4)
    sw.job[0].completed = 0xFFFFFFFE           # COMPLETED is read-only: set it directly
    assert sw.receive(0, ws[0].contribution(0, 0, 0, lanes(1), 0, msn=2)) == []   # 4 ahead
    assert sw.job_counters[0]["drop_credit"] == 1
    out = sw.receive(0, ws[0].contribution(1, 0, 0, lanes(1), 0, msn=1))         # 3 ahead
    assert len(out) == 1 and sw.read(R.job_reg(0, R.JOB_COMPLETED)) == 0xFFFFFFFF
    out = sw.receive(0, ws[0].contribution(0, 0, 0, lanes(1), 0, msn=0))
    assert len(out) == 1 and sw.read(R.job_reg(0, R.JOB_COMPLETED)) == 0
    assert result(out[0][1])[1] == 4


def test_result_psn_is_the_credit_limit_across_24_bits():
    sw, ws = setup(workers=2, slots=8, credits=3)
    start = (1 << 24) - 5
    sw.job[0].completed = start                # COMPLETED is read-only: set it directly
    limit = start + 3
    for k in range(6):
        msn = start + k
        slot = msn % 8
        assert sw.receive(0, ws[0].contribution(slot, 0, 0, lanes(k), 0, msn=msn)) == []
        out = sw.receive(1, ws[1].contribution(slot, 0, 0, lanes(k), 0, msn=msn))
        psns = {result(f)[1] for _, f in out}
        assert len(out) == 2 and psns == {(start + k + 1 + 3) & 0xFFFFFF}
        # the host reads the running total back, across the 24-bit wrap
        limit = W.unwrap(psns.pop(), limit)
        assert limit == start + k + 1 + 3
    assert limit > 1 << 24


def test_stale_messages_are_dropped():
    sw, ws = setup(workers=2, slots=4)
    x = lanes(7, 8)
    # use of slot 0, version 0, MSN 8 (on a fresh copy, any MSN begins a use)
    assert sw.receive(0, ws[0].contribution(0, 0, 0, x, 0, msn=8)) == []
    for msn in (4, 12, 0xFFFFFFFF):
        # in progress: any other MSN is stale, ahead or behind
        assert sw.receive(1, ws[1].contribution(0, 0, 0, x, 0, msn=msn)) == [], msn
    assert sw.job_counters[0]["drop_stale"] == 3
    # only the low 16 bits are kept: 8 + 0x10000 is MSN 8 to the slot
    assert len(sw.receive(1, ws[1].contribution(0, 0, 0, x, 0, msn=8 + 0x10000))) == 2
    assert sw.job_counters[0]["completed"] == 1
    # complete: an older MSN is stale, the same is a replay, a later one a new use
    assert sw.receive(1, ws[1].contribution(0, 0, 0, x, 0, msn=4)) == []
    assert sw.job_counters[0]["drop_stale"] == 4
    assert len(sw.receive(1, ws[1].contribution(0, 0, 0, x, 0, msn=8))) == 1
    assert sw.receive(1, ws[1].contribution(0, 0, 0, x, 0, msn=12)) == []
    assert sw.state[0][0].count == 1 and sw.state[0][0].bitmap == 2
    assert sw.job_counters[0]["replays"] == 1


def test_msn_compare_wraps_at_16_bits():
    sw, ws = setup(workers=1, slots=1)
    for msn in (0xFFFF, 0x10000, 0x17FFF, 0x1FFFE, 0x20000):
        assert len(sw.receive(0, ws[0].contribution(0, 0, 0, lanes(1), 0, msn=msn))) == 1
    # half the space back is behind
    assert sw.receive(0, ws[0].contribution(0, 0, 0, lanes(1), 0, msn=0x18000)) == []
    assert sw.job_counters[0]["drop_stale"] == 1 and sw.job_counters[0]["completed"] == 5


def test_quorum_closes_early_and_replays_to_late_workers():
    sw, ws = setup(workers=3, slots=2, quorum=2)
    a, b, c = lanes(1, 10), lanes(2, 20), lanes(4, 40)
    assert sw.receive(0, ws[0].contribution(0, 0, 0, a, 0)) == []
    out = sw.receive(1, ws[1].contribution(0, 0, 0, b, 0))
    got = [result(f) for _, f in out]
    assert [g[0] for g in got] == [w.ip for w in ws]                       # every rank
    for _, psn, imm, values in got:
        assert psn == 1 and imm["count"] == 2
        np.testing.assert_array_equal(values, a + b)
    assert sw.job_counters[0]["completed"] == 1 and sw.state[0][0].count == 0
    # the late worker (its bit is not set) gets the result alone; so does a resend
    for w, x in ((ws[2], c), (ws[0], a)):
        [(port, f)] = sw.receive(0, w.contribution(0, 0, 0, x, 0))
        dst, psn, imm, values = result(f)
        assert (port, dst, psn, imm["count"]) == (w.port, w.ip, 1, 2)
        np.testing.assert_array_equal(values, a + b)
    c_ = sw.job_counters[0]
    assert (c_["replays"], c_["contributions"], c_["completed"]) == (2, 2, 1)
    assert sw.state[0][0].bitmap == 0b011


@pytest.mark.parametrize("quorum", [0, 3, 4, 63])
def test_quorum_of_all_workers(quorum):
    sw, ws = setup(workers=3, slots=2, quorum=quorum)
    for w in ws[:2]:
        assert sw.receive(0, w.contribution(0, 0, 0, lanes(1), 0)) == []
    out = sw.receive(0, ws[2].contribution(0, 0, 0, lanes(1), 0))
    assert len(out) == 3 and result(out[0][1])[2]["count"] == 3


def test_quorum_written_lower_completes_at_the_next_contribution():
    """A use completes when its count reaches the quorum: one already past a QUORUM written
    lower while it was in progress completes at its next contribution (as in the RTL)."""
    sw, ws = setup(workers=4, slots=2, quorum=3)
    for w in ws[:2]:
        assert sw.receive(0, w.contribution(0, 0, 0, lanes(1), 0)) == []
    control(sw, [(R.WRITE | R.job_reg(0, R.JOB_QUORUM), 1)])
    out = sw.receive(0, ws[2].contribution(0, 0, 0, lanes(1), 0))
    assert len(out) == 4 and sw.job_counters[0]["completed"] == 1
    imm = W.unpack_imm(W.RESULT_IMM, W.parse_frame(out[0][1]).imm)
    assert imm["count"] == 3
    # the last worker's contribution is late: it gets the result again
    assert len(sw.receive(0, ws[3].contribution(0, 0, 0, lanes(1), 0))) == 1
    # a new use of another slot completes at its first contribution
    assert len(sw.receive(0, ws[0].contribution(1, 0, 0, lanes(1), 0))) == 4


def _priority_switch(thresholds):
    sw, ws = setup(workers=2, slots=4)
    control(sw, [(R.WRITE | R.drop_threshold(c), t) for c, t in thresholds.items()])
    return sw, ws


def test_priority_drop_threshold():
    x = lanes(5, 6)
    dscp3, dscp5 = W.priority_dscp(3), W.priority_dscp(5)
    assert (dscp3, dscp5) == (24, 40)
    cases = [   # (droppable, dscp, fill, null)
        (True, dscp3, 99, False), (True, dscp3 | 7, 100, True), (True, dscp3, 5000, True),
        (False, dscp3, 5000, False), (True, W.priority_dscp(2), 5000, False),
        (True, dscp5, 0, True), (False, dscp5, 0, False),
    ]
    for n, (droppable, dscp, fill, null) in enumerate(cases):
        sw, ws = _priority_switch({3: 100, 5: 0})
        f0 = ws[0].contribution(0, 0, 0, x, 0, droppable=droppable, dscp=dscp)
        rx = sw.port_counters[0]["rx"]
        assert sw.receive(0, f0, fill=fill) == []
        assert sw.port_counters[0]["drop_priority"] == int(null), n
        assert sw.port_counters[0]["rx"] == rx + 1              # a null is taken all the same
        [(_, f)] = sw.receive(1, ws[1].contribution(0, 0, 0, x, 0))[:1]
        _, _, imm, values = result(f)
        assert imm["count"] == (1 if null else 2), n
        np.testing.assert_array_equal(values, x if null else 2 * x)


def test_idle_switch_nulls_only_at_threshold_zero():
    sw, ws = _priority_switch({1: 0, 2: 1})
    frames = [w.contribution(0, 0, 0, lanes(3), 0, droppable=True, dscp=W.priority_dscp(2))
              for w in ws]
    for p, f in enumerate(frames):
        sw.send(p, f)                              # fill 0: threshold 1 never nulls
    [(_, f), _] = sw.run()
    assert result(f)[2]["count"] == 2 and sw.port_counters[0]["drop_priority"] == 0
    frames = [w.contribution(1, 0, 0, lanes(3), 0, droppable=True, dscp=W.priority_dscp(1))
              for w in ws]
    for p, f in enumerate(frames):
        sw.send(p, f)
    [(_, f), _] = sw.run()
    dst, psn, imm, values = result(f)
    assert imm["count"] == 0 and not values.any()  # a use of nulls only sums to zeros
    assert [c["drop_priority"] for c in sw.port_counters] == [1, 1]
    assert sw.job_counters[0]["completed"] == 2 and sw.job_counters[0]["contributions"] == 4


def test_forced_null():
    sw, ws = _priority_switch({0: 0})
    x, y = lanes(1, 2, 3, 4), lanes(10, 20, 30, 40)
    # forced null with thresholds that would not drop, and forced data at threshold 0
    sw.send(0, ws[0].contribution(0, 0, 0, x, 0, droppable=True, dscp=W.priority_dscp(4)),
            fill=0, null=True)
    sw.send(1, ws[1].contribution(0, 0, 0, y, 0, droppable=True), fill=10_000, null=False)
    out = sw.run()
    _, _, imm, values = result(out[0][1])
    assert imm["count"] == 1
    np.testing.assert_array_equal(values, y)
    assert [c["drop_priority"] for c in sw.port_counters] == [1, 0]
    # only a droppable contribution the parser takes can be null
    good = ws[0].contribution(1, 0, 0, x, 0)
    droppable = ws[0].contribution(1, 0, 0, x, 0, droppable=True)
    for frame in (good, control_frame([(R.REG_MAGIC, 0)]), droppable[:50],
                  droppable[:-1] + bytes([droppable[-1] ^ 1])):
        before = sw.counters()
        with pytest.raises(ValueError):
            sw.receive(0, frame, null=True)
        assert sw.counters() == before
    assert sw.receive(0, good, null=False) == []   # forcing "not null" is always allowed


def test_null_completes_a_use_and_keeps_its_header():
    sw, ws = setup(workers=3, slots=4)
    a, b = lanes(1, -2, 3), lanes(100, 200, 300)
    assert sw.receive(0, ws[0].contribution(0, 0, 0, a, 0, exponent=-3)) == []
    # the null's exponent counts (its header is kept), its payload does not
    assert sw.receive(1, ws[1].contribution(0, 0, 0, b, 0, exponent=5, droppable=True),
                      null=True) == []
    # a null's length is its header's: a different one is a bad length
    assert sw.receive(1, ws[2].contribution(0, 0, 0, lanes(1), 0, droppable=True),
                      null=True) == []
    assert sw.job_counters[0]["drop_bad_length"] == 1
    out = sw.receive(1, ws[2].contribution(0, 0, 0, b, 0, droppable=True), null=True)
    assert len(out) == 3
    _, _, imm, values = result(out[0][1])
    assert (imm["count"], imm["exponent"], imm["overflow"]) == (1, 5, 0)
    np.testing.assert_array_equal(values, a)
    assert [c["drop_priority"] for c in sw.port_counters] == [0, 3]
    # a null that the aggregator then drops still counts drop_priority
    sw.receive(0, ws[0].contribution(0, 0, 0, a, 0, job=1, droppable=True), null=True)
    assert sw.port_counters[0]["drop_priority"] == 1
    assert sw.port_counters[0]["drop_bad_job"] == 1


def test_null_first_then_data_and_quorum_counts_data():
    sw, ws = setup(workers=3, slots=4, quorum=2)
    x = lanes(G.INT32_MAX, -5)
    # a null begins the use (zeros): the data added to it do not saturate
    assert sw.receive(0, ws[0].contribution(0, 0, 0, x, 0, droppable=True), null=True) == []
    out = sw.receive(0, ws[1].contribution(0, 0, 0, x, 0))
    assert len(out) == 3
    _, psn, imm, values = result(out[0][1])
    assert (psn, imm["count"], imm["overflow"]) == (1, 1, 0)
    np.testing.assert_array_equal(values, x)


def test_config_write_clears_completed_and_slots():
    sw, ws = setup(workers=2, slots=4)
    x = lanes(9)
    assert sw.receive(0, ws[0].contribution(0, 0, 0, x, 0)) == []
    assert len(sw.receive(1, ws[1].contribution(0, 0, 0, x, 0))) == 2
    assert sw.receive(0, ws[0].contribution(1, 0, 0, x, 0)) == []          # in progress
    assert control(sw, [(R.job_reg(0, R.JOB_COMPLETED), 0)]) == [1]
    assert control(sw, [(R.WRITE | R.job_reg(0, R.JOB_CONFIG), (1 << 31) | 2),
                        (R.job_reg(0, R.JOB_COMPLETED), 0)]) == [(1 << 31) | 2, 0]
    assert all(c == G.SlotCopy() for pair in sw.state[:4] for c in pair)
    # MSN 0 again: a new use of a fresh copy, not a replay
    for w in ws:
        w.restart()
    assert sw.receive(0, ws[0].contribution(0, 0, 0, x, 0)) == []
    out = sw.receive(1, ws[1].contribution(0, 0, 0, x, 0))
    assert result(out[0][1])[1] == 1 and sw.job_counters[0]["replays"] == 0
