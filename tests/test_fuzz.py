"""The differential fuzzer (netagg.sim.fuzz): its stream (seeded, every mutation and header field,
the field table against scapy's reading), its comparer (quiet on the golden model against
itself, loud on a faulty switch), the RTL against the golden model on a few thousand frames
(a million in the slow set), `netagg fuzz`; and the differences it found, minimised, as
scapy-built regressions on both switches."""

import collections
import json
import random

import numpy as np
import pytest
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.fuzz import Comparer, main, stream
from netagg.sim.fuzz_mutations import FIELDS, ICRC, Field, get_field, set_field
from netagg.sim.fuzz_traffic import Kind
from netagg.sim.golden import GoldenSwitch
from netagg.sim.scapy_frames import RETH, ImmDt
from tests.switch_traffic import (
    control_frame,
    dissect,
    job_config_records,
    make_workers,
    switch_records,
)

DEFAULT_FRAMES = 3000


class InOrderGolden(GoldenSwitch):
    """The golden model in the RTL's place: a run applies what was sent in the switch's
    commit order (the frame that ends first, then the lower port), as the comparer expects
    of the RTL."""

    width = 64

    def run(self, idle_cycles: int = 0) -> list:
        self._pending = collections.deque(sorted(
            self._pending, key=lambda p: (-(-len(p[1]) // (self.width // 8)), p[0])))
        return super().run()

    def step(self, cycles: int) -> list:
        return []


class WrongSums(InOrderGolden):
    """A switch whose results carry lane 0 plus one."""

    def _results(self, *args):
        out = super()._results(*args)
        return [(port, _plus_one(frame)) for port, frame in out]


def _plus_one(frame: bytes) -> bytes:
    packet = W.parse_frame(frame)
    lanes = np.frombuffer(packet.payload, "<i4").copy()
    lanes[:1] += 1                  # (an array operation: wraps at int32, no warning)
    packet.payload = lanes.tobytes()
    return packet.frame()


# --- the stream --------------------------------------------------------------------------

def test_the_same_seed_gives_the_same_frames():
    first = list(stream(3, 800))
    assert first == list(stream(3, 800)) and len(first) == 800
    assert first != list(stream(4, 800))
    mutated = sum(f.kind.mutated for f in first)
    assert 0.25 * len(first) < mutated < 0.5 * len(first)


def test_every_mutation_and_every_field_is_made():
    frames = list(stream(5, 20_000))
    assert {f.kind for f in frames} == set(Kind) - {Kind.LINK}     # a leaf's (fuzz_leaf)
    fields = {f.note.split("=")[0] for f in frames if f.kind is Kind.FIELD}
    assert {field.name for field in FIELDS} | {ICRC} <= fields


def _scapy_value(frame: bytes, name: str) -> int:
    """A header field of a frame as scapy reads it."""
    header, field = name.split(".")
    pkt = dissect(frame) if header in ("bth", "reth", "va", "imm") else Ether(frame)
    if header == "eth" and field == "ethertype":
        return pkt.type if "type" in pkt.fields else pkt.len   # scapy's 802.3 below 1536
    if header == "eth":
        return int(getattr(pkt, field).replace(":", ""), 16)
    if header == "ip":
        ip = pkt[IP]
        return {"version": ip.version, "ihl": ip.ihl, "dscp": ip.tos >> 2, "ecn": ip.tos & 3,
                "total_length": ip.len, "identification": ip.id, "flags": int(ip.flags),
                "fragment_offset": ip.frag, "ttl": ip.ttl, "protocol": ip.proto,
                "checksum": ip.chksum, "src": W.ip_to_int(ip.src),
                "dst": W.ip_to_int(ip.dst)}[field]
    if header == "udp":
        udp = pkt[UDP]
        return {"src_port": udp.sport, "dst_port": udp.dport, "length": udp.len,
                "checksum": udp.chksum}[field]
    bth = pkt[BTH]
    if header == "bth":
        return getattr(bth, {"se": "solicited", "padcnt": "padcount",
                             "tver": "version"}.get(field, field))
    after = bytes(bth.payload)
    if header == "reth":
        return getattr(RETH(after[:16]), field)
    if header == "va":                      # RETH.va's halves: the MSN, the offset
        return dict(zip(("msn", "offset"), W.split_va(RETH(after[:16]).va)))[field]
    value = W.unpack_imm(W.REQUEST_IMM, ImmDt(after[16:20]).data)[field]
    return value & 0xFF if field == "exponent" else value      # signed: its 8 bits


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_the_field_table_is_where_scapy_reads_the_fields(field: Field):
    """Each field a mutation sets, set to a value of its own, is what scapy reads there."""
    good = next(f.data for f in stream(1, 50) if f.kind is Kind.CONTRIBUTION)
    for value in {1, (1 << field.width) - 2, 0x5A5A5A5A5A5A5A5A & ((1 << field.width) - 1)}:
        buf = bytearray(good)
        set_field(buf, field, value)
        assert get_field(bytes(buf), field) == value
        assert _scapy_value(bytes(buf), field.name) == value
        assert buf[:field.bit // 8] == good[:field.bit // 8]   # nothing before it moved


# --- the comparer --------------------------------------------------------------------------

def test_the_golden_model_against_itself_has_no_differences():
    golden = GoldenSwitch()
    s = Comparer(InOrderGolden(), golden, seed=2).run(stream(2, DEFAULT_FRAMES))
    assert (s.differences, s.wrong_sums, s.details) == (0, 0, [])
    assert s.frames == DEFAULT_FRAMES and s.results > 200 and s.counters > 3000
    jobs = collections.Counter()
    for counters in golden.job_counters:
        jobs.update(counters)
    assert jobs["completed"] > 200 and jobs["replays"] > 20 and jobs["duplicates"] > 5
    json.dumps(s.json())


def test_good_traffic_alone_completes_and_sums_right():
    s = Comparer(InOrderGolden(), GoldenSwitch()).run(stream(4, 1000, mutation_rate=0))
    assert s.mutated == 0 and s.results > 200 and s.differences + s.wrong_sums == 0


def test_a_wrong_sum_is_reported_with_its_frame():
    frames = list(stream(6, 400))
    s = Comparer(WrongSums(), GoldenSwitch()).run(frames)
    assert s.wrong_sums > 0 and s.differences > 0
    wrong = next(d for d in s.details if d.kind.value == "wrong sum")
    assert "rtl result" in wrong.note
    assert bytes.fromhex(wrong.input) == frames[wrong.index].data
    assert wrong.rtl != wrong.golden and W.parse_frame(bytes.fromhex(wrong.golden))
    assert "wrong sums" in s.text()


def test_a_missing_frame_and_a_counter_are_differences():
    class Deaf(InOrderGolden):
        """Drops every third good contribution of job 0 unseen."""

        seen = 0

        def receive(self, port, frame, fill=0, null=None):
            if len(frame) > 74 and frame[W.BTH_OFFSET] == W.OP_CONTRIBUTION \
                    and frame[70] >> 4 == 0:
                self.seen += 1
                if self.seen % 3 == 0:
                    return []
            return super().receive(port, frame, fill, null)

    s = Comparer(Deaf(), GoldenSwitch()).run(stream(11, 600))
    kinds = {d.kind.value for d in s.details}
    assert s.differences > 0 and {"output", "register"} <= kinds


# --- the RTL against the golden model ----------------------------------------------------

def test_rtl_equals_golden_on_fuzzed_frames(rtl_model):
    rtl_model.reset()
    s = Comparer(rtl_model, GoldenSwitch(), seed=11).run(stream(11, DEFAULT_FRAMES))
    assert s.differences == 0 and s.wrong_sums == 0, s.text()
    assert s.frames == DEFAULT_FRAMES and s.results > 200 and s.counters > 3000


@pytest.mark.slow
def test_rtl_equals_golden_on_a_million_fuzzed_frames(rtl_model):
    rtl_model.reset()
    s = Comparer(rtl_model, GoldenSwitch(), seed=12).run(stream(12, 1_000_000))
    assert s.differences == 0 and s.wrong_sums == 0, s.text()
    assert s.frames == 1_000_000


def test_rtl_fuzz_command(capsys):
    assert main(300, 1, as_json=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["frames"] == 300 and report["differences"] == 0 and report["counters"] > 0


# --- the differences found, as regressions on both switches ------------------------------



def exchange(switch, sends) -> list:
    """Frames in ((port, frame) pairs, sent together), the frames out."""
    for port, frame in sends:
        switch.send(port, frame)
    if isinstance(switch, GoldenSwitch):
        return switch.run()
    out = switch.run(idle_cycles=600)
    while switch.busy:
        out += switch.run(idle_cycles=600)
    return out


def job_counters(switch, job: int) -> dict:
    [(_, reply)] = exchange(switch, [(0, control_frame(
        [(R.job_counter(job, n), 0) for n in R.JOB_COUNTERS]
        + [(R.job_reg(job, R.JOB_COMPLETED), 0)]))])
    values = [v for _, v in W.unpack_records(bytes(dissect(reply)[BTH].payload))]
    return dict(zip([*R.JOB_COUNTERS, "COMPLETED"], values))


def configure(switch, jobs) -> dict:
    """Jobs of (job, workers, slot base, slot count, credits), configured as the tests of
    the golden model do; their workers."""
    rng = random.Random(0)
    exchange(switch, [(0, control_frame(switch_records()))])
    workers = {}
    for job, n, base, count, credits in jobs:
        workers[job] = make_workers(job, n, 4, rng, slot_count=count)
        exchange(switch, [(0, control_frame(job_config_records(job, workers[job], base, count,
                                                                credits)))])
    return workers


def lanes_of(frame: bytes) -> np.ndarray:
    return np.frombuffer(bytes(dissect(frame)[BTH].payload)[20:], "<i4")


def test_a_replay_of_another_length_is_dropped(switch):
    """A contribution to a completed use whose length is not the use's: the RTL sent the
    sums' rows its own payload's beats covered (a part of the sums, or rows beyond them)
    under its own length; now both switches drop it as `drop_bad_length`."""
    [w] = configure(switch, [(0, 1, 0, 1, 0)])[0]
    values = np.arange(1, 9, dtype=np.int32)
    [(_, result)] = exchange(switch, [(1, w.contribution(0, 0, 0, values, 1, msn=0))])
    for other in (values[:2], np.arange(12, dtype=np.int32)):
        assert exchange(switch, [(1, w.contribution(0, 0, 0, other, 2, msn=0))]) == []
    [(_, again)] = exchange(switch, [(1, w.contribution(0, 0, 0, values, 3, msn=0))])
    assert lanes_of(again).tolist() == lanes_of(result).tolist() == values.tolist()
    c = job_counters(switch, 0)
    assert (c["drop_bad_length"], c["replays"], c["results"]) == (2, 1, 2)


def test_back_to_back_completions_move_the_credit_limit(switch):
    """Two uses of a job with one credit, committed in consecutive cycles (the same length
    on ports 0 and 1): the second is within the limit the first's completion moves. The
    RTL's lookup read COMPLETED before the completion ahead of it counted, and dropped the
    second as beyond the credit."""
    [w] = configure(switch, [(2, 1, 0, 1, 1)])[2]
    lanes = np.arange(16, dtype=np.int32)
    assert len(exchange(switch, [(0, w.contribution(0, 0, 0, lanes, 1, msn=0))])) == 1
    out = exchange(switch, [(0, w.contribution(0, 1, 0, lanes, 2, msn=1)),
                            (1, w.contribution(0, 0, 0, lanes + 1, 3, msn=2))])
    assert [dissect(f)[BTH].psn for _, f in out] == [3, 4]      # COMPLETED + CREDITS
    c = job_counters(switch, 2)
    assert (c["completed"], c["drop_credit"], c["COMPLETED"]) == (3, 0, 3)


def test_a_config_write_clears_the_slot_range_the_request_leaves(switch):
    """A request that disables jobs 0 and 1, moves job 1's slot range from 0..3 to 1..4 and
    enables it again clears the slots of the range it leaves job 1 with, as the gateware
    clears them after the request (the model cleared the range CONFIG was written over):
    the use job 0 had begun in slot 4 is gone, and job 1's worker begins a use of its slot 3
    there instead of being dropped as stale. Job 0, disabled at the request's end, has its
    slots left alone (an enabled job's range may overlap a disabled one's)."""
    workers = configure(switch, [(0, 2, 4, 1, 0), (1, 1, 0, 4, 0)])
    a, _ = workers[0]
    [c] = workers[1]
    exchange(switch, [(0, a.contribution(0, 0, 0, np.full(4, 5, np.int32), 1, msn=0))])
    exchange(switch, [(0, control_frame([
        (R.WRITE | R.job_reg(0, R.JOB_CONFIG), 0),
        (R.WRITE | R.job_reg(1, R.JOB_CONFIG), 0),
        (R.WRITE | R.job_reg(1, R.JOB_SLOT_BASE), 1),
        (R.WRITE | R.job_reg(1, R.JOB_CONFIG), R.CONFIG.pack(enable=1, workers=1))]))])
    out = exchange(switch, [(0, c.contribution(3, 0, 0, np.full(4, 1, np.int32), 1, msn=3))])
    assert [lanes_of(f).tolist() for _, f in out] == [[1] * 4]
    assert job_counters(switch, 1)["drop_stale"] == 0
