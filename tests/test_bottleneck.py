"""The congested link of the priority-drop benchmark (sim.bottleneck), on a clock the test
moves: it queues frames at its rate, drops at the tail what does not fit, and turns only
droppable contributions above their class's threshold into null contributions."""

import random

import numpy as np

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.sim.bottleneck import NULL_BYTES, Bottleneck
from netagg.sim.golden import GoldenSwitch
from tests.switch_traffic import control_frame, job_config_records, make_workers, switch_records


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def setup(capacity=8192, thresholds=None):
    clock = Clock()
    switch = GoldenSwitch()
    link = Bottleneck(switch, rate=1e6, capacity=capacity, clock=clock)
    ws = make_workers(0, 2, 4, random.Random(3))
    records = switch_records() + [(R.WRITE | R.drop_threshold(c), t)
                                  for c, t in (thresholds or {}).items()]
    for frame in (control_frame(records), control_frame(job_config_records(0, ws, 0, 8), 1)):
        link.send(0, frame)
    clock.now += 1.0
    link.advance()
    return clock, switch, link, ws


def contribution(w, slot, droppable=False, cls=0):
    lanes = np.full(256, w.rank + 1, np.int32)
    return w.contribution(slot, 0, 1024 * slot, lanes, slot, msn=slot, droppable=droppable,
                          dscp=W.priority_dscp(cls))


def test_frames_wait_for_the_link_and_then_aggregate():
    clock, switch, link, ws = setup()
    frames = [contribution(w, 0) for w in ws]
    for f in frames:
        link.send(0, f)
    assert link.busy and link.advance() == []          # nothing has crossed the link yet
    clock.now += sum(map(len, frames)) / 1e6 + 1e-9
    out = link.advance()
    assert not link.busy
    assert len(out) == 2                                # the result, to both workers
    pkt = W.parse_frame(out[0][1])
    assert np.all(np.frombuffer(pkt.payload, "<i4") == 3)


def test_tail_drop_when_full_and_priority_drop_of_droppable_only():
    clock, switch, link, ws = setup(capacity=4096, thresholds={0: 1024})
    w = ws[0]
    sent = [contribution(w, s, droppable=s % 2 == 1, cls=0) for s in range(8)]
    for f in sent:
        link.send(0, f)
    # slot 0 goes in (nothing ahead); then droppable ones meet a queue of at least 1 KB and
    # shrink to their headers, the others fill the queue until it is full.
    assert link.stats["nulled"] == 4
    assert link.stats["tail_drops"] == 1
    queued = sum(len(f) for f in sent[0:8:2][:3]) + 4 * NULL_BYTES
    assert abs(link._queued(clock()) - queued) < 1
    clock.now += 1.0
    link.advance()
    c = switch.counters()
    assert c["ports"][0]["drop_priority"] == 4
    assert c["jobs"][0]["contributions"] == 7


def test_never_drop_threshold_keeps_droppable_payloads():
    clock, switch, link, ws = setup(capacity=1 << 20)
    for s in range(8):
        link.send(0, contribution(ws[0], s, droppable=True))
    assert link.stats["nulled"] == 0 and link.stats["tail_drops"] == 0


def test_cross_traffic_takes_room_and_time():
    clock = Clock()
    link = Bottleneck(GoldenSwitch(), rate=1e6, capacity=4096, burst=3000, period=0.01,
                      clock=clock)
    clock.now = 0.0105                                   # the first burst has arrived
    link.send(0, control_frame([(R.REG_MAGIC, 0)]))      # fits beside it
    link.send(0, bytes(2000))                            # does not
    assert link.stats["tail_drops"] == 1
    clock.now = 0.1
    out = link.advance()
    assert len(out) == 1 and W.parse_frame(out[0][1]).opcode == W.OP_CONTROL
