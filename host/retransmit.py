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

Cost: a float pair per estimator, four numbers per packet awaiting its answer.
"""

from __future__ import annotations

import dataclasses


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

    def sent(self, now: float, rtt: RttEstimator, rto_floor: float = 0.0) -> bool:
        """Note a sending at `now`: a first one waits the estimator's RTO (at least
        `rto_floor`), a retry twice the last wait (at most `rto_max`). True for a retry."""
        retry = self.attempts > 0
        if retry:
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
