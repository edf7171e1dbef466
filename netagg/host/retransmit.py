"""Retransmission timers and the round-trip estimate they start from.

A packet without its answer after its retransmission timeout (RTO) is sent again, its
timeout doubled per retry up to `rto_max`. A first sending's timeout is the estimator's RTO:
`rto_initial` until a round trip is measured, then the smoothed round trip plus the larger of
four times its mean deviation and `rto_min` (gains 1/8 and 1/4; RFC 6298's form, with
`rto_min` where it has the clock granularity, as Linux does), at most `rto_max`. The margin
on top of the round trip matters where a full window queues at the switch: round trips then
change slowly and their deviation stays small, and a timeout near the mean itself sent
half the packets again. Only a packet answered after its first sending is measured: the
answer to a retransmitted one may be the first copy's (Karn's rule).

A packet is also sent again before its timeout when a packet sent after it was answered
(`RecentAnswer`: time-based loss detection, RACK's rule, RFC 8985): a packet last sent more
than a reordering window (a quarter of the smoothed round trip, RACK's) before the latest
sending that got its answer is taken as lost. That sending is not a timeout: its wait is
not doubled. With many packets in flight, a loss then costs about one round trip and the
window, not a timeout. Packets sprayed over paths of different lengths (a worker's source
ports, a fabric's spines) come back out of order by design: there the rule is off
(`RecentAnswer.sprayed`). Where no later packet can be answered (the tail of the packets in
flight, or a window whose uses all wait for a lost packet or for one a lost packet carries:
nothing answered and nothing sent for a probe timeout, two smoothed round trips), every
packet in flight is sent again, its wait not doubled (RACK's tail loss probe, once until
the next answer; all of them, since a use waits for every rank's packet and no rank knows
whose was lost). While the rule finds no loss, a probe never comes before the shortest
timeout would (`rto_min`), so a rank that waits for a slower one, or a paused machine,
costs no more than the timeouts did; for `LOSS_MEMORY` after it found one, a silence is
most likely another loss, and the probe comes after at least `PROBE_MIN`. The doubling
timeouts are left to what a probe does not recover, and to a path that answers nothing.

Cost: a float pair per estimator, four numbers per packet awaiting its answer, four for
the detector.
"""

from __future__ import annotations

import dataclasses
import enum
import math

REORDER_SHARE = 0.25    # the reordering window, a share of the smoothed round trip (RACK's)
PROBE_MIN = 0.01        # seconds: the shortest probe timeout, while losses are being found
LOSS_MEMORY = 1.0       # seconds a found loss keeps the probe timeout short


class Recovery(enum.Enum):
    """How a worker finds its lost packets: by `RecentAnswer`'s rules and the timeouts
    (EARLY, the default), or by the timeouts alone (TIMERS, to measure the rules against)."""
    EARLY = "early"
    TIMERS = "timers"


@dataclasses.dataclass
class RttEstimator:
    """The smoothed round trip (`srtt`, None before the first sample), its mean deviation
    (`rttvar`) and the retransmission timeout they give (`rto`)."""

    rto: float = 0.2
    rto_min: float = 0.05
    rto_max: float = 1.0
    srtt: float | None = None
    rttvar: float = 0.0

    def sample(self, rtt: float):
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.rto = min(self.rto_max, self.srtt + max(self.rto_min, 4 * self.rttvar))

    def answered(self, timer: RetransmitTimer, now: float):
        """A packet's answer arrived at `now`: its round trip is a sample if it was sent
        once."""
        if timer.attempts == 1:
            self.sample(now - timer.sent_at)


@dataclasses.dataclass
class RetransmitTimer:
    """When a packet awaiting its answer is due again: `deadline`, after `rto` seconds from
    its last sending; `attempts` counts its sendings, `sent_at` is the first, `last_at` the
    last."""

    sent_at: float = 0.0
    deadline: float = 0.0
    rto: float = 0.0
    attempts: int = 0
    last_at: float = 0.0

    def sent(self, now: float, rtt: RttEstimator, rto_floor: float = 0.0,
             lost: bool = False) -> bool:
        """Note a sending at `now`: a first one waits the estimator's RTO (at least
        `rto_floor`), a retry after a timeout twice the last wait (at most `rto_max`), a
        retry of a packet `lost` by `RecentAnswer` the last wait again. True for a
        retry."""
        retry = self.attempts > 0
        if retry and not lost:
            self.rto = min(rtt.rto_max, self.rto * 2)
        else:
            self.sent_at = now
            self.rto = max(rtt.rto, rto_floor)
        self.attempts += 1
        self.last_at = now
        self.deadline = now + self.rto
        return retry

    def due(self, now: float) -> bool:
        return self.deadline <= now



@dataclasses.dataclass
class RecentAnswer:
    """What the answers show of the packets in flight: the latest sending that got its
    answer (`newest`) shows lost those last sent more than the reordering window before it;
    and when no answer has come (`heard`) nor a packet left for a probe timeout, the packets
    in flight are probed, once until the next answer (`probed`). Times: monotonic seconds."""

    newest: float = -math.inf
    heard: float = -math.inf
    lost_at: float = -math.inf  # when the rule last found a packet lost
    probed: bool = False
    sprayed: bool = False       # several paths (ports, spines): no packet is taken as lost
    off: bool = False           # `Recovery.TIMERS`: nothing is lost, nothing probed

    def answered(self, last_sent: float, now: float) -> bool:
        """A packet last sent at `last_sent` got its answer at `now`: whether that sending is
        the latest answered."""
        self.heard, self.probed = now, False
        if last_sent <= self.newest:
            return False
        self.newest = last_sent
        return True

    def horizon(self, rtt: RttEstimator) -> float:
        """A packet in flight last sent before this is lost."""
        if rtt.srtt is None or self.sprayed or self.off:
            return -math.inf
        return self.newest - REORDER_SHARE * rtt.srtt

    def found(self, now: float):
        """The rule found a packet lost at `now`."""
        self.lost_at = now

    def lossy(self, now: float) -> bool:
        """Whether the rule found a loss within `LOSS_MEMORY` before `now`."""
        return now - self.lost_at < LOSS_MEMORY

    def probe_at(self, rtt: RttEstimator, last_sent: float) -> float:
        """When the packets in flight, the latest of them sent at `last_sent`, are probed:
        a probe timeout after that or the last answer, whichever is later (never before a
        round trip is measured, nor twice without an answer between)."""
        if self.probed or rtt.srtt is None or self.off:
            return math.inf
        at = max(self.heard, last_sent)
        return at + probe_timeout(rtt, self.lossy(at))


def probe_timeout(rtt: RttEstimator, lossy: bool) -> float:
    """RACK-TLP's probe timeout: two smoothed round trips, at least `PROBE_MIN` where
    losses are being found (`lossy`) and the shortest timeout where none is."""
    return max(PROBE_MIN if lossy else rtt.rto_min, 2 * rtt.srtt)
