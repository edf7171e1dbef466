"""cocotb testbench of the whole switch (sim.tops.SwitchTop): scapy frames from N workers on
every port, compared frame for frame with the golden model, sums with numpy.

The golden model applies the good frames in the order the switch committed them (the
``committed{i}`` strobes; the k-th commit of a port is its k-th good frame; ``nulled{i}``
says the switch dropped its payload by priority) and frames the parser rejects anywhere
(they only count); the frames each port sends must equal the model's, byte for byte, in
order. The driver (`SwitchTB`) and the line-rate testcase are the benchmark's
(netagg/sim/bench_switch.py).
"""

from __future__ import annotations

import random

import cocotb
import numpy as np

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim import golden as G
from netagg.sim.bench_switch import PARAMS, PORTS, WIDTH, SwitchTB
from tests.frames import scapy_frame
from tests.switch_traffic import (
    HOST_IP,
    SWITCH,
    check_results,
    control_frame,
    job_config_records,
    scenario,
)


def golden_switch() -> G.GoldenSwitch:
    return G.GoldenSwitch(
        ports=PORTS, jobs=PARAMS.get("jobs", 4), max_workers=PARAMS.get("max_workers", 8),
        slots=PARAMS.get("slots", 64), width=WIDTH,
        queue_capacity=PARAMS.get("queue_capacity", 4096))


def accepted(model: G.GoldenSwitch, frame: bytes) -> bool:
    """Whether the switch's ingress commits this frame (it is then applied in commit order)."""
    verdict, info = G.parse(frame)
    return verdict == G.OK and info[2] <= model.queue_capacity


class Golden:
    """The model, fed in commit order: the k-th commit of a port is its k-th good frame;
    frames the ingress rejects are applied as they are sent (they only count)."""

    def __init__(self):
        self.model = golden_switch()
        self.sent = [0] * PORTS          # frames of each port looked at
        self.good = [[] for _ in range(PORTS)]
        self.commits = 0
        self.expected = [[] for _ in range(PORTS)]
        self.applied = []                # (port, frame, nulled) in commit order

    def catch_up(self, tb: SwitchTB):
        for p in range(PORTS):
            for f in tb.sent[p][self.sent[p]:]:
                if accepted(self.model, f):
                    self.good[p].append(f)
                else:
                    assert self.model.receive(p, f) == []
            self.sent[p] = len(tb.sent[p])
        for _, p, nulled in tb.commits[self.commits:]:
            frame = self.good[p].pop(0)
            self.applied.append((p, frame, nulled))
            for port, out in self.model.receive(p, frame, null=nulled):
                self.expected[port].append(out)
        self.commits = len(tb.commits)


async def run_scenario(dut, seed, idle=0.0, backpressure=0.0, **kwargs):
    tb = SwitchTB(dut, seed=seed, idle=idle, backpressure=backpressure)
    await tb.reset()
    rng = random.Random(seed)
    sc = scenario(rng, ports=PORTS, **kwargs)
    model = Golden()
    for f in sc.config:
        tb.send(0, f)
    await tb.drain()
    model.catch_up(tb)
    outputs = []
    for rnd, batch in enumerate(sc.rounds):
        before = [len(r) for r in tb.received]
        for port, frame in batch:
            tb.send(port, frame)
        await tb.drain()
        model.catch_up(tb)
        outputs += [(rnd, p, f) for p in range(PORTS) for f in tb.received[p][before[p]:]]
    # Counters: control requests reading them all, answered alike by both.
    reads = counter_reads()
    for i in range(0, len(reads), W.MAX_CONTROL_RECORDS):
        chunk = reads[i:i + W.MAX_CONTROL_RECORDS]
        tb.send(1, control_frame([(a, 0) for _, a in chunk], psn=100 + i))
    await tb.drain()
    model.catch_up(tb)
    log_counter_differences(dut, tb, model, reads)
    assert_same(dut, tb, model)
    results = [o for o in outputs if W.parse_frame(o[2]).opcode == W.OP_RESULT]
    check_results(sc, results)
    counters = model.model.counters()
    dut._log.info("counters %s", counters)
    return tb, model, sc


def counter_reads():
    """(name, address) of every port counter and of the counters of jobs 0 and 1."""
    return ([(f"port{p}.{n}", R.port_counter(p, n)) for p in range(PORTS)
             for n in R.PORT_COUNTERS]
            + [(f"job{j}.{n}", R.job_counter(j, n)) for j in range(2) for n in R.JOB_COUNTERS])


def assert_same(dut, tb, model):
    """Every port sent the model's frames, in the model's order."""
    for p in range(PORTS):
        got_frames, want_frames = tb.received[p], model.expected[p]
        for k, (got, want) in enumerate(zip(got_frames, want_frames)):
            if got != want:
                dut._log.error("port %d frame %d:\n switch %s\n model  %s", p, k, got.hex(),
                               want.hex())
            assert got == want, f"port {p} frame {k} differs from the model's"
        if len(got_frames) < len(want_frames):
            dut._log.error("port %d: the model's frames the switch did not send: %s", p,
                           [f[:60].hex() for f in want_frames[len(got_frames):]])
        assert len(got_frames) == len(want_frames), (
            f"port {p}: {len(got_frames)} frames out, the model sends {len(want_frames)}")


def log_counter_differences(dut, tb, model, reads):
    """Log the counters where the switch's last control replies on port 1 and the model's
    differ (the switch's view of what happened to the packets)."""
    def values(frames):
        out = []
        for f in frames:
            try:
                pkt = W.parse_frame(f)
            except W.WireError as e:
                dut._log.error("frame out is not a good packet (%s): %s", e, f.hex())
                continue
            if pkt.opcode == W.OP_CONTROL:
                out += [v for _, v in W.unpack_records(pkt.payload)]
        return out[-len(reads):]
    got, want = values(tb.received[1]), values(model.expected[1])
    for (name, _), g, w in zip(reads, got, want):
        if g != w:
            dut._log.error("counter %s: switch %d, model %d", name, g, w)


@cocotb.test()
async def control_path(dut):
    """Configuration, then register reads of every size on every port, answered as the
    model answers."""
    tb = SwitchTB(dut, seed=4)
    await tb.reset()
    sc = scenario(random.Random(4), ports=PORTS, jobs=2, workers=2, slots=2, rounds=0)
    model = Golden()
    for f in sc.config:
        tb.send(0, f)
    addresses = [R.REG_MAGIC, R.REG_PARAMS, R.REG_SLOTS, R.REG_IP, R.REG_PORT,
                 R.job_reg(1, R.JOB_CONFIG), R.beat_reg(1, 1)]
    addresses += [R.port_counter(p, n) for p in range(PORTS) for n in R.PORT_COUNTERS]
    for n, count in enumerate((1, 5, 8, 64, 63)):
        port = n % PORTS
        tb.send(port, control_frame([(a, 0) for a in (addresses * 2)[:count]], psn=n,
                                    sport=0xD000 + port))
    # Heartbeats: a rank's own, from the address its entry holds, written and read back in
    # one request; another address's write, and one to a rank without an entry, refused
    # (control_denied), beside ranks and jobs the switch has not.
    tb.send(3, control_frame([(R.WRITE | R.beat_reg(1, 1), 0xBEA70001), (R.beat_reg(1, 1), 0)],
                             psn=20, src_ip=sc.workers[1][1].ip, sport=0xD003))
    tb.send(3, control_frame([(R.WRITE | R.beat_reg(1, 1), 5), (R.beat_reg(1, 1), 0),
                              (R.WRITE | R.beat_reg(0, 3), 7), (R.beat_reg(0, 0), 0),
                              (R.WRITE | R.beat_reg(0, 4), 9), (R.beat_reg(2, 0), 0),
                              (R.beat_reg(0, 3), 0)], psn=21, sport=0xD003))
    # A request the switch does not serve (12 bytes: not whole records) gets no reply, and
    # the port's next request is answered all the same.
    tb.send(1, scapy_frame(W.OP_CONTROL, W.CONTROL_QPN, 9, bytes(12),
                           W.Endpoint(HOST_IP, 0xD001, 0x02BB00000009), SWITCH))
    tb.send(1, control_frame([(R.port_counter(1, "drop_bad_payload"), 0)], psn=10,
                             sport=0xD001))
    await tb.drain()
    model.catch_up(tb)
    assert_same(dut, tb, model)
    # The model answers what the switch committed; the last request must have been too.
    assert [W.parse_frame(f).psn for f in tb.received[1]] == [1, 10]
    own, others = (W.unpack_records(W.parse_frame(f).payload) for f in tb.received[3][-2:])
    assert [v for _, v in own] == [0xBEA70001, 0xBEA70001]
    assert [v for _, v in others] == [0xBEA70001, 0xBEA70001, 0, 0, 0, 0, 0]


@cocotb.test()
async def aggregate_scenario(dut):
    """Two jobs of three workers, three rounds, duplicates, malformed frames and copies
    with another key than their job's, back to back on every port."""
    await run_scenario(dut, seed=1, jobs=2, workers=3, slots=6, rounds=3, max_lanes=64,
                       bad_keys=0.1)


@cocotb.test()
async def aggregate_idle_backpressure(dut):
    """The same with idle cycles on the sources and backpressure on the sinks."""
    await run_scenario(dut, seed=2, idle=0.3, backpressure=0.3, jobs=2, workers=2, slots=4,
                       rounds=3, max_lanes=256)


@cocotb.test()
async def egress_pressure(dut):
    """Full-size payloads back to back into sinks that take one beat in four: the egress
    rings fill, a result that goes to several ports waits for all of them, and the ingress
    queues push back."""
    await run_scenario(dut, seed=5, backpressure=0.75, jobs=1, workers=PORTS, slots=12,
                       rounds=2, max_lanes=256, duplicates=0.05, malformed=0)


@cocotb.test()
async def saturation(dut):
    """Sums that saturate carry the overflow flag; others stay exact."""
    _, model, _ = await run_scenario(dut, seed=3, jobs=1, workers=2, slots=4, rounds=2,
                                     saturate=True, duplicates=0, malformed=0)
    assert model.model.job_counters[0]["overflows"] > 0


# --- issue 5: priority drop, credits, spraying ------------------------------------------------

async def configured(dut, seed, *, slots, records=(), results_port=None, **tb_options):
    """A switch with one job of one worker per port (or all on `results_port`), `slots`
    slots, and `records` written after the job's configuration; the testbench, its model
    and the workers."""
    tb = SwitchTB(dut, seed=seed, **tb_options)
    await tb.reset()
    sc = scenario(random.Random(seed), ports=PORTS, jobs=1, workers=PORTS, slots=slots,
                  rounds=0)
    ws = sc.workers[0]
    config = sc.config
    if results_port is not None:
        for w in ws:
            w.port = results_port
        config = [sc.config[0], control_frame(job_config_records(0, ws, 0, slots), psn=1)]
    model = Golden()
    for f in config:
        tb.send(0, f)
    if records:
        tb.send(0, control_frame([(R.WRITE | a, v) for a, v in records], psn=50))
    await tb.drain()
    model.catch_up(tb)
    return tb, model, ws


def results_of(frames, qpn=None):
    """(result packet, its ResultImm fields) of every result among `frames`."""
    out = []
    for f in frames:
        pkt = W.parse_frame(f)
        if pkt.opcode == W.OP_RESULT and (qpn is None or pkt.dqpn == qpn):
            out.append((pkt, W.unpack_imm(W.RESULT_IMM, pkt.imm)))
    return out


async def read_counters(tb, model, names):
    """The switch's port-0 and job-0 counters `names` (read by a control request on port 1),
    after checking they equal the model's."""
    addresses = [R.port_counter(0, n) if n in R.PORT_COUNTERS else R.job_counter(0, n)
                 for n in names]
    before = len(tb.received[1])
    tb.send(1, control_frame([(a, 0) for a in addresses], psn=0x777))
    await tb.drain()
    model.catch_up(tb)
    reply = [W.parse_frame(f) for f in tb.received[1][before:]]
    values = [v for pkt in reply if pkt.opcode == W.OP_CONTROL
              for _, v in W.unpack_records(pkt.payload)]
    assert len(values) == len(names)
    return dict(zip(names, values))


@cocotb.test()
async def priority_drop(dut):
    """An oversubscribed ingress: every worker's contributions enter port 0 back to back and
    every result leaves port 1, whose sink takes one beat in four, so port 0's queue fills.
    A quarter of the contributions (the loss budget) are droppable, of class 0 or 1
    (thresholds 512 and 2048 bytes); the rest, of any class, are not. Only droppable ones may
    lose their payload, class 0 at least as often as class 1; each result's count and sums
    are those of the contributions that kept theirs; the switch equals the model frame for
    frame."""
    slots, rounds, budget = 8, 4, 0.25
    thresholds = {0: 512, 1: 2048}
    tb, model, ws = await configured(
        dut, 11, slots=slots, backpressure=0.75, results_port=1,
        records=[(R.drop_threshold(c), t) for c, t in thresholds.items()])
    rng = random.Random(11)
    sent = {}                    # frame -> (round, slot, lanes, droppable, class)
    per_round = []
    for rnd in range(rounds):
        batch = []
        marked = set(rng.sample(range(slots * PORTS), int(budget * slots * PORTS)))
        for s in range(slots):
            for w in ws:
                lanes = np.array([rng.randrange(-1 << 20, 1 << 20) for _ in range(256)],
                                 np.int32)
                droppable = s * PORTS + w.rank in marked
                cls = rng.randrange(2) if droppable else rng.randrange(8)
                f = w.contribution(s, rnd % 2, 1024 * s, lanes, rnd, msn=rnd * slots + s,
                                   droppable=droppable, dscp=W.priority_dscp(cls))
                sent[f] = (rnd, s, lanes, droppable, cls)
                batch.append(f)
        before = [len(r) for r in tb.received]
        for f in batch:
            tb.send(0, f)
        await tb.drain()
        model.catch_up(tb)
        per_round.append([f for p in range(PORTS) for f in tb.received[p][before[p]:]])
    nulled = [f for p, f, n in model.applied if n]
    assert nulled, "port 0's queue never reached a threshold"
    assert all(sent[f][3] for f in nulled), "a contribution not marked droppable was dropped"
    assert len(nulled) <= budget * len(sent)
    marked = {c: sum(1 for v in sent.values() if v[3] and v[4] == c) for c in thresholds}
    dropped = {c: sum(1 for f in nulled if sent[f][4] == c) for c in thresholds}
    dut._log.info("contributions %d, droppable by class %s, dropped by class %s",
                  len(sent), marked, dropped)
    assert dropped[0] / marked[0] >= dropped[1] / marked[1]
    nulled_set = set(nulled)
    for rnd, frames in enumerate(per_round):
        results = results_of(frames)
        assert len(results) == slots * PORTS
        for pkt, imm in results:
            kept = [v[2] for f, v in sent.items()
                    if v[0] == rnd and v[1] == imm["slot"] and f not in nulled_set]
            assert imm["count"] == len(kept)
            want = sum(k.astype(np.int64) for k in kept) if kept else np.zeros(256, np.int64)
            assert np.array_equal(np.frombuffer(pkt.payload, "<i4"), want)
    counts = await read_counters(tb, model, ["drop_priority", "contributions", "completed"])
    assert counts["drop_priority"] == len(nulled)
    assert counts["contributions"] == len(sent)
    assert counts["completed"] == rounds * slots
    assert_same(dut, tb, model)


@cocotb.test()
async def credits_saturation(dut):
    """Credits of 3 uses per worker. Worker 0 first sends all 8 slots' messages alone: only
    3 are taken, the rest are dropped and counted. Then every worker runs as a host does,
    back to back on every port: it sends a message only below the credit limit the results
    carry, and sends again what went unanswered. Every use completes with exact sums, no
    message is dropped for credit any more, and no more than 3 uses are ever open."""
    slots, credits, uses = 8, 3, 24
    tb, model, ws = await configured(dut, 12, slots=slots, records=[
        (R.job_reg(0, R.JOB_CREDITS), credits)])
    rng = random.Random(12)
    lanes = {(w.rank, msn): np.array([rng.randrange(-1 << 20, 1 << 20) for _ in range(256)],
                                     np.int32) for w in ws for msn in range(uses)}

    def frame(w, msn):
        return w.contribution(msn % slots, (msn // slots) % 2, 1024 * (msn % slots),
                              lanes[w.rank, msn], msn, msn=msn)

    open_uses = []
    original = model.model.receive

    def receive(*args, **kwargs):
        out = original(*args, **kwargs)
        open_uses.append(sum(c.count != 0 for copies in model.model.state for c in copies))
        return out
    model.model.receive = receive

    for msn in range(slots):
        tb.send(ws[0].port, frame(ws[0], msn))
    await tb.drain()
    model.catch_up(tb)
    first = await read_counters(tb, model, ["drop_credit", "contributions"])
    assert first == {"drop_credit": slots - credits, "contributions": credits}

    limit = {w.rank: credits for w in ws}
    answered = {w.rank: set() for w in ws}
    next_msn = {w.rank: 0 for w in ws}
    seen = [0] * PORTS
    for _ in range(200):
        if all(len(answered[w.rank]) == uses for w in ws):
            break
        for w in ws:
            # What went unanswered, then new messages, all below the credit limit.
            pending = [m for m in range(next_msn[w.rank]) if m not in answered[w.rank]]
            while next_msn[w.rank] < min(uses, limit[w.rank]):
                pending.append(next_msn[w.rank])
                next_msn[w.rank] += 1
            for msn in pending:
                assert msn < limit[w.rank]
                tb.send(w.port, frame(w, msn))
        await tb.drain(quiet=300)
        model.catch_up(tb)
        for w in ws:
            frames = tb.received[w.port][seen[w.port]:]
            for pkt, imm in results_of(frames, qpn=w.qpn):
                limit[w.rank] = max(limit[w.rank], W.unwrap(pkt.psn, limit[w.rank]))
                # The message this answers: the open one of its slot and version, or (a
                # result sent again for a message sent twice) the last answered one.
                same = [m for m in range(next_msn[w.rank]) if m % slots == imm["slot"]
                        and (m // slots) % 2 == imm["version"]]
                base = ([m for m in same if m not in answered[w.rank]] or same[-1:])[0]
                want = sum(lanes[v.rank, base].astype(np.int64) for v in ws)
                assert imm["count"] == PORTS
                assert np.array_equal(np.frombuffer(pkt.payload, "<i4"), want)
                answered[w.rank].add(base)
        for w in ws:
            seen[w.port] = len(tb.received[w.port])
    assert all(len(answered[w.rank]) == uses for w in ws), "the job did not complete"
    final = await read_counters(tb, model, ["drop_credit", "completed"])
    assert final == {"drop_credit": slots - credits, "completed": uses}
    assert max(open_uses) <= credits
    dut._log.info("open uses at most %d of %d credits; limits %s", max(open_uses), credits,
                  limit)
    assert_same(dut, tb, model)


@cocotb.test()
async def sprayed_reordered(dut):
    """The same contributions twice: first each on its worker's own port in order, then each
    on a random port, shuffled, some twice. Both uses give the same sums, bit for bit; the
    second costs only counted duplicates."""
    slots = 8
    tb, model, ws = await configured(dut, 13, slots=slots)
    rng = random.Random(13)
    lanes = {(w.rank, s): np.array([rng.randrange(-1 << 28, 1 << 28) for _ in range(200)],
                                   np.int32) for w in ws for s in range(slots)}
    outputs, duplicates = [], 0
    for rnd in range(2):
        batch = [(w.port, w.contribution(s, rnd, 1024 * s, lanes[w.rank, s], rnd,
                                         msn=rnd * slots + s)) for s in range(slots) for w in ws]
        if rnd:
            extra = rng.sample(batch, 6)
            batch = [(rng.randrange(PORTS), f) for _, f in batch + extra]
            duplicates = len(extra)
            rng.shuffle(batch)
        before = [len(r) for r in tb.received]
        for port, f in batch:
            tb.send(port, f)
        await tb.drain()
        model.catch_up(tb)
        outputs.append({(imm["slot"], pkt.dqpn): pkt.payload for p in range(PORTS)
                        for pkt, imm in results_of(tb.received[p][before[p]:])})
    assert len(outputs[0]) == slots * PORTS
    assert outputs[0] == outputs[1]
    for (s, _), payload in outputs[0].items():
        want = sum(lanes[w.rank, s].astype(np.int64) for w in ws)
        assert np.array_equal(np.frombuffer(payload, "<i4"), want)
    counts = await read_counters(tb, model, ["duplicates", "replays", "drop_stale"])
    assert counts["duplicates"] + counts["replays"] == duplicates
    assert counts["drop_stale"] == 0
    assert_same(dut, tb, model)


@cocotb.test()
async def early_close(dut):
    """A quorum of 3 of 4 workers: each use closes at its third contribution, with the count
    and sums of those three; the fourth, late, gets the same result sent again, to it
    alone; no use mixes into the next."""
    slots, rounds = 8, 3
    tb, model, ws = await configured(dut, 14, slots=slots,
                                     records=[(R.job_reg(0, R.JOB_QUORUM), 3)])
    rng = random.Random(14)
    for rnd in range(rounds):
        lanes = {(w.rank, s): np.array([rng.randrange(-1 << 24, 1 << 24) for _ in range(64)],
                                       np.int32) for w in ws for s in range(slots)}
        late = {s: rng.choice(ws) for s in range(slots)}
        before = [len(r) for r in tb.received]
        for phase in ("quorum", "late"):
            batch = [(w.port, w.contribution(s, rnd % 2, 256 * s, lanes[w.rank, s], rnd,
                                             msn=rnd * slots + s))
                     for s in range(slots) for w in ws if (late[s] is w) == (phase == "late")]
            rng.shuffle(batch)
            for port, f in batch:
                tb.send(port, f)
            await tb.drain()
            model.catch_up(tb)
        results = [(pkt, imm) for p in range(PORTS)
                   for pkt, imm in results_of(tb.received[p][before[p]:])]
        assert len(results) == slots * (PORTS + 1)      # every worker, then the late one
        for pkt, imm in results:
            s = imm["slot"]
            want = sum(lanes[w.rank, s].astype(np.int64) for w in ws if w is not late[s])
            assert imm["count"] == 3
            assert np.array_equal(np.frombuffer(pkt.payload, "<i4"), want)
    counts = await read_counters(tb, model, ["completed", "replays", "drop_stale"])
    assert counts == {"completed": rounds * slots, "replays": rounds * slots, "drop_stale": 0}
    assert_same(dut, tb, model)
