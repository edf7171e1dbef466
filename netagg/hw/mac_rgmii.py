"""RGMII on an ECP5: the DDR pins of one gigabit port turned into the MAC's GMII signals.

Receive: the PHY's RXC clocks `rx_domain` (125 MHz), which the caller defines without a
reset (``ClockDomain(reset_less=True)``): the receive logic starts from its initial values
at configuration, while the PHY is held in reset, and a reset net into every receive
flip-flop was the critical path at 125 MHz. RXD and RX_CTL go through an optional input
delay (DELAYG, for PHYs that send data and clock edge-aligned) into IDDRX1F: the rising edge
gives bits 3..0 and RX_DV, the falling edge bits 7..4 and RX_DV xor RX_ER. One register
follows, so GMII rx is 2 rx cycles behind the pins.
Transmit: ODDRX1F in `tx_domain` (125 MHz) sends bits 3..0 and TX_EN on the rising edge,
bits 7..4 and TX_EN xor TX_ER on the falling edge; TXC is the same clock through an ODDRX1F
(1 then 0), optionally delayed (DELAYG) for PHYs without an internal TX delay.

`pads` is the board's ``eth_rgmii`` resource requested with ``dir="-"`` (subsignals
``rx_clk``, ``rx_ctl`` or ``rx_ctrl``, ``rx_data``, ``tx_clk``, ``tx_ctl`` or ``tx_ctrl``,
``tx_data``; ``rst`` if present is driven from `phy_reset`). Gigabit only.
"""

from amaranth import Cat, ClockSignal, Elaboratable, Instance, Module, Signal
from amaranth.lib import io

DELAY_STEP = 25e-12     # one DELAYG tap


def _pad(pads, *names):
    for name in names:
        if hasattr(pads, name):
            return getattr(pads, name)
    raise AttributeError(f"RGMII resource has none of {names}")


class RgmiiPhy(Elaboratable):
    def __init__(self, pads, *, rx_domain: str, tx_domain: str, rx_delay: float = 0.0,
                 tx_delay: float = 0.0):
        self.pads = pads
        self.rx_domain, self.tx_domain = rx_domain, tx_domain
        self.rx_delay, self.tx_delay = rx_delay, tx_delay
        self.rx_data = Signal(8)
        self.rx_dv = Signal()
        self.rx_er = Signal()
        self.tx_data = Signal(8)
        self.tx_en = Signal()
        self.tx_er = Signal()
        self.phy_reset = Signal()      # drives the PHY's reset pin, if the board has one

    @staticmethod
    def _delay(m, name, signal, delay):
        if not delay:
            return signal
        out = Signal(name=f"{name}_delayed")
        m.submodules[f"{name}_delay"] = Instance(
            "DELAYG", p_DEL_MODE="USER_DEFINED", p_DEL_VALUE=round(delay / DELAY_STEP),
            i_A=signal, o_Z=out)
        return out

    def elaborate(self, platform):
        m = Module()
        pads = self.pads

        rx_clk = Signal(attrs={"keep": "true"})     # named in the clock constraint
        m.submodules.rx_clk_buf = Instance("IB", i_I=pads.rx_clk.io[0], o_O=rx_clk)
        m.d.comb += ClockSignal(self.rx_domain).eq(rx_clk)
        if platform is not None:
            platform.add_clock_constraint(rx_clk, 125e6)

        rx_pins = [*(_pad(pads, "rx_data").io[i] for i in range(4)),
                   _pad(pads, "rx_ctl", "rx_ctrl").io[0]]
        rise, fall = Signal(5), Signal(5)
        for i, pin in enumerate(rx_pins):
            raw = Signal(name=f"rx{i}_pin")
            m.submodules[f"rx{i}_buf"] = Instance("IB", i_I=pin, o_O=raw)
            m.submodules[f"rx{i}_ddr"] = Instance(
                "IDDRX1F", i_D=self._delay(m, f"rx{i}", raw, self.rx_delay), i_SCLK=rx_clk,
                i_RST=0, o_Q0=rise[i], o_Q1=fall[i])
        m.d[self.rx_domain] += [
            self.rx_data.eq(Cat(rise[:4], fall[:4])),
            self.rx_dv.eq(rise[4]),
            self.rx_er.eq(rise[4] ^ fall[4]),
        ]

        tx_pins = [*(_pad(pads, "tx_data").io[i] for i in range(4)),
                   _pad(pads, "tx_ctl", "tx_ctrl").io[0]]
        first = Cat(self.tx_data[:4], self.tx_en)
        second = Cat(self.tx_data[4:], self.tx_en ^ self.tx_er)
        tx_clk = ClockSignal(self.tx_domain)
        for i, pin in enumerate(tx_pins):
            q = Signal(name=f"tx{i}_ddr")
            m.submodules[f"tx{i}_ddr"] = Instance(
                "ODDRX1F", i_D0=first[i], i_D1=second[i], i_SCLK=tx_clk, i_RST=0, o_Q=q)
            m.submodules[f"tx{i}_buf"] = Instance("OB", i_I=q, o_O=pin)
        txc = Signal()
        m.submodules.txc_ddr = Instance("ODDRX1F", i_D0=1, i_D1=0, i_SCLK=tx_clk, i_RST=0,
                                        o_Q=txc)
        m.submodules.txc_buf = Instance(
            "OB", i_I=self._delay(m, "txc", txc, self.tx_delay), o_O=pads.tx_clk.io[0])

        if hasattr(pads, "rst"):
            m.submodules.phy_reset = reset = io.Buffer("o", pads.rst)
            m.d.comb += reset.o.eq(self.phy_reset)
        return m
