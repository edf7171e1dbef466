"""The golden model against scapy and numpy: configuration through the control path,
aggregation of scenarios with duplicates, reordering and malformed frames, replays after a
lost result, saturation, counters."""

import random

import numpy as np
import pytest
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP

from host import wire as W
from sim.golden import GoldenSwitch
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


def test_control_reads_and_writes():
    sw = GoldenSwitch(ports=4, jobs=2, max_workers=4, slots=16, width=256)
    recs = [(W.REG_MAGIC, 0), (W.REG_PARAMS, 0), (W.REG_SLOTS, 0),
            (W.WRITE | W.REG_IP, 0x0A000001), (W.WRITE | W.job_reg(1, W.JOB_CONFIG), 0x8000003F),
            (W.job_reg(5, W.JOB_CONFIG), 0), (W.WRITE | W.REG_MAGIC, 7)]
    [(port, reply)] = sw.receive(2, control_frame(recs, psn=77))
    assert port == 2 and scapy_rebuilds(reply)
    pkt = dissect(reply)
    assert pkt[BTH].opcode == W.OP_CONTROL and pkt[BTH].psn == 77 and pkt[UDP].dport == 0xD000
    values = [v for _, v in W.unpack_records(bytes(pkt[BTH].payload))]
    assert values == [W.MAGIC, (4 << 24) | (2 << 16) | (4 << 8) | 4, 16, 0x0A000001,
                      0x80000004, 0, W.MAGIC]
    assert sw.read(W.port_counter(2, "control")) == 1


@pytest.mark.parametrize("seed", range(4))
def test_scenario_sums(seed):
    rng = random.Random(seed)
    sc = scenario(rng, ports=4, jobs=2, workers=3, slots=8, rounds=3)
    sw = GoldenSwitch(ports=4, jobs=2, max_workers=4, slots=32)
    configure(sw, sc)
    outputs = run_rounds(sw, sc)
    seen = check_results(sc, outputs)
    # A result reaches its worker once per use, unless a duplicate arrived after completion.
    replays = sum(c["replays"] for c in sw.job_counters)
    assert sum(len(v) for v in seen.values()) == len(seen) + replays
    # Each worker's PSNs count up from 0 without gaps, in the order results leave.
    psns = {}
    for _, _, frame in outputs:
        pkt = dissect(frame)
        psns.setdefault(pkt[IP].dst, []).append(pkt[BTH].psn)
    assert all(p == list(range(len(p))) for p in psns.values())
    for c in sw.job_counters:
        assert c["completed"] == 8 * 3 and c["contributions"] == 8 * 3 * 3


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
    rng = random.Random(1)
    sw = GoldenSwitch(ports=2, jobs=1, max_workers=2, slots=4)
    ws = make_workers(0, 2, 2, rng)
    sw.receive(0, control_frame(switch_records()))
    sw.receive(0, control_frame(job_config_records(0, ws, 0, 4)))
    a, b = np.arange(8, dtype=np.int32), np.full(8, -3, np.int32)
    fa, fb = ws[0].contribution(1, 0, 0, a, 0), ws[1].contribution(1, 0, 0, b, 0)
    assert sw.receive(0, fa) == []
    assert sw.receive(0, fa) == []                 # duplicate before completion
    done = sw.receive(1, fb)
    assert len(done) == 2
    again = sw.receive(1, fb)                      # b lost its result and sends again
    assert len(again) == 1 and dissect(again[0][1])[IP].dst == ws[1].ip
    lanes = np.frombuffer(bytes(dissect(again[0][1])[BTH].payload)[20:], "<i4")
    np.testing.assert_array_equal(lanes, a + b)
    c = sw.job_counters[0]
    assert (c["duplicates"], c["replays"], c["completed"]) == (1, 1, 1)
    # a moves on to the slot's next use (version 1), clearing its bit in version 0; b lost
    # the result again, and still gets it from the shadow copy.
    assert sw.receive(0, ws[0].contribution(1, 1, 0, b, 1)) == []
    again = sw.receive(1, fb)
    assert len(again) == 1 and dissect(again[0][1])[IP].dst == ws[1].ip
    lanes = np.frombuffer(bytes(dissect(again[0][1])[BTH].payload)[20:], "<i4")
    np.testing.assert_array_equal(lanes, a + b)
    # b moves on too: version 1 completes with a fresh sum.
    out = sw.receive(1, ws[1].contribution(1, 1, 0, a, 1))
    lanes = np.frombuffer(bytes(dissect(out[0][1])[BTH].payload)[20:], "<i4")
    np.testing.assert_array_equal(lanes, a + b)
    assert sw.job_counters[0]["completed"] == 2


def test_drops_are_counted():
    rng = random.Random(2)
    sw = GoldenSwitch(ports=2, jobs=1, max_workers=4, slots=4)
    ws = make_workers(0, 2, 2, rng)
    sw.receive(0, control_frame(switch_records()))
    sw.receive(0, control_frame(job_config_records(0, ws, 0, 4)))
    lanes = np.ones(4, np.int32)
    good = ws[0].contribution(0, 0, 0, lanes, 0)
    bad_icrc = good[:-1] + bytes([good[-1] ^ 1])
    cases = [
        (bad_icrc, "port", "drop_bad_icrc"),
        (good[:50], "port", "drop_truncated"),
        (ws[0].contribution(0, 0, 0, lanes, 0, job=3), "port", "drop_bad_job"),
        (ws[0].contribution(0, 0, 0, lanes, 0, length=8), "port", "drop_bad_payload"),
        (ws[0].contribution(4, 0, 0, lanes, 0), "job", "drop_bad_slot"),
        (ws[0].contribution(0, 0, 0, lanes, 0, rank=1), "job", "drop_bad_worker"),
        (ws[0].contribution(0, 0, 0, lanes, 0, rank=2), "job", "drop_bad_worker"),
    ]
    for frame, where, name in cases:
        before = sw.counters()
        assert sw.receive(1, frame) == []
        after = sw.counters()
        table = "ports" if where == "port" else "jobs"
        index = 1 if where == "port" else 0
        assert after[table][index][name] == before[table][index][name] + 1, name
    assert all(not c.bitmap for pair in sw.state for c in pair)
    assert sw.receive(0, good) == []
    out = sw.receive(1, ws[1].contribution(0, 0, 0, lanes, 0))
    lanes_out = np.frombuffer(bytes(dissect(out[0][1])[BTH].payload)[20:], "<i4")
    np.testing.assert_array_equal(lanes_out, 2 * lanes)
