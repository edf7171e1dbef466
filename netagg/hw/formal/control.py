"""The control path's properties (5), on `hw.control.Control`.

`ControlHarness` wraps the real `Control` with 2 ports, 2 jobs of 2 ranks and 4 slots. Its
record port is free: any record (read or write, at any address, with any value), from any
port, whose request has any source address, in any cycle the control path is ready; the
jobs' completions are free too. The environment keeps the aggregator's obligations
(`hw.aggregator_records`): records come at most every other cycle, and the request's
source address is the same in a record's cycle and the one before (a port's ingress holds
it while its request is served).

The properties:

- `OWNER_OR_MANAGER`: a job enabled in one cycle is the same in the next (every field of its
  entry but COMPLETED, which counts its completions) unless a record wrote in that cycle from
  the job's owner (JOB_OWNER) or the manager (REG_MANAGER, when one is set); a job's owner is
  the source of the write that enabled it; the manager changes only by a write from it, or
  from anyone while none is set;
- `DISJOINT`: two enabled jobs never share a slot, and an enabled job's slots are the
  switch's.

A planted bug (`ControlBug`) changes what `Control` reads in this harness's wiring, as in
`hw.formal.aggregate`.

The owners and the manager are the registers `Control` keeps (`job{j}_owner`, `manager`),
found by name among the signals its module drives (`Module._driving`): the properties
speak of them as the register map does, and the proof needs them to be inductive. Covers
show an enabled job rewritten by its owner, one refused to another address, two jobs
enabled at once, and the manager set.
"""

import enum

from amaranth import Array, Cat, Module, Signal
from amaranth.hdl import Assert, Assume, Cover, ResetSignal
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In

from netagg.contract import regmap as R

from ..control import JOB, JOB_EVENTS, Control

# A record as the aggregator applies it (`hw.control.RecordPort`'s `record`).
RECORD = data.StructLayout({"en": 1, "write": 1, "addr": 16, "wdata": 32})


class ControlProperty(enum.Enum):
    OWNER_OR_MANAGER = "owner or manager"
    DISJOINT = "disjoint slots"


class ControlBug(enum.Enum):
    """A fault planted in the harness's wiring of `Control`."""
    OWNER_UNCHECKED = "Control reads every request's source as job 0's owner"


class _OpenControl(Control):
    """`Control`, elaborated once, so that the harness can read the registers its module
    drives before adding it."""

    module = None

    def elaborate(self, platform):
        if self.module is None:
            self.module = super().elaborate(platform)
        return self.module


class ControlHarness(wiring.Component):
    def __init__(self, *, properties=frozenset(ControlProperty),
                 bug: ControlBug | None = None, ports: int = 2, jobs: int = 2,
                 max_workers: int = 2, slots: int = 4):
        self.properties, self.bug = frozenset(properties), bug
        self.ports, self.jobs, self.max_workers, self.slots = ports, jobs, max_workers, slots
        super().__init__({
            "record": In(RECORD),
            "request_port": In(range(max(ports, 2))),
            "request_sources": In(32).array(ports),
            "completions": In(jobs),
        })

    def elaborate(self, platform):
        m = Module()
        J, S = self.jobs, self.slots
        control = _OpenControl(ports=self.ports, jobs=J, max_workers=self.max_workers,
                               slots=S, width=64, max_payload=64)
        driven = {signal.name: signal for signal in control.elaborate(platform)._driving}
        m.submodules.control = control
        manager = driven["manager"]
        owners = [driven[f"job{j}_owner"] for j in range(J)]

        rec = self.record
        m.d.comb += [control.records.record.eq(rec),
                     control.records.request_port.eq(self.request_port)]
        for p in range(self.ports):
            m.d.comb += control.request_sources[p].eq(self.request_sources[p])
            if self.bug is ControlBug.OWNER_UNCHECKED:
                m.d.comb += control.request_sources[p].eq(owners[0])
        for j in range(J):
            m.d.comb += control.job_events[j][JOB_EVENTS.index("completed")].eq(
                self.completions[j])

        # The environment: no reset after the start; a record only when ready, at most every
        # other cycle, its source held since the cycle before.
        source = Signal(32)
        m.d.comb += source.eq(Array(self.request_sources)[self.request_port])
        last_en, last_source = Signal(), Signal(32)
        m.d.sync += [last_en.eq(rec.en), last_source.eq(source)]
        m.d.comb += [
            Assume(~ResetSignal()),
            Assume(~rec.en | control.records.ready),
            Assume(~(rec.en & last_en)),
            Assume(~rec.en | (source == last_source)),
        ]

        jobs = control.table.job
        write = rec.en & rec.write
        last = {name: Signal.like(value, name=f"last_{name}") for name, value in (
            ("write", write), ("source", source), ("manager", manager))}
        m.d.sync += [last["write"].eq(write), last["source"].eq(source),
                     last["manager"].eq(manager)]
        started = Signal()
        m.d.sync += started.eq(1)
        checks = []

        def check(prop, test, name):
            if prop in self.properties:
                checks.append(Assert(test, name, src_loc_at=1))

        kept = [name for name, _ in JOB if name != "completed"]
        by_manager = (last["manager"] != 0) & (last["source"] == last["manager"])
        for j in range(J):
            job = jobs[j]
            before = Signal(JOB, name=f"job{j}_before")
            owner_before = Signal(32, name=f"job{j}_owner_before")
            m.d.sync += [before.eq(job), owner_before.eq(owners[j])]
            changed = Cat(*(getattr(job, n) != getattr(before, n)
                            for n in kept)).any()
            allowed = last["write"] & ((last["source"] == owner_before) | by_manager)
            check(ControlProperty.OWNER_OR_MANAGER,
                  ~started | ~before.enable | ~changed | allowed,
                  f"job {j} enabled changes only by its owner's or the manager's write")
            check(ControlProperty.OWNER_OR_MANAGER,
                  ~started | before.enable | ~job.enable
                  | (last["write"] & (owners[j] == last["source"])),
                  f"job {j}'s owner is the source of the write that enabled it")
            check(ControlProperty.OWNER_OR_MANAGER, job.enable | (owners[j] == 0),
                  f"job {j} disabled has no owner")
            m.d.comb += Cover(started & before.enable & changed & ~by_manager,
                              f"job {j} rewritten by its owner")
            m.d.comb += Cover(started & before.enable & ~changed & last["write"] & ~allowed
                              & (owners[j] != 0), f"a write to job {j} refused")
        check(ControlProperty.OWNER_OR_MANAGER, ~started | (manager == last["manager"])
              | (last["write"] & ((last["manager"] == 0) | (last["source"] == last["manager"]))),
              "the manager changes only by its own write, or anyone's while none is set")

        def end(job):
            return job.slot_base + job.slot_count

        for j in range(J):
            check(ControlProperty.DISJOINT, ~jobs[j].enable | (end(jobs[j]) <= S),
                  f"job {j}'s slots are the switch's")
            for k in range(j + 1, J):
                a, b = jobs[j], jobs[k]
                check(ControlProperty.DISJOINT,
                      ~(a.enable & b.enable & (a.slot_count != 0) & (b.slot_count != 0)
                        & (a.slot_base < end(b)) & (b.slot_base < end(a))),
                      f"jobs {j} and {k} share no slot")
                m.d.comb += Cover(a.enable & b.enable & (a.slot_count != 0)
                                  & (b.slot_count != 0), f"jobs {j} and {k} enabled")
        m.d.comb += checks
        # R.REG_MANAGER is written by records like any register: a cover of it set.
        m.d.comb += Cover(started & (manager != 0) & (last["manager"] == 0),
                          f"the manager ({R.REG_MANAGER:#06x}) set")
        return m
