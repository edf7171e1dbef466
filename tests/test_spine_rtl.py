"""The RTL spine (`hw.switch.Switch(spine=True)`, docs/leafspine.md) against the golden
spine: the fuzzer's spine mode (netagg/sim/fuzz_spine.py: leaves' partials, finals, resent partials
and their pulls, given-up uses, mutated PARTIAL fields) with no difference, and a single
switch's RTL caught by it; scapy-built partials through both spines (a final completes as it
is, a later use gives one up, a resent partial pulls the leaves missing, results and pulls
carry the use's msn in RETH.va); and golden leaves summing exactly through an RTL spine
under loss, duplication and reordering."""

import collections

import numpy as np
import pytest
from scapy.contrib.roce import BTH

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.fuzz import Comparer, stream
from netagg.sim.fuzz_mutations import get_field, set_field
from netagg.sim.fuzz_spine import PARTIAL_FIELDS
from netagg.sim.golden_spine import GoldenSpine
from netagg.sim.scapy_frames import RETH, ImmDt
from netagg.sim.topology import LinkFaults
from tests.leafspine_net import JOB, Job, Net, away_and_back, away_for_2_16
from tests.switch_traffic import dissect
from tests.test_fuzz import InOrderGolden
from tests.test_leaf_golden import partial

FRAMES = 3000
LEAVES, SLOTS = 3, 8                    # the fabric of the RTL spine's tests (`Net`)


class InOrderSpine(InOrderGolden, GoldenSpine):
    """The golden spine in the RTL's place (frames applied in the switch's commit order)."""


@pytest.fixture(scope="module")
def rtl_spine():
    """An RTL switch built as a spine, the fuzzer's parameters."""
    from netagg.sim.model import make_switch

    with make_switch(spine=True) as rtl:
        yield rtl


@pytest.fixture(scope="module")
def small_spine(rtl_spine):
    """The RTL spine as `Net(leaves=LEAVES)`'s topology makes spine 0: the fuzzer's build
    (4 ports: the three leaves' and the host's), its addresses written by the topology and its
    one job (JOB, SLOTS slots) by the test's control records, so one build serves both."""
    return rtl_spine


def with_rtl_spine(rtl):
    """A topology's `make` whose spine is `rtl` (reset), its leaves golden."""
    from netagg.sim.golden_leaf import GoldenLeaf

    rtl.reset()

    def make(uplinks=0, **params):
        return GoldenLeaf(uplinks=uplinks, **params) if uplinks else rtl
    return make


def _totals(golden) -> collections.Counter:
    total = collections.Counter()
    for counters in golden.counters()["jobs"]:
        total.update(counters)
    return total


# --- the fuzzer's spine mode -------------------------------------------------------------

def test_the_golden_spine_against_itself_pulls_finals_and_gives_up():
    golden = GoldenSpine()
    s = Comparer(InOrderSpine(), golden, seed=2).run(stream(2, FRAMES, spine=True))
    assert (s.differences, s.wrong_sums) == (0, 0) and s.results > 200
    total = _totals(golden)
    assert total["pulls"] > 20 and total["finals"] > 10 and total["abandoned"] > 3
    assert total["completed"] > 100 and total["overflows"] > 0


@pytest.mark.parametrize("field", PARTIAL_FIELDS, ids=lambda f: f.name)
def test_the_partial_fields_are_where_scapy_reads_bth_psn(field):
    good = next(f.data for f in stream(1, 50, spine=True) if f.data[W.BTH_OFFSET] == 0x2B)
    buf = bytearray(good)
    value = (1 << field.width) - 2 if field.width > 1 else 1
    set_field(buf, field, value)
    assert get_field(bytes(buf), field) == value
    name = field.name.split(".")[1]
    assert W.unpack_imm(W.PARTIAL, dissect(bytes(buf))[BTH].psn)[name] == value


def test_rtl_spine_equals_golden_spine_on_fuzzed_frames(rtl_spine):
    rtl_spine.reset()
    golden = GoldenSpine()
    s = Comparer(rtl_spine, golden, seed=21).run(stream(21, FRAMES, spine=True))
    assert s.differences == 0 and s.wrong_sums == 0, s.text()
    assert s.frames == FRAMES and s.results > 200 and s.counters > 10000
    total = _totals(golden)            # and the RTL's: every counter was read and compared
    assert total["pulls"] > 20 and total["finals"] > 10 and total["abandoned"] > 3


@pytest.mark.slow
def test_rtl_spine_equals_golden_spine_on_many_fuzzed_frames(rtl_spine):
    rtl_spine.reset()
    s = Comparer(rtl_spine, GoldenSpine(), seed=22).run(stream(22, 200_000, spine=True))
    assert s.differences == 0 and s.wrong_sums == 0, s.text()


def test_a_single_switch_is_caught_as_no_spine(rtl_model):
    """The default RTL (no spine: CONFIG.partials reads 0, a partial counts 1, no pulls)
    differs from the golden spine on the spine's traffic."""
    rtl_model.reset()
    s = Comparer(rtl_model, GoldenSpine(), seed=23).run(stream(23, 600, spine=True))
    assert s.differences > 0
    assert any("CONFIG" in d.note or "pulls" in d.note for d in s.details) or \
        any(d.kind.value == "output" for d in s.details)


# --- scapy's partials through both spines ------------------------------------------------

@pytest.fixture(params=["golden", "rtl"])
def spine(request):
    """The spine of three leaves (`Net(leaves=3)`'s), golden or RTL."""
    if request.param == "golden":
        return Net(leaves=LEAVES).spine[0]
    rtl = request.getfixturevalue("small_spine")
    return Net(leaves=LEAVES, make=with_rtl_spine(rtl)).spine[0]


def _read(frame: bytes):
    pkt = dissect(frame)
    body = bytes(pkt[BTH].payload)
    return pkt, RETH(body[:16]), ImmDt(body[16:20]).data, np.frombuffer(body[20:], "<i4")


def _counters(sw) -> dict:
    from tests.leafspine_net import control

    names = [*R.JOB_COUNTERS, *R.FABRIC_COUNTERS]
    return dict(zip(names, control(sw, [(R.job_counter(JOB, n), 0) for n in names])))


def test_a_spine_takes_finals_gives_up_and_pulls(spine):
    assert spine.receive(0, partial(0, 0, [1, 2], count=2)) == []
    out = spine.receive(2, partial(2, 0, [100, 200], count=7, final=1))
    assert sorted(port for port, _ in out) == [0, 1, 2]
    for _, frame in out:
        _, reth, imm, lanes = _read(frame)
        assert W.unpack_imm(W.RESULT_IMM, imm)["count"] == 7
        assert W.split_va(reth.va) == (0, 0)
        np.testing.assert_array_equal(lanes, [100, 200])       # the final, not 101, 202
    assert spine.receive(0, partial(0, 2, [1, 1], count=1)) == []
    assert spine.receive(1, partial(1, 4, [5, 5], count=1)) == []     # a later use of the copy
    assert spine.receive(0, partial(0, 2, [1, 1], count=1)) == []     # the given-up use: stale
    pulls = spine.receive(1, partial(1, 4, [5, 5], count=1, resent=1))
    assert sorted(port for port, _ in pulls) == [0, 2]              # the leaves missing
    for _, frame in pulls:
        pkt, reth, imm, lanes = _read(frame)
        assert pkt[BTH].dqpn == W.UPLINK_QPN and reth.dma_length == 0 and not len(lanes)
        assert W.split_va(reth.va)[0] == 4
        assert W.unpack_imm(W.RESULT_IMM, imm)["count"] == 0
    out = spine.receive(0, partial(0, 4, [2, 3], count=2, resent=1))    # added: pulls leaf 2
    assert [port for port, _ in out] == [2]
    out = spine.receive(2, partial(2, 4, [1, 1], count=3))
    assert sorted(port for port, _ in out) == [0, 1, 2]
    for _, frame in out:
        _, reth, imm, lanes = _read(frame)
        assert W.split_va(reth.va)[0] == 4 and W.unpack_imm(W.RESULT_IMM, imm)["count"] == 6
        np.testing.assert_array_equal(lanes, [8, 9])
    c = _counters(spine)
    assert (c["finals"], c["abandoned"], c["pulls"], c["drop_stale"]) == (1, 1, 3, 1)
    assert (c["completed"], c["results"]) == (2, 6)


MSN = 4                                  # a use's msn, and one 2^16 and more beyond it
BEYOND = MSN + 0x1C000                   # its low 16 bits 0xC004: behind MSN's, by 16 bits


def test_a_spine_takes_uses_2_16_messages_on_and_keeps_old_ones_stale(spine):
    """A spine's copy compares whole msns: a use 0x1C000 messages on (behind, by the low 16
    bits) begins; a late partial or final of the old use is stale (by 16 bits it would be
    ahead, and reopen the copy); the new use completes exactly and replays as it is."""
    for l in range(LEAVES):
        out = spine.receive(l, partial(l, MSN, [l, 1], count=1))
    assert sorted(port for port, _ in out) == [0, 1, 2]
    assert spine.receive(0, partial(0, BEYOND, [10, 20], count=2)) == []
    assert spine.receive(1, partial(1, MSN, [7, 7], count=1, resent=1)) == []       # late
    assert spine.receive(2, partial(2, MSN, [9, 9], count=3, final=1)) == []        # late
    assert spine.receive(1, partial(1, BEYOND, [1, 2], count=1)) == []
    out = spine.receive(2, partial(2, BEYOND, [100, 200], count=2))
    assert sorted(port for port, _ in out) == [0, 1, 2]
    for _, frame in out:
        _, reth, imm, lanes = _read(frame)
        assert W.split_va(reth.va)[0] == BEYOND and W.unpack_imm(W.RESULT_IMM, imm)["count"] == 5
        np.testing.assert_array_equal(lanes, [111, 222])
    assert spine.receive(1, partial(1, MSN, [7, 7], count=1)) == []                 # late
    [(port, frame)] = spine.receive(0, partial(0, BEYOND, [10, 20], count=2))      # a replay
    assert port == 0
    np.testing.assert_array_equal(_read(frame)[3], [111, 222])
    c = _counters(spine)
    assert (c["completed"], c["drop_stale"], c["finals"], c["replays"]) == (2, 3, 0, 1)
    assert (c["abandoned"], c["pulls"], c["results"]) == (0, 0, 7)


def test_a_spine_takes_a_partial_only_by_its_leafs_port(spine):
    """A host on another port that spoofs leaf 2's IP (and knows the job's key) cannot
    complete a use with its own final: `drop_bad_worker`, as a wrong IP is; leaf 2's own
    partial, by its port, completes the use with the true sums."""
    assert spine.receive(0, partial(0, MSN, [1, 2], count=1)) == []
    assert spine.receive(1, partial(1, MSN, [3, 4], count=1)) == []
    assert spine.receive(1, partial(2, MSN, [666, 666], count=9, final=1)) == []    # spoofed
    assert spine.receive(3, partial(2, MSN, [666, 666], count=1)) == []             # spoofed
    assert _counters(spine)["drop_bad_worker"] == 2
    out = spine.receive(2, partial(2, MSN, [5, 6], count=1))
    assert sorted(port for port, _ in out) == [0, 1, 2]
    for _, frame in out:
        _, _, imm, lanes = _read(frame)
        assert W.unpack_imm(W.RESULT_IMM, imm)["count"] == 3
        np.testing.assert_array_equal(lanes, [9, 12])
    c = _counters(spine)
    assert (c["drop_bad_worker"], c["finals"], c["completed"], c["contributions"]) == (2, 0, 1, 3)


@pytest.mark.parametrize("seed", range(3))
def test_golden_leaves_sum_exactly_through_an_rtl_spine(small_spine, seed):
    net = Net(leaves=LEAVES, seed=seed, make=with_rtl_spine(small_spine))
    net.set_faults(LinkFaults(drop=0.1, duplicate=0.1, reorder=0.3))
    job = Job(net, uses=3, seed=seed)
    job.run()
    assert job.results >= 3 * 8 * 2 * LEAVES
    assert _counters(small_spine)["completed"] >= 3 * SLOTS


def test_an_rtl_spine_back_after_2_16_messages_elsewhere_takes_the_new_uses(small_spine):
    """The RTL as spine 1 of two (spine 0 and the leaves golden), marked down while the
    leaves run more than 2^16 of the job's messages through spine 0, then marked up: it
    takes its slots' new uses by their whole msns, and every use completes exactly."""
    from netagg.sim.golden_leaf import GoldenLeaf
    from netagg.sim.topology import Role, default_mac

    small_spine.reset()

    def make(uplinks=0, mac=0, **params):
        if mac == default_mac(Role.SPINE, 1):
            return small_spine
        return GoldenLeaf(uplinks=uplinks, mac=mac, **params)

    net = Net(leaves=LEAVES, spines=2, make=make)
    job = Job(net, uses=14, skipped=away_for_2_16())
    completed = away_and_back(net, job)
    assert job.results == 14 * SLOTS * LEAVES * 2
    assert completed == {"before": 2 * 4, "after": 4 * 4}    # its 4 slots, before and after
