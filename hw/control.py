"""Control: the switch's registers (`hw.regmap`): identity, its own addresses, the job table
and the counters, read and written one record at a time by the aggregator when it serves a
control request (`records`, a `RecordPort`).

The jobs' part of the job table is kept in flip-flops and shown whole on `table` (a
`JobTable`), so the aggregator and every egress port read it without waiting. The workers'
entries (MAC, IP, UDP port, QPN, R_Key, base address) are in LUT RAM, one copy per reader
(`readers`, each a `WorkerRead`: `at` -> `worker`, asynchronous): a wide table in flip-flops
behind several read muxes is what the boards' routing could not fit. Each worker's switch
port and IP are also kept in flip-flops (`table.worker_port`, `table.worker_ip`), for the
aggregator's checks. After a reset the entries are written 0 one per cycle, and records wait
for `records.ready`. Each job also counts the uses it completed (`completed`, the base of its
credit limit), reset by a write of its CONFIG, which also raises `table.cleared` for the
aggregator to clear the job's slots. Its KEY, the R_Key its contributions must carry, is
written and never read back (a read gives 0); its EPOCH is read and written. The switch's
own addresses are shown on `addresses`, the priority-drop thresholds (one per priority
class) on `thresholds` for the ingress ports. The ranks' heartbeats (BEAT registers, one
32-bit word per job and rank) are in a small memory (one block RAM at most) that only
records read and write: no stage of the datapath looks at them.

Counters count pulses from the stages (`port_events`, `job_events`, `results`) and the
packet queues' drops (`queue_dropped`); all are 32 bits and wrap, and live in a block RAM
(`hw.counters.CounterBank`), not in flip-flops behind a read mux. A record is applied in the
cycle `record.en` is high; `rdata` shows the addressed register combinationally, except that
a counter's value comes in the cycle after its record is applied, with every event up to
that cycle: the aggregator holds a record's address for two cycles (apply, then read back).
A heartbeat's value also comes in the cycle after (the memory's read is synchronous and sees
the record's write).
"""

from amaranth import Cat, Const, Module, Mux, Signal
from amaranth.lib import data, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from . import regmap as R
from .counters import CounterBank
from .headers import Verdict

JOB = data.StructLayout({
    "enable": 1, "workers": 6, "slot_base": 16, "slot_count": 16,
    "credits": 16, "quorum": 6, "completed": 32, "epoch": 32, "key": 32,
    "deadline": R.DEADLINE_BITS,
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
# The switch's own addresses, the source of its results.
ADDRESSES = data.StructLayout({"mac": 48, "ip": 32, "udp_sport": 16})


def JobTable(jobs: int, max_workers: int) -> wiring.Signature:
    """The job table as its readers see it, every entry at once (`Control` drives it): each
    job's entry; each worker's switch port and IP, at job * max_workers + rank; and `cleared`,
    high in the cycle a record wrote job `cleared_job`'s CONFIG (its slots are to be
    cleared)."""
    entries = jobs * max_workers
    return wiring.Signature({
        "job": Out(JOB).array(jobs),
        "worker_port": Out(4).array(entries),
        "worker_ip": Out(32).array(entries),
        "cleared": Out(1),
        "cleared_job": Out(range(max(jobs, 2))),
    })


def RecordPort(ports: int) -> wiring.Signature:
    """Records applied to the registers, from the side that applies them (the aggregator):
    `record` is applied in the cycle its `en` is high, if `ready`; `rdata` shows the
    addressed register (a counter's value, the cycle after); `request_port` is the port of
    the control request being served (register PORT)."""
    return wiring.Signature({
        "record": Out(data.StructLayout({"en": 1, "write": 1, "addr": 16, "wdata": 32})),
        "request_port": Out(range(max(ports, 2))),
        "rdata": In(32),
        "ready": In(1),           # records may be applied (not while starting from reset)
    })


def WorkerRead(entries: int) -> wiring.Signature:
    """A read port of the workers' table, from the reader's side: the whole entry `at`
    job * max_workers + rank, asynchronously."""
    return wiring.Signature({
        "at": Out(range(max(entries, 2))),
        "worker": In(WORKER),
    })


class Control(wiring.Component):
    def __init__(self, *, ports: int, jobs: int, max_workers: int, slots: int, width: int,
                 max_payload: int, readers: int = 1, mac: int = 0, ip: int = 0):
        if not 0 <= mac < 1 << 48 or not 0 <= ip < 1 << 32:
            raise ValueError(f"mac {mac:#x} or ip {ip:#x} does not fit in 48 or 32 bits")
        self.ports, self.jobs, self.max_workers = ports, jobs, max_workers
        self.slots, self.width, self.max_payload = slots, width, max_payload
        self.reset_mac, self.reset_ip = mac, ip
        entries = jobs * max_workers
        super().__init__({
            "records": In(RecordPort(ports)),
            "table": Out(JobTable(jobs, max_workers)),
            "readers": In(WorkerRead(entries)).array(readers),
            "addresses": Out(ADDRESSES),
            "thresholds": Out(16).array(R.PRIORITY_CLASSES),
            "port_events": In(len(PORT_EVENTS)).array(ports),
            "job_events": In(len(JOB_EVENTS)).array(jobs),
            "results": In(range(ports + 1)).array(jobs),
            "queue_dropped": In(len(Verdict)).array(ports),   # by verdict
        })

    def elaborate(self, platform):
        m = Module()
        rec = self.records.record
        write = rec.en & rec.write

        # Registers and their addresses: (address, value, writable field or None).
        udp_sport = Signal(16, init=0xC000)
        m.d.comb += self.addresses.udp_sport.eq(udp_sport)
        mac, ip = Signal(48, init=self.reset_mac), Signal(32, init=self.reset_ip)
        m.d.comb += [self.addresses.mac.eq(mac), self.addresses.ip.eq(ip)]
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
            (R.REG_PORT, self.records.request_port, None),
        ]
        for c in range(R.PRIORITY_CLASSES):
            threshold = Signal(16, init=R.NEVER_DROP, name=f"threshold{c}")
            m.d.comb += self.thresholds[c].eq(threshold)
            regs.append((R.drop_threshold(c), threshold, threshold))
        jobs = [Signal(JOB, name=f"job{j}") for j in range(self.jobs)]
        for j, job in enumerate(jobs):
            m.d.comb += self.table.job[j].eq(job)
            regs += [
                (R.job_reg(j, R.JOB_SLOT_BASE), job.slot_base, job.slot_base),
                (R.job_reg(j, R.JOB_SLOT_COUNT), job.slot_count, job.slot_count),
                (R.job_reg(j, R.JOB_CREDITS), job.credits, job.credits),
                (R.job_reg(j, R.JOB_QUORUM), job.quorum, job.quorum),
                (R.job_reg(j, R.JOB_COMPLETED), job.completed, None),
                (R.job_reg(j, R.JOB_EPOCH), job.epoch, job.epoch),
                (R.job_reg(j, R.JOB_KEY), Const(0, 32), job.key),      # no read learns it
                (R.job_reg(j, R.JOB_DEADLINE), job.deadline, job.deadline),
            ]
            with m.If(self.job_events[j][JOB_EVENTS.index("completed")]):
                m.d.sync += job.completed.eq(job.completed + 1)

        self._workers(m, write)

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
        assert R.PORT_COUNTERS_STRIDE == R.JOB_COUNTERS_STRIDE == 0x20
        assert R.PORT_COUNTERS_BASE % 0x2000 == 0 and R.JOB_COUNTERS_BASE % 0x2000 == 0
        addr = rec.addr
        group, number = addr[5:13], addr[:5]
        port_counter = ((addr[13:16] == R.PORT_COUNTERS_BASE >> 13) & (group < self.ports)
                        & (number < len(R.PORT_COUNTERS)))
        job_counter = ((addr[13:16] == R.JOB_COUNTERS_BASE >> 13) & (group < self.jobs)
                       & (number < len(R.JOB_COUNTERS)))
        m.d.comb += [
            counters.read.eq(rec.en & (port_counter | job_counter)),
            counters.addr.eq(Cat(number[:4], Mux(port_counter, group, group + self.ports))),
        ]

        # Records: read any register; write the writable ones.
        with m.If(port_counter | job_counter):
            m.d.comb += self.records.rdata.eq(counters.data)
        with m.Switch(rec.addr):
            for addr, value, field in regs:
                with m.Case(addr):
                    m.d.comb += self.records.rdata.eq(value)
                    if field is not None:
                        with m.If(write):
                            m.d.sync += field.eq(rec.wdata)
            for j, job in enumerate(jobs):
                with m.Case(R.job_reg(j, R.JOB_CONFIG)):
                    m.d.comb += self.records.rdata.eq(Cat(job.workers, Const(0, 25), job.enable))
                    with m.If(write):
                        asked = rec.wdata[:6]
                        m.d.sync += [
                            job.enable.eq(rec.wdata[31]),
                            job.workers.eq(Mux(asked > self.max_workers, self.max_workers, asked)),
                            job.completed.eq(0),
                        ]
                        m.d.comb += [self.table.cleared.eq(1), self.table.cleared_job.eq(j)]
        return m

    def _workers(self, m, write):
        """The workers' entries: a LUT RAM with an asynchronous read port for each reader and
        one for records (a record rewrites the field it addresses in the whole entry), and
        each worker's port and IP in flip-flops beside it."""
        MW, entries = self.max_workers, self.jobs * self.max_workers
        m.submodules.workers = table = Memory(shape=WORKER, depth=max(entries, 2), init=[])
        table_wr = table.write_port()
        table_rd = table.read_port(domain="comb")
        for i in range(len(self.readers)):
            reader = table.read_port(domain="comb")
            m.d.comb += [reader.addr.eq(self.readers[i].at),
                         self.readers[i].worker.eq(reader.data)]

        # The address of a worker register: JOB_BASE + job * JOB_STRIDE + WORKER_BASE
        # + rank * WORKER_STRIDE + offset.
        addr, wdata = self.records.record.addr, self.records.record.wdata
        in_job = Signal(16)
        m.d.comb += in_job.eq(addr - R.JOB_BASE)
        job = in_job[9:13]
        rank, offset = in_job[3:9] - (R.WORKER_BASE >> 3), in_job[:3]
        hit = ((addr >= R.JOB_BASE) & (in_job[13:] == 0) & (job < self.jobs)
               & (in_job[:9] >= R.WORKER_BASE) & (rank < MW))
        assert R.JOB_STRIDE == 0x200 and R.WORKER_STRIDE == 8 and R.WORKER_BASE % 8 == 0
        index = Signal(range(max(entries, 2)))
        m.d.comb += [index.eq(job * MW + rank), table_rd.addr.eq(index)]

        def fields(w):
            return {
                R.WORKER_PORT: Cat(w.udp_port, w.port), R.WORKER_MAC_HI: w.mac[32:],
                R.WORKER_MAC_LO: w.mac[:32], R.WORKER_IP: w.ip, R.WORKER_QPN: w.qpn,
                R.WORKER_RKEY: w.rkey, R.WORKER_VA_HI: w.va[32:], R.WORKER_VA_LO: w.va[:32],
            }

        # The heartbeats: BEAT_BASE + job * BEAT_STRIDE + rank, a word each, read a cycle after
        # the record (the read sees the record's write).
        m.submodules.beats = beats = Memory(shape=32, depth=max(entries, 2), init=[])
        beat_wr = beats.write_port()
        beat_rd = beats.read_port(transparent_for=(beat_wr,))
        assert R.BEAT_BASE % 0x200 == 0 and R.BEAT_STRIDE == 32 and 16 * R.BEAT_STRIDE == 0x200
        beat_job, beat_rank = addr[5:9], addr[:5]
        beat_hit = ((addr[9:16] == R.BEAT_BASE >> 9) & (beat_job < self.jobs)
                    & (beat_rank < MW))
        m.d.comb += beat_rd.addr.eq(beat_job * MW + beat_rank)
        with m.If(beat_hit):
            m.d.comb += self.records.rdata.eq(beat_rd.data)

        # Written in the record's first cycle, read back (from the new entry) in its second.
        # After a reset, every entry and heartbeat is first written 0, one a cycle; records
        # wait (`ready`).
        old, new = table_rd.data, Signal(WORKER)
        wiping = Signal(init=1)
        wiped = Signal(range(max(entries, 2)))
        m.d.comb += [new.eq(old), self.records.ready.eq(~wiping)]
        with m.If(wiping):
            m.d.comb += [table_wr.addr.eq(wiped), table_wr.data.eq(0), table_wr.en.eq(1),
                         beat_wr.addr.eq(wiped), beat_wr.data.eq(0), beat_wr.en.eq(1)]
            m.d.sync += wiped.eq(wiped + 1)
            with m.If(wiped == max(entries, 2) - 1):
                m.d.sync += wiping.eq(0)
        with m.Else():
            m.d.comb += [table_wr.addr.eq(index), table_wr.data.eq(new),
                         table_wr.en.eq(write & hit),
                         beat_wr.addr.eq(beat_rd.addr), beat_wr.data.eq(wdata),
                         beat_wr.en.eq(write & beat_hit)]
        with m.If(hit):
            with m.Switch(offset):
                for number, field in fields(old).items():
                    with m.Case(number):
                        m.d.comb += [self.records.rdata.eq(field), fields(new)[number].eq(wdata)]

        for i in range(entries):
            port, ip = Signal(4, name=f"worker{i}_port"), Signal(32, name=f"worker{i}_ip")
            m.d.comb += [self.table.worker_port[i].eq(port), self.table.worker_ip[i].eq(ip)]
            with m.If(write & hit & (index == i)):
                with m.If(offset == R.WORKER_PORT):
                    m.d.sync += port.eq(wdata[16:20])
                with m.If(offset == R.WORKER_IP):
                    m.d.sync += ip.eq(wdata)

