"""The design every board shares: a PLL, two RGMII ports with their MACs and ARP responders,
the aggregation switch, and status LEDs.

    clock in -> EHXPLLL -> eth_tx (125 MHz: every port's transmit side, RGMII TXC)
                        -> sync (the core: switch, ARP, the MACs' beat side)
    port i: RGMII -> RgmiiPhy -> Mac -> (ArpResponder watches) -> switch rx[i]
            RGMII <- RgmiiPhy <- Mac <- FrameMux(switch tx[i], ARP replies)

`BoardCore` is everything from the MACs' GMII side inwards (MACs, ARP responders, frame
muxes, the switch and the tick of its deadlines' clock, `netagg.contract.regmap.TICK_SECONDS`), in
the clock domains its parent supplies; `SwitchBoard` is a `BoardCore`
with the board's pins around it: the PLL, an RGMII PHY per port, the resets and the LEDs.
Simulation (`sim.tops.BoardTop`) clocks the same `BoardCore` and drives its GMII directly.

Each port's receive side runs on its PHY's RXC (domains ``eth0_rx``, ``eth1_rx``). The PHYs
are held in reset for about 10 ms after the PLL locks. The switch's own MAC and IPv4
registers (results' source) start at the target's `mac` and `ip`, the addresses ARP answers
with; the host can set them over the control path.
"""

from dataclasses import dataclass, field

from amaranth import ClockDomain, ClockSignal, Const, Elaboratable, Instance, Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.cdc import ResetSynchronizer
from amaranth.lib.wiring import In, Out

from netagg.contract import regmap as R
from netagg.hw.mac import COUNTER_WIDTH, Mac
from netagg.hw.mac_arp import ArpResponder, FrameMux
from netagg.hw.mac_rgmii import RgmiiPhy
from netagg.hw.switch import Switch

VCO_HZ = 625e6
ETH_HZ = 125e6
WIDTH = 64                          # bits of a switch port's beat
LINE_BYTES_PER_S = 125e6            # one gigabit port, one way


@dataclass
class Target:
    """One board: its amaranth-boards platform, clock, pins, switch parameters, addresses."""
    name: str
    platform: type
    clock: str                      # the oscillator's resource
    clock_hz: float
    core_hz: float                  # VCO_HZ / an integer
    switch: dict                    # hw.switch.Switch parameters
    mac: int
    ip: str
    rx_delay: float = 0.0           # DELAYG on RXD/RX_CTL, seconds
    tx_delay: float = 0.0           # DELAYG on TXC, seconds
    leds: int = 1
    ports: tuple = (0, 1)           # eth_rgmii resource numbers
    nextpnr_opts: tuple = ()        # options added to nextpnr's command line
    nextpnr_settings: dict = field(default_factory=dict)   # settings with no option
    notes: list = field(default_factory=list)

    @property
    def core_needed_hz(self) -> float:
        """The core clock that carries every port at line rate: a port's beats are `WIDTH`
        bits (125 MB/s / 8 bytes = 15.6 M beats/s), and the aggregator, `ports` (rounded up to
        a power of two) times as wide, takes all ports' payloads through one pipeline:
        ports x 125 MB/s over ports x 8 bytes, the same 15.6 MHz."""
        factor = 1 << (len(self.ports) - 1).bit_length()
        port = LINE_BYTES_PER_S / (WIDTH // 8)
        aggregator = len(self.ports) * LINE_BYTES_PER_S / (factor * WIDTH // 8)
        return max(port, aggregator)

    @property
    def core_clock_reason(self) -> str:
        return (f"{self.core_hz / 1e6:g} MHz: {len(self.ports)} ports at 1 Gb/s need "
                f"{self.core_needed_hz / 1e6:g} MHz ({WIDTH}-bit ports, a "
                f"{WIDTH * (1 << (len(self.ports) - 1).bit_length())}-bit aggregator); the "
                f"margin is for a frame's partly filled last beat and per-packet cycles")

    @property
    def ip_int(self) -> int:
        a, b, c, d = (int(x) for x in self.ip.split("."))
        return a << 24 | b << 16 | c << 8 | d


class Pll(Elaboratable):
    """EHXPLLL: `clk_in` at `in_hz` -> CLKOP 125 MHz (feedback) and CLKOS at `core_hz`, both
    from a 625 MHz VCO (phase detector at 25 MHz)."""

    def __init__(self, clk_in, in_hz: float, core_hz: float):
        self.clk_in, self.in_hz, self.core_hz = clk_in, in_hz, core_hz
        # kept through synthesis, so that nextpnr finds the clock constraints' nets
        self.clkop = Signal(name="clk_eth_tx", attrs={"keep": "true"})
        self.clkos = Signal(name="clk_core", attrs={"keep": "true"})
        self.locked = Signal(name="pll_locked")
        pfd = 25e6
        self.clki_div = round(in_hz / pfd)
        self.clkos_div = round(VCO_HZ / core_hz)
        if abs(self.clki_div * pfd - in_hz) > 1 or abs(VCO_HZ / self.clkos_div - core_hz) > 1e3:
            raise ValueError(f"no PLL setting for {in_hz} Hz in, {core_hz} Hz core")

    def elaborate(self, platform):
        m = Module()
        op_div = round(VCO_HZ / ETH_HZ)
        m.submodules.pll = Instance(
            "EHXPLLL",
            p_PLLRST_ENA="DISABLED", p_INTFB_WAKE="DISABLED", p_STDBY_ENABLE="DISABLED",
            p_DPHASE_SOURCE="DISABLED", p_OUTDIVIDER_MUXA="DIVA", p_OUTDIVIDER_MUXB="DIVB",
            p_OUTDIVIDER_MUXC="DIVC", p_OUTDIVIDER_MUXD="DIVD",
            p_CLKI_DIV=self.clki_div, p_FEEDBK_PATH="CLKOP", p_CLKFB_DIV=round(ETH_HZ / 25e6),
            p_CLKOP_ENABLE="ENABLED", p_CLKOP_DIV=op_div, p_CLKOP_CPHASE=op_div - 1,
            p_CLKOP_FPHASE=0,
            p_CLKOS_ENABLE="ENABLED", p_CLKOS_DIV=self.clkos_div,
            p_CLKOS_CPHASE=self.clkos_div - 1, p_CLKOS_FPHASE=0,
            i_CLKI=self.clk_in, i_CLKFB=self.clkop, i_RST=0, i_STDBY=0, i_PHASESEL0=0,
            i_PHASESEL1=0, i_PHASEDIR=1, i_PHASESTEP=1, i_PHASELOADREG=1, i_PLLWAKESYNC=0,
            i_ENCLKOP=0, i_ENCLKOS=0,
            o_CLKOP=self.clkop, o_CLKOS=self.clkos, o_LOCK=self.locked,
            a_ICP_CURRENT="12", a_LPF_RESISTOR="8", a_MFG_ENABLE_FILTEROPAMP="1",
            a_MFG_GMCREF_SEL="2",
            a_FREQUENCY_PIN_CLKI=f"{self.in_hz / 1e6:g}", a_FREQUENCY_PIN_CLKOP="125",
            a_FREQUENCY_PIN_CLKOS=f"{VCO_HZ / self.clkos_div / 1e6:.4f}",
        )
        return m


GMII = wiring.Signature({
    "rx_data": In(8), "rx_dv": In(1), "rx_er": In(1),
    "tx_data": Out(8), "tx_en": Out(1), "tx_er": Out(1),
})
"""A port's GMII as the MAC sees it: a byte per 125 MHz cycle each way."""


class BoardCore(wiring.Component):
    """A board's logic inside its PHYs: per port a `Mac` (with the ICRC, ``icrc=True``), an
    `ArpResponder` for the target's addresses watching the frames the MAC passes to the
    switch, and a `FrameMux` putting its replies between the switch's frames; and the
    `Switch` with the target's parameters (``icrc="mac"``).

    Interface, per port n: ``gmii[n]`` (`GMII`, in the port's domains); ``received[n]`` and
    ``sent[n]``, high in the core cycle a frame's last beat goes into the switch or into the
    MAC; ``rx_crc_errors[n]`` (frames the MAC dropped for a wrong FCS or rx_er) and
    ``arp_replies[n]`` (requests answered), counters in the core domain.

    Domains, supplied by the parent: ``sync`` (the core), ``eth_tx`` (every port's transmit
    side, 125 MHz) and ``eth{n}_rx`` (port n's receive side, 125 MHz).
    """

    def __init__(self, target: Target):
        self.target = target
        ports = len(target.ports)
        super().__init__({
            "gmii": Out(GMII).array(ports),
            "received": Out(1).array(ports),
            "sent": Out(1).array(ports),
            "rx_crc_errors": Out(COUNTER_WIDTH).array(ports),
            "arp_replies": Out(32).array(ports),
        })

    def elaborate(self, platform):
        t = self.target
        m = Module()
        m.submodules.switch = switch = Switch(ports=len(t.ports), width=WIDTH, icrc="mac",
                                              mac=t.mac, ip=t.ip_int, **t.switch)
        # The deadlines' clock: a tick every TICK_SECONDS of the core clock.
        period = round(t.core_hz * R.TICK_SECONDS)
        divider = Signal(range(period))
        m.d.sync += divider.eq(Mux(divider == period - 1, 0, divider + 1))
        m.d.comb += switch.tick.eq(divider == period - 1)
        for n in range(len(t.ports)):
            mac = Mac(WIDTH, rx_domain=f"eth{n}_rx", tx_domain="eth_tx", icrc=True)
            arp = ArpResponder(WIDTH, mac=t.mac, ip=t.ip_int)
            mux = FrameMux(WIDTH)
            m.submodules[f"mac{n}"] = mac
            m.submodules[f"arp{n}"], m.submodules[f"txmux{n}"] = arp, mux
            gmii = self.gmii[n]
            m.d.comb += [
                mac.gmii_rx_data.eq(gmii.rx_data), mac.gmii_rx_dv.eq(gmii.rx_dv),
                mac.gmii_rx_er.eq(gmii.rx_er), gmii.tx_data.eq(mac.gmii_tx_data),
                gmii.tx_en.eq(mac.gmii_tx_en), gmii.tx_er.eq(mac.gmii_tx_er),
            ]
            rx = switch.rx[n]
            m.d.comb += [
                rx.payload.eq(mac.rx.payload), rx.valid.eq(mac.rx.valid),
                mac.rx.ready.eq(rx.ready),
                arp.data.eq(mac.rx.payload.data), arp.keep.eq(mac.rx.payload.keep),
                arp.last.eq(mac.rx.payload.last), arp.taken.eq(mac.rx.valid & rx.ready),
            ]
            tx = switch.tx[n]
            m.d.comb += [
                mux.a.payload.eq(tx.payload), mux.a.valid.eq(tx.valid), tx.ready.eq(mux.a.ready),
            ]
            m.d.comb += [
                mux.b.payload.eq(arp.o.payload), mux.b.valid.eq(arp.o.valid),
                arp.o.ready.eq(mux.b.ready),
                mac.tx.payload.eq(mux.o.payload), mac.tx.valid.eq(mux.o.valid),
                mux.o.ready.eq(mac.tx.ready),
            ]
            m.d.comb += [
                self.received[n].eq(mac.rx.valid & rx.ready & mac.rx.payload.last),
                self.sent[n].eq(mux.o.valid & mux.o.ready & mux.o.payload.last),
                self.rx_crc_errors[n].eq(mac.rx_crc_errors),
                self.arp_replies[n].eq(arp.replies),
            ]
        return m


class SwitchBoard(BoardCore):
    """`BoardCore` on a board: its logic in this module (so the netlist's names are
    ``top.mac0``, ``top.switch``, ...), with the PLL, an `RgmiiPhy` per port on the
    target's ``eth_rgmii`` resources, the core's reset and the LEDs around it."""

    def elaborate(self, platform):
        t = self.target
        m = super().elaborate(platform)
        m.submodules.pll = pll = Pll(platform.request(t.clock, 0).i, t.clock_hz, t.core_hz)
        m.domains.sync = ClockDomain("sync")
        # No reset on the 125 MHz side (see RgmiiPhy for receive): the transmit logic starts
        # from its initial values at configuration and idles until the core, held in reset
        # until the PLL locks, sends a frame; one reset net reaching both ports' MACs, on
        # opposite edges of the die, was the critical path.
        m.domains.eth_tx = ClockDomain("eth_tx", reset_less=True)
        m.d.comb += [ClockSignal("sync").eq(pll.clkos), ClockSignal("eth_tx").eq(pll.clkop)]
        platform.add_clock_constraint(pll.clkop, ETH_HZ)
        platform.add_clock_constraint(pll.clkos, VCO_HZ / pll.clkos_div)
        m.submodules.sync_reset = ResetSynchronizer(~pll.locked, domain="sync")

        # About 10 ms of PHY reset after lock, then the ports start.
        hold = Signal(range(int(t.core_hz / 100) + 1), init=int(t.core_hz / 100))
        with m.If(hold != 0):
            m.d.sync += hold.eq(hold - 1)
        phy_reset = hold != 0

        for n, number in enumerate(t.ports):
            pads = platform.request("eth_rgmii", number, dir="-")
            rx_domain = f"eth{n}_rx"
            m.domains += ClockDomain(rx_domain, reset_less=True)   # see RgmiiPhy
            phy = RgmiiPhy(pads, rx_domain=rx_domain, tx_domain="eth_tx",
                           rx_delay=t.rx_delay, tx_delay=t.tx_delay)
            m.submodules[f"phy{n}"] = phy
            gmii = self.gmii[n]
            m.d.comb += [
                phy.phy_reset.eq(phy_reset),
                gmii.rx_data.eq(phy.rx_data), gmii.rx_dv.eq(phy.rx_dv),
                gmii.rx_er.eq(phy.rx_er), phy.tx_data.eq(gmii.tx_data),
                phy.tx_en.eq(gmii.tx_en), phy.tx_er.eq(gmii.tx_er),
            ]

        bad = [count != 0 for count in self.rx_crc_errors]
        replies = Const(0)
        for count in self.arp_replies:
            replies = replies | (count != 0)
        self._leds(m, platform, t, pll.locked, list(self.received), list(self.sent), bad,
                   replies)
        return m

    def _leds(self, m, platform, t, locked, received, sent, bad, replies):
        """LED 0: heartbeat (1 Hz), blinking off on frames received; with more LEDs: frames
        received and sent per port, a bad FCS seen, PLL locked, ARP answered."""
        beat = Signal(range(int(t.core_hz)))
        m.d.sync += beat.eq(Mux(beat == int(t.core_hz) - 1, 0, beat + 1))
        heartbeat = beat < int(t.core_hz) // 2

        def stretch(name, pulse):
            count = Signal(range(int(t.core_hz / 20) + 1), name=f"{name}_stretch")
            with m.If(pulse):
                m.d.sync += count.eq(int(t.core_hz / 20))
            with m.Elif(count != 0):
                m.d.sync += count.eq(count - 1)
            return count != 0

        rx_any = stretch("rx", Const(0) | received[0] | received[1])
        lights = [heartbeat ^ rx_any]
        if t.leds > 1:
            lights += [stretch(f"rx{n}", p) for n, p in enumerate(received)]
            lights += [stretch(f"tx{n}", p) for n, p in enumerate(sent)]
            lights += [bad[0] | bad[1], locked, replies]
        for n, light in enumerate(lights[:t.leds]):
            m.d.comb += platform.request("led", n).o.eq(light)

