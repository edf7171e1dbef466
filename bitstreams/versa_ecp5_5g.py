"""Lattice ECP5-5G Versa (LFE5UM5G-45F-8BG381C, two Marvell 88E1512 gigabit PHYs, 100 MHz
oscillator, eight LEDs). As in LiteX's ECP5 RGMII PHY by default, the FPGA adds 2 ns on
receive (RXD/RX_CTL) and on transmit (TXC)."""

from amaranth_boards.versa_ecp5_5g import VersaECP55GPlatform

from .top import Target

TARGET = Target(
    name="versa_ecp5_5g",
    platform=VersaECP55GPlatform,
    clock="clk100", clock_hz=100e6,
    core_hz=625e6 / 15,
    switch={"jobs": 2, "max_workers": 4, "slots": 64, "max_payload": 1024,
            "queue_capacity": 4096, "egress_capacity": 4096},
    mac=0x02_4E_41_47_47_02, ip="192.168.1.51",
    rx_delay=2e-9, tx_delay=2e-9,
    leds=8,
)
