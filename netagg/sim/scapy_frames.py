"""RoCEv2 frames of any opcode built with scapy, apart from the codec (`netagg.contract.wire`): the
traffic of the datapath's line-rate benchmark (`sim.bench_datapath`), and the tests' oracle
for the packet format.

scapy.contrib.roce provides the BTH (with the ICRC) and the AETH; RETH and ImmDt are
declared here as scapy layers, and `roce_frame` stacks the extension headers of its opcode's
class after the BTH, so every frame, its ICRC included, is built by scapy.
"""

from __future__ import annotations

import random

from scapy.contrib.roce import AETH, BTH
from scapy.fields import IntField, LongField, XIntField
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw

from netagg.contract import headers as H


class RETH(Packet):
    name = "RETH"
    fields_desc = [LongField("va", 0), XIntField("rkey", 0), IntField("dma_length", 0)]


class ImmDt(Packet):
    name = "ImmDt"
    fields_desc = [XIntField("data", 0)]


def roce_frame(opcode: int = 0x0A, payload: bytes = b"", *, rng: random.Random | None = None,
               psn: int = 0, dqpn: int = 0x11, dscp: int = 0, ttl: int = 64,
               udp_checksum: int | None = 0, **fields) -> Ether:
    """A RoCEv2 frame as a scapy packet, with the extension headers of its opcode.

    Random header values come from `rng` when given. Pads the payload to four bytes and
    sets PadCnt; scapy computes lengths, checksums and the ICRC.
    """
    rng = rng or random.Random(0)
    cls = H.OPCODE_CLASSES[opcode]
    if cls in H.NO_PAYLOAD:
        payload = b""
    pad = -len(payload) % 4
    pkt = (
        Ether(dst=fields.get("eth_dst", "02:00:00:00:00:01"),
              src=fields.get("eth_src", "02:00:00:00:00:02"))
        / IP(src=fields.get("ip_src", "10.0.0.2"), dst=fields.get("ip_dst", "10.0.0.1"),
             tos=dscp << 2, ttl=ttl, id=rng.randrange(1 << 16), flags="DF")
        / UDP(sport=fields.get("sport", 0xC000 | rng.randrange(1 << 14)), dport=H.ROCEV2_PORT,
              chksum=udp_checksum)
        / BTH(opcode=opcode, padcount=pad, psn=psn, dqpn=dqpn,
              pkey=fields.get("pkey", 0xFFFF), ackreq=fields.get("ackreq", 0),
              solicited=fields.get("se", 0))
    )
    if cls in (H.OpClass.RETH, H.OpClass.RETH_IMM, H.OpClass.READ_REQ):
        pkt = pkt / RETH(va=rng.randrange(1 << 64), rkey=rng.randrange(1 << 32),
                         dma_length=len(payload) if cls != H.OpClass.READ_REQ else 4096)
    if cls in (H.OpClass.IMM, H.OpClass.RETH_IMM):
        pkt = pkt / ImmDt(data=rng.randrange(1 << 32))
    if cls in (H.OpClass.AETH, H.OpClass.ACK):
        pkt = pkt / AETH(syndrome=rng.randrange(1 << 5), msn=rng.randrange(1 << 24))
    if payload or pad:
        pkt = pkt / Raw(payload + bytes(pad))
    return pkt
