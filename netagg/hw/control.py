"""Control: the switch's registers (`netagg.contract.regmap`): identity, its own addresses, the job
table and the counters, read and written one record at a time by the aggregator when it serves a
control request (`records`, a `RecordPort`).

The jobs' part of the job table is kept in flip-flops and shown whole on `table` (a
`JobTable`), so the aggregator and every egress port read it without waiting. The workers'
entries (MAC, IP, UDP port, QPN, R_Key, base address) are in LUT RAM, one copy per reader
(`readers`, each a `WorkerRead`: `at` -> `worker`, asynchronous): a wide table in flip-flops
behind several read muxes is what the boards' routing could not fit. Each worker's switch
port and IP are also kept in flip-flops (`table.worker_port`, `table.worker_ip`), for the
aggregator's checks. Each job also counts the uses it completed (`completed`, the base of its
credit limit), reset by a write of its CONFIG, which also raises `table.cleared` for the
aggregator to clear the job's slots. Its KEY, the R_Key its contributions must carry, is
written and never read back (a read gives 0); its EPOCH is read and written. The switch's
own addresses are shown on `addresses`, the priority-drop thresholds (one per priority
class) on `thresholds` for the ingress ports.

A record is applied in the cycle `record.en` is high, and `rdata` shows the addressed
register in the next, the record's second (the aggregator holds a record's address for two
cycles: apply, then read back). Counters count pulses from the stages (`port_events`,
`job_events`, `results`) and the packet queues' drops (`queue_dropped`); all are 32 bits and
wrap, and live in a block RAM (`hw.counters.CounterBank`), not in flip-flops behind a read
mux: a counter's value comes with every event up to the cycle its record is applied. The
ranks' heartbeats (BEAT registers, one 32-bit word per job and rank) are in another block
RAM, the store, that only records read and write: no stage of the datapath looks at them.
The store also keeps a copy of each register that reads back what was last written to it
(the switch's addresses, the manager, the thresholds, the jobs' slot ranges, credits,
quorums, epochs and deadlines), so that their reads come from one memory port, not from a
wide mux over their flip-flops. After a reset, the worker entries and the store's words are
written (0, or a copy's reset value) one per cycle, and records wait for `records.ready`.

Who may write (`netagg.contract.regmap`'s rules): the request's source IPv4 address
(`request_sources`, each port's ingress holds it for the request it has in flight, taken by
`request_port`) is compared with the manager (REG_MANAGER) and each job's owner (JOB_OWNER), and
each job's slot range with the switch's slots and every other enabled job's (`jobs` * (`jobs` - 1) /
2 pairs of comparators, in the bits of a slot number), in the cycle before a record is
applied: records come at most every other cycle, so each is judged on what the ones before
it wrote, and the judgement is a register that only selects which writes take effect. A
worker entry's own address is compared in the record's cycle, read from the entry the
record addresses (one comparator for every entry); so is a heartbeat's: a rank's BEAT takes
a write from the address its entry holds, or the manager's, and no other (so no process can
keep a dead rank's beat moving). A refused write leaves the register as it was and bumps
`control_denied` (the request's port) or `config_refused` (the job).
"""


from amaranth import Array, Cat, Const, Module, Mux, Signal
from amaranth.lib import data, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out
from amaranth.utils import bits_for

from netagg.contract import regmap as R
from netagg.contract.headers import Verdict

from .control_registers import RecordAddress, Register, region
from .counters import CounterBank
from .fabric import NO_FABRIC, SENT_COUNTERS, UPLINK, Fabric, job_layout, leaf_registers

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
# Counters Control counts itself, from the records it refuses.
REFUSALS = ("control_denied", "config_refused")
JOB_EVENTS = tuple(c for c in R.JOB_COUNTERS if c not in ("results", *REFUSALS))
# The switch's own addresses, the source of its results.
ADDRESSES = data.StructLayout({"mac": 48, "ip": 32, "udp_sport": 16})


def JobTable(jobs: int, max_workers: int, fabric: Fabric = NO_FABRIC) -> wiring.Signature:
    """The job table as its readers see it, every entry at once (`Control` drives it): each
    job's entry (`hw.fabric.job_layout`); each worker's switch port and IP, at job *
    max_workers + rank; and `cleared`, high in the cycle a record wrote job `cleared_job`'s
    CONFIG (its slots are to be cleared)."""
    entries = jobs * max_workers
    return wiring.Signature({
        "job": Out(job_layout(JOB, fabric)).array(jobs),
        "worker_port": Out(4).array(entries),
        "worker_ip": Out(32).array(entries),
        "cleared": Out(1),
        "cleared_job": Out(range(max(jobs, 2))),
    })


def RecordPort(ports: int) -> wiring.Signature:
    """Records applied to the registers, from the side that applies them (the aggregator):
    `record` is applied in the cycle its `en` is high, if `ready`; `rdata` shows the
    addressed register in the cycle after; `request_port` is the port of the control
    request being served (register PORT)."""
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
                 max_payload: int, readers: int = 1, mac: int = 0, ip: int = 0,
                 fabric: Fabric = NO_FABRIC):
        if not 0 <= mac < 1 << 48 or not 0 <= ip < 1 << 32:
            raise ValueError(f"mac {mac:#x} or ip {ip:#x} does not fit in 48 or 32 bits")
        self.ports, self.jobs, self.max_workers = ports, jobs, max_workers
        self.slots, self.width, self.max_payload = slots, width, max_payload
        self.reset_mac, self.reset_ip = mac, ip
        self.fabric = fabric
        entries = jobs * max_workers
        more = {} if not fabric.any else {
            # a fabric switch's job events (`Fabric.events`) and frames sent (SENT_COUNTERS)
            "fabric_events": In(max(len(fabric.events), 1)).array(jobs),
            "sent": In(range(ports + 1)).array(jobs * len(SENT_COUNTERS)),
        }
        if fabric.uplinks:
            # a leaf's uplink table; which uplinks are down: marked (REG_UPLINK_DOWN) or on a
            # port whose link is lost (`link_down`, bit p: port p's MAC reports it)
            more |= {"uplinks": Out(UPLINK).array(fabric.uplinks),
                     "uplink_down": Out(fabric.uplinks), "link_down": In(ports)}
        super().__init__({
            **more,
            "records": In(RecordPort(ports)),
            "table": Out(JobTable(jobs, max_workers, fabric)),
            "readers": In(WorkerRead(entries)).array(readers),
            "addresses": Out(ADDRESSES),
            "thresholds": Out(16).array(R.PRIORITY_CLASSES),
            "port_events": In(len(PORT_EVENTS)).array(ports),
            "job_events": In(len(JOB_EVENTS)).array(jobs),
            "results": In(range(ports + 1)).array(jobs),
            "queue_dropped": In(len(Verdict)).array(ports),   # by verdict
            # the source IPv4 address of the control request each port's ingress holds
            "request_sources": In(32).array(ports),
        })

    def elaborate(self, platform):
        m = Module()
        rec = self.records.record
        write = rec.en & rec.write
        manager = Signal(32)
        owners = [Signal(32, name=f"job{j}_owner") for j in range(self.jobs)]

        jobs = [Signal(job_layout(JOB, self.fabric), name=f"job{j}") for j in range(self.jobs)]
        # Who may write what, judged in the cycle before a record is applied (`_judge`).
        source = Signal(32)             # the request's source IPv4 address
        m.d.comb += source.eq(Array(self.request_sources)[self.records.request_port])
        switch_ok, job_ok, range_ok = self._judge(m, source, manager, owners, jobs)

        udp_sport = Signal(16, init=0xC000)
        m.d.comb += self.addresses.udp_sport.eq(udp_sport)
        mac, ip = Signal(48, init=self.reset_mac), Signal(32, init=self.reset_ip)
        m.d.comb += [self.addresses.mac.eq(mac), self.addresses.ip.eq(ip)]
        params = R.PARAMS.pack(ports=self.ports, jobs=self.jobs, max_workers=self.max_workers,
                               width64=self.width // 64)
        regs = [
            Register(R.REG_MAGIC, Const(R.MAGIC, 32)),
            Register(R.REG_PARAMS, Const(params, 32)),
            Register(R.REG_SLOTS, Const(self.slots, 32)),
            Register(R.REG_MAX_PAYLOAD, Const(self.max_payload, 32)),
            Register(R.REG_MAC_HI, mac[32:], mac[32:], switch_ok, copy=self.reset_mac >> 32),
            Register(R.REG_MAC_LO, mac[:32], mac[:32], switch_ok,
                     copy=self.reset_mac & 0xFFFF_FFFF),
            Register(R.REG_IP, ip, ip, switch_ok, copy=self.reset_ip),
            Register(R.REG_UDP_SPORT, udp_sport, udp_sport, switch_ok, copy=udp_sport.init),
            Register(R.REG_PORT, self.records.request_port),
            Register(R.REG_MANAGER, manager, manager, switch_ok, copy=0),
        ]
        for c in range(R.PRIORITY_CLASSES):
            threshold = Signal(16, init=R.NEVER_DROP, name=f"threshold{c}")
            m.d.comb += self.thresholds[c].eq(threshold)
            regs.append(Register(R.drop_threshold(c), threshold, threshold, switch_ok,
                                 copy=R.NEVER_DROP))
        if self.fabric.uplinks:
            regs += self._leaf(m, jobs, job_ok, switch_ok)
        refused = Signal(self.jobs)         # config_refused, by job
        for j, job in enumerate(jobs):
            m.d.comb += self.table.job[j].eq(job)
            ok = job_ok[j]
            regs += [
                Register(R.job_reg(j, R.JOB_SLOT_BASE), job.slot_base, job.slot_base, ok,
                         job.enable, copy=0),
                Register(R.job_reg(j, R.JOB_SLOT_COUNT), job.slot_count, job.slot_count, ok,
                         job.enable, copy=0),
                Register(R.job_reg(j, R.JOB_CREDITS), job.credits, job.credits, ok, copy=0),
                Register(R.job_reg(j, R.JOB_QUORUM), job.quorum, job.quorum, ok, copy=0),
                Register(R.job_reg(j, R.JOB_COMPLETED), job.completed),
                Register(R.job_reg(j, R.JOB_EPOCH), job.epoch, job.epoch, ok, copy=0),
                Register(R.job_reg(j, R.JOB_KEY), Const(0, 32), job.key, ok),  # no read learns it
                Register(R.job_reg(j, R.JOB_OWNER), owners[j]),
                Register(R.job_reg(j, R.JOB_DEADLINE), job.deadline, job.deadline, ok, copy=0),
            ]
            with m.If(self.job_events[j][JOB_EVENTS.index("completed")]):
                m.d.sync += job.completed.eq(job.completed + 1)

        # A write to a job's block (its registers and its workers' entries) from neither its
        # owner nor the manager (nor, to a worker's entry, the address it holds or anyone
        # while it holds none), or to a writable register of the switch's own while a
        # manager other than the requester is set, is denied.
        at = self._decode(rec.addr)
        job_allowed = Array(job_ok)[at.job] if self.jobs > 1 else job_ok[0]
        # After a reset, every worker entry and every word of the store is first written
        # (0, or the reset value of the register it copies), one a cycle; records wait.
        copies = [r for r in regs if r.copy is not None]
        entries = self.jobs * self.max_workers
        depth = max(entries + len(copies), 2)
        wiping = Signal(init=1)
        wiped = Signal(range(depth))
        m.d.comb += self.records.ready.eq(~wiping)
        with m.If(wiping):
            m.d.sync += wiped.eq(wiped + 1)
            with m.If(wiped == depth - 1):
                m.d.sync += wiping.eq(0)
        entry_ok, beat_ok = self._workers(m, write, source, job_allowed, at, wiping, wiped)
        beat_ok = beat_ok | ((manager != 0) & (source == manager))
        block_ok = job_allowed | (at.in_entry & entry_ok)
        denied, switch_denied = Signal(), Signal()      # the latter set by the records below
        m.d.comb += denied.eq((write & at.in_block & ~block_ok)
                              | (write & at.in_beats & ~beat_ok) | switch_denied)

        # Counters, in a bank of 16 per port and 16 per job: the counter `name` of port p is
        # at p * 16 + PORT_COUNTERS.index(name), that of job j at (ports + j) * 16 + ...
        # A refusal bumps its counter (`CounterBank`'s bump: no pending register for it).
        port_steps = [0 if name in REFUSALS else 1 for name in R.PORT_COUNTERS]
        job_steps = [self.ports if name == "results" else 0 if name in REFUSALS else 1
                     for name in R.JOB_COUNTERS]
        pad = ([0] * (16 - len(port_steps)), [0] * (16 - len(job_steps)))
        steps = (port_steps + pad[0]) * self.ports + (job_steps + pad[1]) * self.jobs
        fabric_base = len(steps)        # a fabric switch's: 16 more per job, after these
        if self.fabric.any:
            fabric_steps = [self.ports if name in SENT_COUNTERS else 1
                            for name in R.FABRIC_COUNTERS]
            steps += (fabric_steps + [0] * (16 - len(fabric_steps))) * self.jobs
        m.submodules.counters = counters = CounterBank(steps)
        for p in range(self.ports):
            for k, name in enumerate(R.PORT_COUNTERS):
                if name in VERDICT_COUNTERS:
                    event = self.queue_dropped[p][VERDICT_COUNTERS[name]]
                elif name not in REFUSALS:
                    event = self.port_events[p][PORT_EVENTS.index(name)]
                else:
                    continue
                m.d.comb += counters.step[16 * p + k].eq(event)
        for j in range(self.jobs):
            for k, name in enumerate(R.JOB_COUNTERS):
                if name not in REFUSALS:
                    step = (self.results[j] if name == "results"
                            else self.job_events[j][JOB_EVENTS.index(name)])
                    m.d.comb += counters.step[16 * (self.ports + j) + k].eq(step)
        if self.fabric.any:
            self._fabric_steps(m, counters, fabric_base)
        assert max(len(R.PORT_COUNTERS), len(R.JOB_COUNTERS)) <= 16
        in_ports, port, number = region(rec.addr, R.PORT_COUNTERS_BASE,
                                         R.PORT_COUNTERS_STRIDE, self.ports)
        in_jobs, job, job_number = region(rec.addr, R.JOB_COUNTERS_BASE,
                                           R.JOB_COUNTERS_STRIDE, self.jobs)
        port_counter = in_ports & (number < len(R.PORT_COUNTERS))
        job_counter = in_jobs & (job_number < len(R.JOB_COUNTERS))
        job_address = Cat(job_number[:4], job + self.ports)
        if self.fabric.any:
            assert R.FABRIC_COUNTERS_OFFSET == 16 and len(R.FABRIC_COUNTERS) <= 16
            fabric_counter = in_jobs & job_number[4] & (job_number[:4] < len(R.FABRIC_COUNTERS))
            job_counter = job_counter | fabric_counter
            job_address = Mux(fabric_counter, fabric_base + job * 16 + job_number[:4],
                              job_address)
        refusing = refused.any()        # a record refused: denied (by port) or refused (by job)
        m.d.comb += [
            counters.read.eq((rec.en & (port_counter | job_counter)) | denied | refusing),
            counters.bump.eq(denied | refusing),
            counters.addr.eq(Mux(
                denied, Cat(Const(R.PORT_COUNTERS.index("control_denied"), 4),
                            self.records.request_port),
                Mux(refusing, Cat(Const(R.JOB_COUNTERS.index("config_refused"), 4),
                                  at.job + self.ports),
                    Mux(port_counter, Cat(number[:4], port), job_address)))),
        ]

        # Records: read any register; write the writable ones. The store holds the
        # heartbeats (at job * max_workers + rank) and, after them, the copies.
        store_at, store_data = Signal(range(depth)), Signal(32)
        store_en, from_store = Signal(), Signal()
        m.d.comb += [store_at.eq(at.beat), store_data.eq(rec.wdata),
                     store_en.eq(write & at.in_beats & beat_ok), from_store.eq(at.in_beats)]
        with m.If(port_counter | job_counter):
            m.d.comb += self.records.rdata.eq(counters.data)
        with m.Switch(rec.addr):
            for r in regs:
                with m.Case(r.addr):
                    if r.copy is None:
                        m.d.comb += self.records.rdata.eq(r.value)
                    else:
                        m.d.comb += [store_at.eq(entries + copies.index(r)), from_store.eq(1),
                                     store_data.eq(rec.wdata[:len(r.field)]),
                                     store_en.eq(write & r.allowed & ~r.fixed)]
                    if r.field is not None:
                        with m.If(write & r.allowed & ~r.fixed):
                            m.d.sync += r.field.eq(rec.wdata)
                        if r.addr >= R.JOB_BASE:
                            j = (r.addr - R.JOB_BASE) // R.JOB_STRIDE
                            m.d.comb += refused[j].eq(write & r.allowed & r.fixed)
                        else:
                            m.d.comb += switch_denied.eq(write & ~r.allowed)
            for j, job in enumerate(jobs):
                with m.Case(R.job_reg(j, R.JOB_CONFIG)):
                    m.d.comb += self.records.rdata.eq(self._config(job))
                    enabling = rec.wdata[31]
                    with m.If(write & job_ok[j] & enabling & ~range_ok[j]):
                        m.d.comb += refused[j].eq(1)
                    with m.Elif(write & job_ok[j]):
                        asked = rec.wdata[:6]
                        m.d.sync += [
                            job.enable.eq(enabling),
                            job.workers.eq(Mux(asked > self.max_workers, self.max_workers, asked)),
                            job.completed.eq(0),
                            owners[j].eq(Mux(enabling, Mux(job.enable, owners[j], source), 0)),
                        ]
                        if self.fabric.spine:
                            partials = R.CONFIG.bits("partials")[0]
                            m.d.sync += job.partials.eq(rec.wdata[partials])
                        m.d.comb += [self.table.cleared.eq(1), self.table.cleared_job.eq(j)]
        # The store's word comes in the record's second cycle: the word as it was, or what
        # the record wrote, which the record still holds then (a block RAM's read port that
        # sees its write port's word would take a register of the word written).
        inits = [0] * entries + [r.copy for r in copies]
        inits += [0] * (depth - len(inits))
        m.submodules.store = store = Memory(shape=32, depth=depth, init=inits,
                                            attrs={"ram_style": "block"})
        store_wr = store.write_port()
        store_rd = store.read_port()
        stored = Signal()           # the record wrote its word in the cycle before
        m.d.sync += stored.eq(store_en)
        m.d.comb += [store_rd.addr.eq(store_wr.addr),
                     store_wr.addr.eq(Mux(wiping, wiped, store_at)),
                     store_wr.data.eq(Mux(wiping, Array(Const(v, 32) for v in inits)[wiped],
                                         store_data)),
                     store_wr.en.eq(wiping | store_en)]
        with m.If(from_store):
            m.d.comb += self.records.rdata.eq(Mux(stored, store_data, store_rd.data))
        return m

    def _leaf(self, m, jobs, job_ok, switch_ok):
        """A leaf's registers (`hw.fabric.leaf_registers`) and the uplink table it shows."""
        uplinks = [Signal(UPLINK, name=f"uplink{i}") for i in range(self.fabric.uplinks)]
        down = Signal(self.fabric.uplinks)          # REG_UPLINK_DOWN as written
        lost = Cat(*((self.link_down >> u.port)[0] for u in uplinks))
        m.d.comb += [self.uplinks[i].eq(u) for i, u in enumerate(uplinks)]
        m.d.comb += self.uplink_down.eq(down | lost)

        def register(addr, value, field=None, allowed=None, copy=None):
            value = Const(value, 32) if isinstance(value, int) else value
            return Register(addr, value, field, Const(1) if allowed is None else allowed,
                            copy=copy)

        return leaf_registers(m, self.fabric, jobs, job_ok, switch_ok, uplinks, down, lost,
                              register)

    def _config(self, job):
        """A job's CONFIG as a read shows it (CONFIG.partials on a spine)."""
        if self.fabric.spine:
            return Cat(job.workers, Const(0, 24), job.partials, job.enable)
        return Cat(job.workers, Const(0, 25), job.enable)

    def _fabric_steps(self, m, counters, base):
        """A fabric switch's job counters (FABRIC_COUNTERS), at `base` + 16 j + their index:
        its job events and the frames its egress ports sent."""
        for j in range(self.jobs):
            for k, name in enumerate(R.FABRIC_COUNTERS):
                if name in self.fabric.events:
                    step = self.fabric_events[j][self.fabric.events.index(name)]
                elif name in SENT_COUNTERS:
                    step = self.sent[j * len(SENT_COUNTERS) + SENT_COUNTERS.index(name)]
                else:
                    continue
                m.d.comb += counters.step[base + 16 * j + k].eq(step)

    def _judge(self, m, source, manager, owners, jobs):
        """Registered each cycle from the request's source, the manager, the owners and the
        slot ranges: whether the request may write the switch's own registers (no manager,
        or it is the manager), each job's block (the job is disabled, or the request is its
        owner's or the manager's), and whether each job's slot range may be enabled (inside
        the switch's slots, sharing none with another enabled job; an empty range shares
        none)."""
        J = self.jobs
        switch_ok, job_ok, range_ok = Signal(), Signal(J), Signal(J)
        by_manager = (manager != 0) & (source == manager)
        m.d.sync += switch_ok.eq((manager == 0) | by_manager)
        # Slot ranges in the bits of a slot number up to `slots`: a range that fits has no
        # higher bits, and an enabled job's range fits (it was checked when the job was
        # enabled and is fixed while it is).
        w = bits_for(self.slots)
        ends = [Signal(w + 1, name=f"job{j}_slot_end") for j in range(J)]
        fits = []
        for j, job in enumerate(jobs):
            m.d.comb += ends[j].eq(job.slot_base[:w] + job.slot_count[:w])
            fits.append((job.slot_base[w:] == 0) & (job.slot_count[w:] == 0)
                        & (ends[j] <= self.slots))
        shares = {}             # (j, k), j < k: the two jobs' ranges share a slot
        for j in range(J):
            for k in range(j + 1, J):
                a, b = jobs[j], jobs[k]
                shares[j, k] = ((a.slot_count[:w] != 0) & (b.slot_count[:w] != 0)
                                & (a.slot_base[:w] < ends[k]) & (b.slot_base[:w] < ends[j]))
        for j, job in enumerate(jobs):
            m.d.sync += job_ok[j].eq(~job.enable | (source == owners[j]) | by_manager)
            taken = [jobs[k].enable & shares[min(j, k), max(j, k)] for k in range(J) if k != j]
            m.d.sync += range_ok[j].eq(fits[j] & ~Cat(Const(0), *taken).any())
        return switch_ok, job_ok, range_ok

    def _decode(self, addr) -> "RecordAddress":
        """Where a record's address falls in the jobs' blocks, the workers' entries and the
        heartbeats, from `netagg.contract.regmap`'s bases and strides."""
        job_inside, job, offset = region(addr, R.JOB_BASE, R.JOB_STRIDE, self.jobs)
        below_entries = offset < R.WORKER_BASE
        entry_inside, rank, field = region(offset, R.WORKER_BASE, R.WORKER_STRIDE,
                                            self.max_workers)
        beat_inside, beat_job, beat_rank = region(addr, R.BEAT_BASE, R.BEAT_STRIDE, self.jobs)
        return RecordAddress(
            in_block=job_inside & (below_entries | entry_inside),
            in_entry=job_inside & ~below_entries & entry_inside,
            job=job, rank=rank, field=field,
            in_beats=beat_inside & (beat_rank < self.max_workers),
            beat=beat_job * self.max_workers + beat_rank)

    def _workers(self, m, write, source, job_allowed, at, wiping, wiped):
        """The workers' entries: a LUT RAM with an asynchronous read port for each reader and
        one for records (a record rewrites the field it addresses in the whole entry), and
        each worker's port and IP in flip-flops beside it. `write`: a record writes;
        `source`: the request's source address; `job_allowed`: it may write the block of the
        job it addresses; `at`: its address decoded; `wiping`, `wiped`: the entry written 0
        after a reset. Returns whether the record may write the entry it addresses as the
        entry's own (the entry holds no address, or the request's), and whether the
        heartbeat it addresses is the request's rank's (its entry holds the request's
        address): read from the entry, so that one comparator serves every entry and beat."""
        MW, entries = self.max_workers, self.jobs * self.max_workers
        m.submodules.workers = table = Memory(shape=WORKER, depth=max(entries, 2), init=[])
        table_wr = table.write_port()
        table_rd = table.read_port(domain="comb")
        for i in range(len(self.readers)):
            reader = table.read_port(domain="comb")
            m.d.comb += [reader.addr.eq(self.readers[i].at),
                         self.readers[i].worker.eq(reader.data)]

        wdata = self.records.record.wdata
        index = Signal(range(max(entries, 2)))
        m.d.comb += [index.eq(at.job * MW + at.rank),
                     table_rd.addr.eq(Mux(at.in_beats, at.beat, index))]
        old, new = table_rd.data, Signal(WORKER)
        entry_ok = (old.ip == 0) | (old.ip == source)
        beat_ok = (old.ip != 0) & (old.ip == source)
        allowed = at.in_entry & (job_allowed | entry_ok)

        def fields(w):
            return {
                R.WORKER_PORT: Cat(w.udp_port, w.port), R.WORKER_MAC_HI: w.mac[32:],
                R.WORKER_MAC_LO: w.mac[:32], R.WORKER_IP: w.ip, R.WORKER_QPN: w.qpn,
                R.WORKER_RKEY: w.rkey, R.WORKER_VA_HI: w.va[32:], R.WORKER_VA_LO: w.va[:32],
            }

        # Written in the record's first cycle, read back (from the new entry) in its second.
        # The wipe covers the entries first (the store it also wipes is at least as deep).
        m.d.comb += new.eq(old)
        with m.If(wiping):
            m.d.comb += [table_wr.addr.eq(wiped), table_wr.data.eq(0), table_wr.en.eq(1)]
        with m.Else():
            m.d.comb += [table_wr.addr.eq(index), table_wr.data.eq(new),
                         table_wr.en.eq(write & allowed)]
        with m.If(at.in_entry):
            with m.Switch(at.field):
                for number, field in fields(old).items():
                    with m.Case(number):
                        m.d.comb += [self.records.rdata.eq(field), fields(new)[number].eq(wdata)]

        for i in range(entries):
            port, ip = Signal(4, name=f"worker{i}_port"), Signal(32, name=f"worker{i}_ip")
            m.d.comb += [self.table.worker_port[i].eq(port), self.table.worker_ip[i].eq(ip)]
            with m.If(write & allowed & (index == i)):
                with m.If(at.field == R.WORKER_PORT):
                    m.d.sync += port.eq(wdata[16:20])
                with m.If(at.field == R.WORKER_IP):
                    m.d.sync += ip.eq(wdata)
        return entry_ok, beat_ok
