"""The aggregator's slot clearing: a job written afresh starts from empty slots.

Notes each job whose CONFIG a record wrote (`table.cleared`); when the control request that
wrote it has been served (`served`), writes zeros (`write`, at `slot`) to the state of each
such job's slots that is enabled then, one slot per cycle, a job at a time, lowest first,
within the slots that exist. A disabled job's range is no one's (an enabled job's may
overlap it): its slots are cleared when it is enabled. While it clears (`busy`), no other
request starts. `release` pulses when the request is over (served with nothing to clear, or
the last slot cleared): packets behind it may be looked up.

Latency: one cycle per job, plus one per slot. Drops nothing.
"""

from amaranth import Array, Const, Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .control import JobTable
from .fabric import NO_FABRIC, Fabric


class Clearing(wiring.Component):
    def __init__(self, *, jobs: int, max_workers: int, slots: int,
                 fabric: Fabric = NO_FABRIC):
        self.jobs, self.slots = jobs, slots
        super().__init__({
            "table": In(JobTable(jobs, max_workers, fabric)),
            "served": In(1),              # a control request's reply has left
            "busy": Out(1),
            "release": Out(1),            # the control request is over
            "write": Out(1),              # clear the state of `slot`
            "slot": Out(17),
        })

    def elaborate(self, platform):
        m = Module()
        J, table = self.jobs, self.table
        clear_pending = Signal(J)
        clearing = self.busy
        clear_slot = Signal(17)
        clear_end = Signal(17)
        m.d.comb += self.slot.eq(clear_slot)
        with m.If(table.cleared):
            m.d.sync += clear_pending.eq(clear_pending | (Const(1, J) << table.cleared_job))
        with m.If(self.served):
            with m.If(clear_pending.any()):
                m.d.sync += clearing.eq(1)
            with m.Else():
                m.d.comb += self.release.eq(1)
        pending_job = Signal(range(max(J, 2)))
        for j in reversed(range(J)):
            with m.If(clear_pending[j]):
                m.d.comb += pending_job.eq(j)
        with m.If(clearing):
            with m.If(clear_slot >= clear_end):
                with m.If(clear_pending.any()):
                    job = Array(table.job)[pending_job]
                    m.d.sync += [
                        clear_slot.eq(job.slot_base),
                        clear_end.eq(Mux(~job.enable, job.slot_base,
                                         Mux(job.slot_base + job.slot_count > self.slots,
                                             self.slots, job.slot_base + job.slot_count))),
                        clear_pending.eq(clear_pending & ~(Const(1, J) << pending_job)),
                    ]
                with m.Else():
                    m.d.sync += clearing.eq(0)
                    m.d.comb += self.release.eq(1)
            with m.Else():
                m.d.comb += self.write.eq(1)
                m.d.sync += clear_slot.eq(clear_slot + 1)
        return m
