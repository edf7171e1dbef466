"""The aggregation switch: `ports` RoCEv2 ports around one aggregator.

    port i: frame in -> Ingress (parse, check, widen, queue until judged good)
                                  \\
                                   Arbiter (committed packets in commit order)
                                   -> Aggregator (slots, control)  -> Egress of the ports a
    port j: frame out <- Egress (headers from the job table, replays, deparse) <- result goes to

The aggregator is `ports` times as wide as a port (`width` bits), so it serves every port at
line rate. Parameters: `ports` (2..16), `width` (64..512), `jobs`, `max_workers` (per job),
`slots` (per version), `max_payload` (bytes of int32 lanes), and the ingress queue's and the
egress ring's capacity in bytes (at most 32 KB per port: the priority-drop thresholds are 16
bits), and the number of committed header entries an ingress queue holds (`header_entries`,
32: the entries are kept in LUT RAM, about 116 LUT RAM cells per 16 entries on an ECP5),
and where the ICRC is checked and computed (`icrc`): by an engine in each port's parser and
deparser ("engine"), or by the MACs in front of the ports ("mac": `hw.mac.Mac` with
``icrc=True``; the rx beats then carry the MAC's ``icrc_ok``, and frames leave with four zero
bytes for the MAC to fill), which saves about 1,500 LUTs per engine on an ECP5.
The packet format is `hw.headers`' (`netagg.contract.wire` is its software side); the behaviour is
`sim.golden`'s, frame for frame, when frames are applied in commit order (`committed`) and
each `tick` between them. The board's top pulses `tick` every `netagg.contract.regmap.TICK_SECONDS`.

Reset reaches control state only (valid bits, pointers, counts, the job table): the registers
that hold a header, a beat or an address behind a valid bit are ``reset_less``, as in the MAC.
On the Colorlight's build that takes the core reset from 7,000 flip-flops to 1,377, and
with it a net that reached most slices of the die.
"""

from amaranth import Array, Cat, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from netagg.contract import headers as C

from .aggregator import Aggregator
from .beat import FrameStream, check_icrc, check_width
from .control import PORT_EVENTS, Control
from .egress import Egress
from .fabric import Fabric
from .ingress import TIME_WIDTH, Ingress


class Arbiter(wiring.Component):
    """Chooses, among the ports whose next committed packet is waiting, the one committed
    first (the lower port on a tie), and hands over its header entry. Combinational."""

    def __init__(self, header_layout, ports: int):
        self.ports = ports
        super().__init__({
            "i": In(stream.Signature(header_layout)).array(ports),
            "o": Out(stream.Signature(header_layout)),
        })

    def elaborate(self, platform):
        m = Module()
        index = range(max(self.ports, 2))
        best, best_valid, best_time = 0, self.i[0].valid, self.i[0].payload.time
        for p in range(1, self.ports):
            s = self.i[p]
            ahead = Signal(TIME_WIDTH, name=f"ahead{p}")   # negative: committed earlier
            m.d.comb += ahead.eq(s.payload.time - best_time)
            better = s.valid & (~best_valid | ahead[-1])
            chosen, valid, time = (Signal(index, name=f"chosen{p}"), Signal(name=f"valid{p}"),
                                   Signal(TIME_WIDTH, name=f"time{p}"))
            m.d.comb += [
                chosen.eq(Mux(better, p, best)), valid.eq(best_valid | s.valid),
                time.eq(Mux(better, s.payload.time, best_time)),
            ]
            best, best_valid, best_time = chosen, valid, time
        m.d.comb += [
            self.o.valid.eq(best_valid),
            self.o.payload.eq(Array(i.payload for i in self.i)[best]),
        ]
        for p in range(self.ports):
            m.d.comb += self.i[p].ready.eq(self.o.ready & (best == p))
        return m


class Switch(wiring.Component):
    def __init__(self, *, ports: int = 4, width: int = 64, jobs: int = 4, max_workers: int = 8,
                 slots: int = 64, max_payload: int = C.MAX_PAYLOAD, queue_capacity: int = 4096,
                 egress_capacity: int = 4096, header_entries: int = 32, icrc: str = "engine",
                 mac: int = 0, ip: int = 0, spine: bool = False, uplinks: int = 0):
        if not 2 <= ports <= 16:
            raise ValueError(f"ports must be 2..16, not {ports}")
        if (not 1 <= jobs <= C.MAX_JOBS or not 1 <= max_workers <= C.MAX_WORKERS
                or not 1 <= slots <= C.MAX_SLOTS):
            raise ValueError(f"jobs must be 1..{C.MAX_JOBS}, max_workers 1..{C.MAX_WORKERS} "
                             f"and slots 1..{C.MAX_SLOTS}")
        self.ports, self.width = ports, check_width(width)
        self.factor = 1 << (ports - 1).bit_length()      # ports, rounded up to a power of 2
        self.jobs, self.max_workers, self.slots = jobs, max_workers, slots
        self.max_payload = max_payload
        if queue_capacity > 32768:
            raise ValueError("the ingress queue holds at most 32 KB (16-bit thresholds)")
        self.queue_capacity, self.egress_capacity = queue_capacity, egress_capacity
        self.header_entries = header_entries
        self.icrc = check_icrc(icrc)
        self.mac, self.ip = mac, ip         # reset values of the switch's own addresses
        self.fabric = Fabric(spine=spine, uplinks=uplinks)
        # a leaf's: bit p, port p's MAC reports its link lost (an uplink on it is down)
        links = {"link_down": In(ports)} if uplinks else {}
        super().__init__({
            "rx": In(FrameStream(width, checked=icrc == "mac")).array(ports),
            "tx": Out(FrameStream(width)).array(ports),
            "committed": Out(1).array(ports),
            "nulled": Out(1).array(ports),
            "tick": In(1),      # a tick of the deadlines' clock, every TICK_SECONDS
            **links,
        })

    def elaborate(self, platform):
        m = Module()
        P, J, MW = self.ports, self.jobs, self.max_workers
        wide = self.width * self.factor
        m.submodules.control = control = Control(
            ports=P, jobs=J, max_workers=MW, slots=self.slots, width=self.width,
            max_payload=self.max_payload, readers=P, mac=self.mac, ip=self.ip,
            fabric=self.fabric)
        time = Signal(TIME_WIDTH)
        m.d.sync += time.eq(time + 1)

        ingress = []
        for p in range(P):
            port = Ingress(self.width, self.factor, p, P, self.queue_capacity,
                           self.header_entries, icrc=self.icrc, fabric=self.fabric)
            m.submodules[f"ingress{p}"] = port
            wiring.connect(m, wiring.flipped(self.rx[p]), port.i)
            m.d.comb += [
                port.time.eq(time), self.committed[p].eq(port.committed),
                self.nulled[p].eq(port.nulled),
            ]
            for c, threshold in enumerate(control.thresholds):
                m.d.comb += port.thresholds[c].eq(threshold)
            m.d.comb += [control.queue_dropped[p].eq(port.dropped),
                         control.request_sources[p].eq(port.reply_to.ip_src)]
            ingress.append(port)

        m.submodules.arbiter = arbiter = Arbiter(ingress[0].header.payload.shape(), P)
        m.submodules.aggregator = aggregator = Aggregator(
            ports=P, width=wide, jobs=J, max_workers=MW, slots=self.slots,
            max_payload=self.max_payload, fabric=self.fabric)
        wiring.connect(m, aggregator.control, control.records)
        m.d.comb += aggregator.tick.eq(self.tick)
        for p in range(P):
            wiring.connect(m, ingress[p].header, arbiter.i[p])
            wiring.connect(m, ingress[p].payload, aggregator.payload[p])
        wiring.connect(m, arbiter.o, aggregator.header)

        egress = []
        for p in range(P):
            port = Egress(port=p, ports=P, width=self.width, factor=self.factor, jobs=J,
                          max_workers=MW, capacity=self.egress_capacity, icrc=self.icrc,
                          fabric=self.fabric)
            m.submodules[f"egress{p}"] = port
            wiring.connect(m, port.workers, control.readers[p])
            m.d.comb += port.addresses.eq(control.addresses)
            wiring.connect(m, port.o, wiring.flipped(self.tx[p]))
            m.d.comb += [port.reply_to.eq(ingress[p].reply_to),
                         ingress[p].reply_sent.eq(port.reply_sent | aggregator.reply_dropped[p])]
            egress.append(port)
        wiring.connect(m, control.table, aggregator.table, *(port.table for port in egress))
        # A result beat leaves the aggregator when every port it goes to can take it, and
        # only then is it offered to them (an egress port's ready never depends on valid).
        targets = aggregator.egress.payload.ports
        m.d.comb += aggregator.egress.ready.eq(
            Cat(*(~targets[p] | egress[p].i.ready for p in range(P))).all())
        for p, port in enumerate(egress):
            m.d.comb += [
                port.i.payload.eq(aggregator.egress.payload),
                port.i.valid.eq(aggregator.egress.valid & targets[p] & aggregator.egress.ready),
            ]

        for p in range(P):
            events = Signal(len(PORT_EVENTS), name=f"port{p}_events")
            m.d.comb += [events.eq(aggregator.port_events[p]),
                         events[PORT_EVENTS.index("tx")].eq(egress[p].sent),
                         events[PORT_EVENTS.index("drop_priority")].eq(ingress[p].nulled),
                         events[PORT_EVENTS.index("rx")].eq(
                             arbiter.o.valid & arbiter.o.ready & (arbiter.o.payload.port == p)),
                         control.port_events[p].eq(events)]
        for j in range(J):
            m.d.comb += [
                control.job_events[j].eq(aggregator.job_events[j]),
                control.results[j].eq(sum(
                    (port.result & (port.result_job == j)) for port in egress)),
            ]
            if self.fabric.any:
                m.d.comb += control.fabric_events[j].eq(aggregator.fabric_events[j])
            if self.fabric.spine:
                m.d.comb += control.sent[j].eq(sum(
                    (port.pull & (port.result_job == j)) for port in egress))
        if self.fabric.uplinks:
            m.d.comb += [control.link_down.eq(self.link_down),
                         aggregator.uplink_down.eq(control.uplink_down)]
            for i, up in enumerate(control.uplinks):
                m.d.comb += aggregator.uplinks[i].eq(up)
                m.d.comb += [port.uplinks[i].eq(up) for port in egress + ingress]
        return m

