"""Lattice ECP5-5G Versa (LFE5UM5G-45F-8BG381C, two Marvell 88E1512 gigabit PHYs, 100 MHz
oscillator, eight LEDs). As in LiteX's ECP5 RGMII PHY by default, the FPGA adds 2 ns on
receive (RXD/RX_CTL) and on transmit (TXC).

Core clock: 625 MHz / 25 = 25 MHz, chosen from line rate, not more. A 64-bit port carries
8 bytes a cycle: 1 Gb/s (125 MB/s) needs 15.6 MHz, and the 128-bit aggregator, which takes
both ports' payloads through one pipeline, needs 2 x 125 MB/s / 16 bytes, the same 15.6 MHz.
25 MHz (200 MB/s per port) leaves 60 % for a frame's partly filled last beat and the
per-packet cycles, and the core's deepest paths (43 MHz after placement) meet it.

Size: one job of up to four workers, 64 slots (as many as the block RAM allows: each 16
slots of 1 KB payloads take about 17 of the 108 block RAMs), 16 header entries per ingress
queue, the ICRC in the MACs: 19,905 LUT4 positions of 43,848 (45 %), 12,102 flip-flops,
95 block RAMs (2026-11-24). Every clock meets its constraint after routing (core 46.0 MHz
against 25, eth_tx 205.4, eth0_rx 194.7, eth1_rx 232.5 against 125). Routing takes router2
335 passes with its alternative weights and a present-congestion weight that grows by 0.05 a
pass (``router2/currCongWeightMult``, a setting `bitstreams.build` writes into the netlist).
The build takes about 13 minutes on 2 cores shared with other jobs.
"""

from amaranth_boards.versa_ecp5_5g import VersaECP55GPlatform

from .top import Target

TARGET = Target(
    name="versa_ecp5_5g",
    platform=VersaECP55GPlatform,
    clock="clk100", clock_hz=100e6,
    core_hz=625e6 / 25,
    switch={"jobs": 1, "max_workers": 4, "slots": 64, "max_payload": 1024,
            "queue_capacity": 4096, "egress_capacity": 4096, "header_entries": 16},
    mac=0x02_4E_41_47_47_02, ip="192.168.1.51",
    rx_delay=2e-9, tx_delay=2e-9,
    leds=8,
)
