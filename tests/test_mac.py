"""The Ethernet MAC (netagg/hw/mac.py) in cocotb on Verilator, against cocotbext-eth's GMII models.

One small Verilator build (width 64, the switch's port width on the boards) serves every test.
"""

import pytest

from tests.conftest import run_cocotb


@pytest.mark.parametrize("testcase", [
    "receive_checks_fcs", "transmit_line_rate", "both_directions", "receive_overflow",
    "icrc_both_ways",
])
def test_mac(testcase):
    run_cocotb("tests.cocotb_mac", "mac", testcase, width=64)


def _beats(frame: bytes, nb: int = 8):
    for at in range(0, len(frame), nb):
        chunk = frame[at:at + nb]
        yield int.from_bytes(chunk, "little"), (1 << len(chunk)) - 1, at + nb >= len(frame)


@pytest.mark.parametrize("target", ["192.168.1.50", "192.168.1.51"])
def test_arp_reply(target):
    """ArpResponder (amaranth.sim): a scapy ARP request for its IP gets scapy's idea of the
    reply; a request for another address, and a UDP frame, get none."""
    from amaranth.sim import Simulator
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import ARP, Ether

    from netagg.hw.mac_arp import ArpResponder

    mac, ip = 0x024E41474701, "192.168.1.50"
    dut = ArpResponder(64, mac=mac, ip=0xC0A80132)
    request = bytes(Ether(dst="ff:ff:ff:ff:ff:ff", src="02:00:00:00:00:07") / ARP(
        op=1, hwsrc="02:00:00:00:00:07", psrc="192.168.1.7", pdst=target))
    request += bytes(60 - len(request))
    udp = bytes(Ether() / IP(dst=ip) / UDP(dport=4791) / bytes(30))
    replies = []

    async def bench(ctx):
        for frame in [udp, request, udp]:
            for data, keep, last in _beats(frame):
                ctx.set(dut.data, data)
                ctx.set(dut.keep, keep)
                ctx.set(dut.last, last)
                ctx.set(dut.taken, 1)
                await ctx.tick()
            ctx.set(dut.taken, 0)
            await ctx.tick().repeat(4)
        got = b""
        ctx.set(dut.o.ready, 1)
        for _ in range(40):
            if ctx.get(dut.o.valid):
                beat = ctx.get(dut.o.payload)
                got += int(beat.data).to_bytes(8, "little")[:bin(int(beat.keep)).count("1")]
                if beat.last:
                    replies.append(got)
                    got = b""
            await ctx.tick()

    sim = Simulator(dut)
    sim.add_clock(8e-9)
    sim.add_testbench(bench)
    sim.run()
    if target != ip:
        assert replies == []
        return
    assert len(replies) == 1 and len(replies[0]) == 42
    reply = Ether(replies[0])
    assert reply.dst == "02:00:00:00:00:07" and reply.src == "02:4e:41:47:47:01"
    arp = reply[ARP]
    assert (arp.op, arp.hwsrc, arp.psrc, arp.hwdst, arp.pdst) == (
        2, "02:4e:41:47:47:01", ip, "02:00:00:00:00:07", "192.168.1.7")
