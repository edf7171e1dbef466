"""Control: the switch's registers (`hw.regmap`): identity, its own addresses, the job table
and the counters, read and written one record at a time by the aggregator when it serves a
control request.

The job table is kept in flip-flops and shown whole on `jobs`/`workers`, so the aggregator
and every egress port read it without waiting. Each job also counts the uses it completed
(`completed`, the base of its credit limit), reset by a write of its CONFIG, which also
raises `cleared` for the aggregator to clear the job's slots. The priority-drop thresholds
(one per priority class) are shown on `thresholds` for the ingress ports.

Counters count pulses from the stages (`port_events`, `job_events`, `results`) and the
packet queues' drops (`queue_dropped`); all are 32 bits and wrap, and live in a block RAM
(`hw.counters.CounterBank`), not in flip-flops behind a read mux. A record is applied in the
cycle `record.en` is high; `rdata` shows the addressed register combinationally, except that a
counter's value comes a cycle after its address, with every event up to that first cycle:
the aggregator holds a record's address for two cycles (apply, then read back).
"""

from amaranth import Cat, Const, Module, Mux, Signal
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from . import regmap as R
from .counters import CounterBank
from .headers import Verdict

JOB = data.StructLayout({
    "enable": 1, "workers": 6, "slot_base": 16, "slot_count": 16,
    "credits": 16, "quorum": 6, "completed": 32,
})
WORKER = data.StructLayout({
    "port": 4, "udp_port": 16, "mac": 48, "ip": 32, "qpn": 24, "rkey": 32, "va": 64,
})
# Parser verdicts, by the port counter that counts them.
VERDICT_COUNTERS = {f"drop_{v.name.lower()}": v for v in Verdict if v != Verdict.OK}
# Port counters counted here from events: rx when the aggregator takes a packet (so that a
# control request reads it in the order packets are served), tx when an egress sends one.
# The parser's drops are the packet queues' own counters.
PORT_EVENTS = ("rx", "tx", "drop_priority", "drop_unhandled", "drop_bad_job",
               "drop_bad_payload", "control")
JOB_EVENTS = tuple(c for c in R.JOB_COUNTERS if c != "results")


class Control(wiring.Component):
    def __init__(self, *, ports: int, jobs: int, max_workers: int, slots: int, width: int,
                 max_payload: int):
        self.ports, self.jobs, self.max_workers = ports, jobs, max_workers
        self.slots, self.width, self.max_payload = slots, width, max_payload
        entries = jobs * max_workers
        super().__init__({
            "record": In(data.StructLayout({"en": 1, "write": 1, "addr": 16, "wdata": 32})),
            "rdata": Out(32),
            "mac": Out(48), "ip": Out(32), "udp_sport": Out(16),
            "job": Out(JOB).array(jobs),
            "worker": Out(WORKER).array(entries),        # job * max_workers + rank
            "thresholds": Out(16).array(R.PRIORITY_CLASSES),
            "cleared": Out(1),                            # a CONFIG write, this cycle
            "cleared_job": Out(range(max(jobs, 2))),
            "port_events": In(len(PORT_EVENTS)).array(ports),
            "job_events": In(len(JOB_EVENTS)).array(jobs),
            "results": In(range(ports + 1)).array(jobs),
            "queue_dropped": In(len(Verdict)).array(ports),   # by verdict
        })

    def elaborate(self, platform):
        m = Module()
        rec = self.record
        write = rec.en & rec.write

        # Registers and their addresses: (address, value, writable field or None).
        udp_sport = Signal(16, init=0xC000)
        m.d.comb += self.udp_sport.eq(udp_sport)
        mac, ip = Signal(48), Signal(32)
        m.d.comb += [self.mac.eq(mac), self.ip.eq(ip)]
        params = ((self.ports << 24) | (self.jobs << 16) | (self.max_workers << 8)
                  | (self.width // 64))
        regs = [
            (R.REG_MAGIC, Const(R.MAGIC, 32), None),
            (R.REG_PARAMS, Const(params, 32), None),
            (R.REG_SLOTS, Const(self.slots, 32), None),
            (R.REG_MAX_PAYLOAD, Const(self.max_payload, 32), None),
            (R.REG_MAC_HI, mac[32:], mac[32:]),
            (R.REG_MAC_LO, mac[:32], mac[:32]),
            (R.REG_IP, ip, ip),
            (R.REG_UDP_SPORT, udp_sport, udp_sport),
        ]
        for c in range(R.PRIORITY_CLASSES):
            threshold = Signal(16, init=R.NEVER_DROP, name=f"threshold{c}")
            m.d.comb += self.thresholds[c].eq(threshold)
            regs.append((R.drop_threshold(c), threshold, threshold))
        jobs = [Signal(JOB, name=f"job{j}") for j in range(self.jobs)]
        workers = [Signal(WORKER, name=f"worker{j}_{r}")
                   for j in range(self.jobs) for r in range(self.max_workers)]
        for j, job in enumerate(jobs):
            m.d.comb += self.job[j].eq(job)
            regs += [
                (R.job_reg(j, R.JOB_SLOT_BASE), job.slot_base, job.slot_base),
                (R.job_reg(j, R.JOB_SLOT_COUNT), job.slot_count, job.slot_count),
                (R.job_reg(j, R.JOB_CREDITS), job.credits, job.credits),
                (R.job_reg(j, R.JOB_QUORUM), job.quorum, job.quorum),
                (R.job_reg(j, R.JOB_COMPLETED), job.completed, None),
            ]
            with m.If(self.job_events[j][JOB_EVENTS.index("completed")]):
                m.d.sync += job.completed.eq(job.completed + 1)
            for r in range(self.max_workers):
                w = workers[j * self.max_workers + r]
                for off, value in (
                    (R.WORKER_PORT, Cat(w.udp_port, w.port)), (R.WORKER_MAC_HI, w.mac[32:]),
                    (R.WORKER_MAC_LO, w.mac[:32]), (R.WORKER_IP, w.ip), (R.WORKER_QPN, w.qpn),
                    (R.WORKER_RKEY, w.rkey), (R.WORKER_VA_HI, w.va[32:]),
                    (R.WORKER_VA_LO, w.va[:32]),
                ):
                    regs.append((R.worker_reg(j, r, off), value, value))
        for i, w in enumerate(workers):
            m.d.comb += self.worker[i].eq(w)

        # Counters, in a bank of 16 per port and 16 per job: the counter `name` of port p is
        # at p * 16 + PORT_COUNTERS.index(name), that of job j at (ports + j) * 16 + ...
        port_steps = [1] * len(R.PORT_COUNTERS)
        job_steps = [self.ports if name == "results" else 1 for name in R.JOB_COUNTERS]
        pad = ([0] * (16 - len(port_steps)), [0] * (16 - len(job_steps)))
        steps = (port_steps + pad[0]) * self.ports + (job_steps + pad[1]) * self.jobs
        m.submodules.counters = counters = CounterBank(steps)
        for p in range(self.ports):
            for k, name in enumerate(R.PORT_COUNTERS):
                if name in VERDICT_COUNTERS:
                    event = self.queue_dropped[p][VERDICT_COUNTERS[name]]
                else:
                    event = self.port_events[p][PORT_EVENTS.index(name)]
                m.d.comb += counters.step[16 * p + k].eq(event)
        for j in range(self.jobs):
            for k, name in enumerate(R.JOB_COUNTERS):
                step = (self.results[j] if name == "results"
                        else self.job_events[j][JOB_EVENTS.index(name)])
                m.d.comb += counters.step[16 * (self.ports + j) + k].eq(step)
        addr = rec.addr
        group, number = addr[5:13], addr[:5]
        port_counter = ((addr[13:16] == R.PORT_COUNTERS_BASE >> 13) & (group < self.ports)
                        & (number < len(R.PORT_COUNTERS)))
        job_counter = ((addr[13:16] == R.JOB_COUNTERS_BASE >> 13) & (group < self.jobs)
                       & (number < len(R.JOB_COUNTERS)))
        m.d.comb += counters.addr.eq(
            Cat(number[:4], Mux(port_counter, group, group + self.ports)))

        # Records: read any register; write the writable ones.
        with m.If(port_counter | job_counter):
            m.d.comb += self.rdata.eq(counters.data)
        with m.Switch(rec.addr):
            for addr, value, field in regs:
                with m.Case(addr):
                    m.d.comb += self.rdata.eq(value)
                    if field is not None:
                        with m.If(write):
                            m.d.sync += field.eq(rec.wdata)
            for j, job in enumerate(jobs):
                with m.Case(R.job_reg(j, R.JOB_CONFIG)):
                    m.d.comb += self.rdata.eq(Cat(job.workers, Const(0, 25), job.enable))
                    with m.If(write):
                        asked = rec.wdata[:6]
                        m.d.sync += [
                            job.enable.eq(rec.wdata[31]),
                            job.workers.eq(Mux(asked > self.max_workers, self.max_workers, asked)),
                            job.completed.eq(0),
                        ]
                        m.d.comb += [self.cleared.eq(1), self.cleared_job.eq(j)]
        return m

