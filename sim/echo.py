"""The echo switch: a measurement switch that answers each contribution at once.

`EchoSwitch` is the golden model (`sim.golden.GoldenSwitch`) but for where a contribution
goes: every rank has its own copy of each slot version, and a contribution completes a use
of it by itself, so it is answered at once, to its sender alone, with the result a job of one
worker would give: its own lanes as the sums, ImmDt count 1 (0 for a null), its exponent,
no overflow, addressed from the job table as every result is. Everything else is the golden
model's: the control path (registers, job table, counters), the parser's checks and the
contribution's checks (job, rank, slot, credit), a retransmission of a completed use
answered again (`replays`), an older message dropped (`drop_stale`).

Every contribution counts a completed use of its job (COMPLETED + 1), so the credit limit
its result carries (COMPLETED + CREDITS) is at least the one a switch that aggregates would
send: it never holds a sender back. It measures the host and the path to a switch without
the cost of aggregating (`sim.bench.contributions_per_second("echo")`); it is not a switch a
job of several workers can reduce with: each worker gets its own data back.
"""

from __future__ import annotations

from sim.golden import GoldenSwitch, Job, SlotCopy


class EchoSwitch(GoldenSwitch):
    """The echo switch; parameters as `GoldenSwitch`'s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.own: dict[tuple[int, int, int], SlotCopy] = {}   # (slot, version, rank) -> copy

    def _aggregation(self, job: Job, index: int, version: int, rank: int):
        """The rank's own copy of the slot version, one contribution per use, the result to
        the rank alone."""
        copy = self.own.get((index, version, rank))
        if copy is None:
            copy = self.own[index, version, rank] = SlotCopy()
        return copy, 1, (rank,)

    def _clear(self, job: Job):
        super()._clear(job)
        end = job.slot_base + job.slot_count
        self.own = {key: copy for key, copy in self.own.items()
                    if not job.slot_base <= key[0] < end}
