"""Top levels with flat, named ports, for cocotb and the benchmarks.

`DatapathTop` is one port's datapath: parser and packet queue on receive (``rx_*``), deparser
on transmit (``tx_*``). With ``loopback`` high the queue feeds the deparser; low, the queue's
output leaves on ``hdr_o_*``/``pl_o_*`` and the deparser takes ``hdr_i_*``/``pl_i_*``, so
each side can be driven alone. Frame ports follow AXI-Stream naming (tdata, tkeep, tlast,
tvalid, tready), so cocotbext-axi's models drive them.
"""

from amaranth import Elaboratable, Module, Signal
from amaranth.lib import wiring

from netagg.hw import headers as H
from netagg.hw.deparser import Deparser
from netagg.hw.icrc import IcrcEngine
from netagg.hw.packet_queue import COUNTER_WIDTH, PacketQueue
from netagg.hw.parser import Parser


class _AxisPorts:
    def __init__(self, prefix, width):
        self.tdata = Signal(width, name=f"{prefix}_tdata")
        self.tkeep = Signal(width // 8, name=f"{prefix}_tkeep")
        self.tlast = Signal(name=f"{prefix}_tlast")
        self.tvalid = Signal(name=f"{prefix}_tvalid")
        self.tready = Signal(name=f"{prefix}_tready")

    def ports(self):
        return [self.tdata, self.tkeep, self.tlast, self.tvalid, self.tready]

    def drive(self, m, stream):
        """These ports feed `stream` (an input of the design)."""
        m.d.comb += [
            stream.payload.data.eq(self.tdata), stream.payload.keep.eq(self.tkeep),
            stream.payload.last.eq(self.tlast), stream.valid.eq(self.tvalid),
            self.tready.eq(stream.ready),
        ]

    def observe(self, m, stream, enable=1):
        """These ports show `stream` (an output of the design)."""
        m.d.comb += [
            self.tdata.eq(stream.payload.data), self.tkeep.eq(stream.payload.keep),
            self.tlast.eq(stream.payload.last), self.tvalid.eq(stream.valid & enable),
        ]
        with m.If(enable):
            m.d.comb += stream.ready.eq(self.tready)


class _HeaderPorts:
    def __init__(self, prefix):
        self.data = Signal(H.PACKET_HEADER.size, name=f"{prefix}_data")
        self.valid = Signal(name=f"{prefix}_valid")
        self.ready = Signal(name=f"{prefix}_ready")

    def ports(self):
        return [self.data, self.valid, self.ready]


class DatapathTop(Elaboratable):
    def __init__(self, width: int, capacity: int = 16384):
        self.width = width
        self.capacity = capacity
        self.rx = _AxisPorts("rx", width)
        self.tx = _AxisPorts("tx", width)
        self.pl_o = _AxisPorts("pl_o", width)
        self.pl_i = _AxisPorts("pl_i", width)
        self.hdr_o = _HeaderPorts("hdr_o")
        self.hdr_i = _HeaderPorts("hdr_i")
        self.loopback = Signal(name="loopback")
        self.passed = Signal(COUNTER_WIDTH, name="passed")
        self.drops = [Signal(COUNTER_WIDTH, name=f"drops_{v.name.lower()}") for v in H.Verdict]

    def ports(self):
        return [
            *self.rx.ports(), *self.tx.ports(), *self.pl_o.ports(), *self.pl_i.ports(),
            *self.hdr_o.ports(), *self.hdr_i.ports(), self.loopback, self.passed, *self.drops,
        ]

    def elaborate(self, platform):
        m = Module()
        m.submodules.parser = parser = Parser(self.width)
        m.submodules.queue = queue = PacketQueue(self.width, self.capacity)
        m.submodules.deparser = deparser = Deparser(self.width)
        wiring.connect(m, parser=parser.header, queue=queue.i_header)
        wiring.connect(m, parser=parser.payload, queue=queue.i_payload)
        self.rx.drive(m, parser.i)
        self.tx.observe(m, deparser.o)
        m.d.comb += self.passed.eq(queue.passed)
        for counter, value in zip(self.drops, queue.drops):
            m.d.comb += counter.eq(value)

        loop = self.loopback
        self.pl_o.observe(m, queue.o_payload, enable=~loop)
        m.d.comb += [
            self.hdr_o.data.eq(queue.o_header.payload),
            self.hdr_o.valid.eq(queue.o_header.valid & ~loop),
        ]
        with m.If(loop):
            m.d.comb += [
                deparser.header.payload.eq(queue.o_header.payload),
                deparser.header.valid.eq(queue.o_header.valid),
                queue.o_header.ready.eq(deparser.header.ready),
                deparser.payload.payload.eq(queue.o_payload.payload),
                deparser.payload.valid.eq(queue.o_payload.valid),
                queue.o_payload.ready.eq(deparser.payload.ready),
            ]
        with m.Else():
            m.d.comb += [
                queue.o_header.ready.eq(self.hdr_o.ready),
                deparser.header.payload.eq(self.hdr_i.data),
                deparser.header.valid.eq(self.hdr_i.valid),
                self.hdr_i.ready.eq(deparser.header.ready),
            ]
            self.pl_i.drive(m, deparser.payload)
        return m


class IcrcTop(Elaboratable):
    """The ICRC engine alone: drive a frame beat by beat with the region's end.

    (Ports avoid the name `final`, which Verilator's C++ model already uses.)
    """

    def __init__(self, width: int):
        self.width = width
        self.valid = Signal(name="valid")
        self.data = Signal(width, name="data")
        self.last = Signal(name="last")
        self.end = Signal(16, name="region_end")
        self.final = Signal(32, name="crc_state")
        self.ok = Signal(name="check_ok")
        self.in_region_end = Signal(name="at_end")

    def ports(self):
        return [self.valid, self.data, self.last, self.end, self.final, self.ok,
                self.in_region_end]

    def elaborate(self, platform):
        m = Module()
        m.submodules.engine = engine = IcrcEngine(self.width)
        m.d.comb += [
            engine.valid.eq(self.valid), engine.data.eq(self.data), engine.last.eq(self.last),
            engine.end.eq(self.end), self.final.eq(engine.final), self.ok.eq(engine.ok),
            self.in_region_end.eq(engine.in_region_end),
        ]
        return m


TOPS = {"datapath": DatapathTop, "icrc": IcrcTop}


class LoopbackTop(Elaboratable):
    """`ports` frame ports, each a FIFO of `depth` beats from ``rx{i}`` to ``tx{(i+1)%ports}``.

    A stand-in with the switch's port names (``rx{i}_*`` in, ``tx{i}_*`` out, AXI-Stream
    style), for the Python-driven Verilator model (netagg.sim.model) and its tests. Frames come out
    of the next port so that a mixed-up port shows; they are otherwise untouched, one beat per
    cycle when the sink is ready.
    """

    def __init__(self, ports: int = 4, width: int = 64, depth: int = 16):
        if ports < 1:
            raise ValueError(f"a loopback needs at least one port, not {ports!r}")
        if width < 8 or width % 8:
            raise ValueError(f"width must be a positive multiple of 8, not {width!r}")
        self.nports = ports
        self.width = width
        self.depth = depth
        self.rx = [_AxisPorts(f"rx{i}", width) for i in range(ports)]
        self.tx = [_AxisPorts(f"tx{i}", width) for i in range(ports)]

    def ports(self):
        return [sig for axis in [*self.rx, *self.tx] for sig in axis.ports()]

    def elaborate(self, platform):
        from amaranth import Cat
        from amaranth.lib.fifo import SyncFIFOBuffered

        m = Module()
        keep = self.width // 8
        for i, (rx, tx) in enumerate(zip(self.rx, self.tx[1:] + self.tx[:1])):
            fifo = SyncFIFOBuffered(width=self.width + keep + 1, depth=self.depth)
            m.submodules[f"fifo{i}"] = fifo
            m.d.comb += [
                fifo.w_data.eq(Cat(rx.tdata, rx.tkeep, rx.tlast)),
                fifo.w_en.eq(rx.tvalid),
                rx.tready.eq(fifo.w_rdy),
                Cat(tx.tdata, tx.tkeep, tx.tlast).eq(fifo.r_data),
                tx.tvalid.eq(fifo.r_rdy),
                fifo.r_en.eq(tx.tready),
            ]
        return m


TOPS["loopback"] = LoopbackTop


class SwitchTop(Elaboratable):
    """The aggregation switch (`hw.switch.Switch`) with flat ports: ``rx{i}_*`` in and
    ``tx{i}_*`` out (AXI-Stream style), ``committed{i}``, high in the cycle port i's
    ingress commits a good frame (the order the golden model applies frames in),
    ``nulled{i}``, high with it when that frame was dropped by priority to a null,
    ``tick`` in, a tick of the deadlines' clock (the harness's `nm_tick`), and a leaf's
    ``link_down`` in (bit p: port p's link is lost, `nm_link_down`)."""

    def __init__(self, ports: int = 4, width: int = 64, **params):
        from netagg.hw.switch import Switch

        self.switch = Switch(ports=ports, width=width, **params)
        self.rx = [_AxisPorts(f"rx{i}", width) for i in range(ports)]
        self.tx = [_AxisPorts(f"tx{i}", width) for i in range(ports)]
        self.committed = [Signal(name=f"committed{i}") for i in range(ports)]
        self.nulled = [Signal(name=f"nulled{i}") for i in range(ports)]
        self.tick = Signal(name="tick")
        # a leaf's: bit p, port p's link is lost
        self.link_down = [Signal(ports, name="link_down")] if self.switch.fabric.uplinks else []

    def ports(self):
        return [*(s for axis in [*self.rx, *self.tx] for s in axis.ports()), *self.committed,
                *self.nulled, self.tick, *self.link_down]

    def elaborate(self, platform):
        m = Module()
        m.submodules.switch = sw = self.switch
        for i, (rx, tx) in enumerate(zip(self.rx, self.tx)):
            rx.drive(m, sw.rx[i])
            tx.observe(m, sw.tx[i])
            m.d.comb += [self.committed[i].eq(sw.committed[i]), self.nulled[i].eq(sw.nulled[i])]
        m.d.comb += sw.tick.eq(self.tick)
        for link_down in self.link_down:
            m.d.comb += sw.link_down.eq(link_down)
        return m


TOPS["switch"] = SwitchTop


class MacTop(Elaboratable):
    """The MAC of one port (`hw.mac.Mac`): GMII receive (``gmii_rx_*``, clock ``rx_clk``) and
    transmit (``gmii_tx_*``, clock ``tx_clk``), the switch side as AXI-Stream style frame
    ports in the core clock (``clk``): ``rx_*`` out (``rx_tuser``: the ICRC verdict, read on
    a frame's last beat), ``tx_*`` in; and the receive counters (core clock). ``rst``
    resets all three domains. The MAC is the boards' (``icrc=True``)."""

    def __init__(self, width: int = 64):
        from netagg.hw.mac import COUNTER_WIDTH, Mac

        self.mac = Mac(width, rx_domain="eth_rx", tx_domain="eth_tx", icrc=True)
        self.rx_icrc_ok = Signal(name="rx_tuser")
        self.width = width
        self.rx_clk = Signal(name="rx_clk")
        self.tx_clk = Signal(name="tx_clk")
        self.gmii_rx_d = Signal(8, name="gmii_rx_d")
        self.gmii_rx_dv = Signal(name="gmii_rx_dv")
        self.gmii_rx_er = Signal(name="gmii_rx_er")
        self.gmii_tx_d = Signal(8, name="gmii_tx_d")
        self.gmii_tx_en = Signal(name="gmii_tx_en")
        self.gmii_tx_er = Signal(name="gmii_tx_er")
        self.rx = _AxisPorts("rx", width)
        self.tx = _AxisPorts("tx", width)
        self.counters = {name: Signal(COUNTER_WIDTH, name=name)
                         for name in ("rx_frames", "rx_crc_errors", "rx_overflows")}

    def ports(self):
        return [self.rx_clk, self.tx_clk, self.gmii_rx_d, self.gmii_rx_dv, self.gmii_rx_er,
                self.gmii_tx_d, self.gmii_tx_en, self.gmii_tx_er, *self.rx.ports(),
                self.rx_icrc_ok, *self.tx.ports(), *self.counters.values()]

    def elaborate(self, platform):
        from amaranth import ClockDomain, ResetSignal

        m = Module()
        m.domains.eth_rx = rx_cd = ClockDomain("eth_rx")
        m.domains.eth_tx = tx_cd = ClockDomain("eth_tx")
        m.d.comb += [rx_cd.clk.eq(self.rx_clk), rx_cd.rst.eq(ResetSignal("sync")),
                     tx_cd.clk.eq(self.tx_clk), tx_cd.rst.eq(ResetSignal("sync"))]
        m.submodules.mac = mac = self.mac
        m.d.comb += [
            mac.gmii_rx_data.eq(self.gmii_rx_d), mac.gmii_rx_dv.eq(self.gmii_rx_dv),
            mac.gmii_rx_er.eq(self.gmii_rx_er), self.gmii_tx_d.eq(mac.gmii_tx_data),
            self.gmii_tx_en.eq(mac.gmii_tx_en), self.gmii_tx_er.eq(mac.gmii_tx_er),
        ]
        self.tx.drive(m, mac.tx)
        self.rx.observe(m, mac.rx)
        m.d.comb += self.rx_icrc_ok.eq(mac.rx.payload.icrc_ok)
        for name, signal in self.counters.items():
            m.d.comb += signal.eq(getattr(mac, name))
        return m


TOPS["mac"] = MacTop


class BoardTop(Elaboratable):
    """A board's `bitstreams.top.BoardCore` (its MACs, ARP responders, frame muxes and switch,
    with the board's target parameters) with flat ports, for a Verilator model driven at the
    MACs' GMII: ``clk`` (the core, ``sync``), ``eth_clk`` (125 MHz: ``eth_tx`` and every
    ``eth{n}_rx``), ``rst`` (the core's reset), and per port n ``gmii{n}_rx_d``,
    ``gmii{n}_rx_dv``, ``gmii{n}_rx_er`` in, ``gmii{n}_tx_d``, ``gmii{n}_tx_en``,
    ``gmii{n}_tx_er`` out, and the core's counters ``rx_crc_errors{n}`` and
    ``arp_replies{n}``. As on the board, the 125 MHz domains have no reset: they start from
    their initial values."""

    def __init__(self, board: str):
        from netagg.bitstreams import target
        from netagg.bitstreams.top import BoardCore

        self.target = target(board)
        self.core = BoardCore(self.target)
        self.eth_clk = Signal(name="eth_clk")
        self.gmii = []
        for n in range(len(self.target.ports)):
            self.gmii.append({
                "rx_data": Signal(8, name=f"gmii{n}_rx_d"),
                "rx_dv": Signal(name=f"gmii{n}_rx_dv"), "rx_er": Signal(name=f"gmii{n}_rx_er"),
                "tx_data": Signal(8, name=f"gmii{n}_tx_d"),
                "tx_en": Signal(name=f"gmii{n}_tx_en"), "tx_er": Signal(name=f"gmii{n}_tx_er"),
            })
        width = len(self.core.rx_crc_errors[0])
        ports = range(len(self.gmii))
        self.rx_crc_errors = [Signal(width, name=f"rx_crc_errors{n}") for n in ports]
        self.arp_replies = [Signal(32, name=f"arp_replies{n}") for n in ports]

    def ports(self):
        return [self.eth_clk, *(s for port in self.gmii for s in port.values()),
                *self.rx_crc_errors, *self.arp_replies]

    def elaborate(self, platform):
        from amaranth import ClockDomain

        m = Module()
        domains = ["eth_tx", *(f"eth{n}_rx" for n in range(len(self.gmii)))]
        for name in domains:
            m.domains += (domain := ClockDomain(name, reset_less=True))
            m.d.comb += domain.clk.eq(self.eth_clk)
        m.submodules.core = core = self.core
        for n, port in enumerate(self.gmii):
            gmii = core.gmii[n]
            m.d.comb += [
                gmii.rx_data.eq(port["rx_data"]), gmii.rx_dv.eq(port["rx_dv"]),
                gmii.rx_er.eq(port["rx_er"]), port["tx_data"].eq(gmii.tx_data),
                port["tx_en"].eq(gmii.tx_en), port["tx_er"].eq(gmii.tx_er),
                self.rx_crc_errors[n].eq(core.rx_crc_errors[n]),
                self.arp_replies[n].eq(core.arp_replies[n]),
            ]
        return m


TOPS["board"] = BoardTop
