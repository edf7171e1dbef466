"""The tests' scapy frames (built by `sim.scapy_frames`, apart from the codec): sweeps over
every opcode class, what the parser must read from a frame, and netagg packets built by
scapy."""

from __future__ import annotations

import random

from scapy.contrib.roce import AETH, BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from netagg.contract import headers as H
from netagg.contract import wire as W
from netagg.sim.scapy_frames import RETH, ImmDt, roce_frame

# One opcode of each class, RC and UC, for sweeps.
CLASS_OPCODES = {
    H.OpClass.NONE: [0x04, 0x24, 0x07, 0x0E, 0x81],
    H.OpClass.IMM: [0x05, 0x29],
    H.OpClass.RETH: [0x0A, 0x26],
    H.OpClass.RETH_IMM: [0x0B, 0x2B],
    H.OpClass.AETH: [0x10, 0x0D],
    H.OpClass.READ_REQ: [0x0C],
    H.OpClass.ACK: [0x11],
}


def header_fields(frame: bytes) -> dict:
    """What the parser's header entry must hold for a good frame, read back by scapy."""
    pkt = Ether(frame)
    ip, udp, bth = pkt[IP], pkt[UDP], pkt[BTH]
    cls = H.OPCODE_CLASSES[bth.opcode]
    ext = H.EXT_LENGTH[cls]
    payload_length = udp.len - 8 - 12 - ext - 4 - bth.padcount
    out = {
        "eth": {"dst": int(pkt.dst.replace(":", ""), 16), "src": int(pkt.src.replace(":", ""), 16),
                "ethertype": pkt.type},
        "ip": {"version": ip.version, "ihl": ip.ihl, "dscp": ip.tos >> 2, "ecn": ip.tos & 3,
               "total_length": ip.len, "identification": ip.id, "flags": int(ip.flags),
               "fragment_offset": ip.frag, "ttl": ip.ttl, "protocol": ip.proto,
               "checksum": ip.chksum, "src": _ip(ip.src), "dst": _ip(ip.dst)},
        "udp": {"src_port": udp.sport, "dst_port": udp.dport, "length": udp.len,
                "checksum": udp.chksum},
        "bth": {"opcode": bth.opcode, "se": bth.solicited, "migreq": bth.migreq,
                "padcnt": bth.padcount, "tver": bth.version, "pkey": bth.pkey,
                "fecn": bth.fecn, "becn": bth.becn, "resv6": bth.resv6, "dqpn": bth.dqpn,
                "ackreq": bth.ackreq, "resv7": bth.resv7, "psn": bth.psn},
        "reth": {"va": 0, "rkey": 0, "dma_length": 0},
        "immdt": {"data": 0},
        "aeth": {"syndrome": 0, "msn": 0},
        "opclass": int(cls),
        "payload_length": payload_length,
        "verdict": int(H.Verdict.OK),
    }
    after = frame[H.EXT_OFFSET:]
    if cls in (H.OpClass.RETH, H.OpClass.RETH_IMM, H.OpClass.READ_REQ):
        reth = RETH(after[:16])
        out["reth"] = {"va": reth.va, "rkey": reth.rkey, "dma_length": reth.dma_length}
    if cls == H.OpClass.IMM:
        out["immdt"] = {"data": ImmDt(after[:4]).data}
    if cls == H.OpClass.RETH_IMM:
        out["immdt"] = {"data": ImmDt(after[16:20]).data}
    if cls in (H.OpClass.AETH, H.OpClass.ACK):
        aeth = AETH(after[:4])
        out["aeth"] = {"syndrome": aeth.syndrome, "msn": aeth.msn}
    return out


def payload_of(frame: bytes) -> bytes:
    fields = header_fields(frame)
    start = H.EXT_OFFSET + H.EXT_LENGTH[H.OpClass(fields["opclass"])]
    return frame[start : start + fields["payload_length"]]


def _ip(text: str) -> int:
    return int.from_bytes(bytes(int(x) for x in text.split(".")), "big")


def sweep(rng: random.Random, sizes) -> list[bytes]:
    """Frames of every opcode class over `sizes`, classes taken in turn."""
    classes = [op for ops in CLASS_OPCODES.values() for op in ops]
    frames = []
    for n, size in enumerate(sizes):
        opcode = classes[n % len(classes)]
        payload = bytes(rng.randrange(256) for _ in range(size))
        frames.append(bytes(roce_frame(opcode, payload, rng=rng, psn=n)))
    return frames


def mac_str(m: int) -> str:
    return ":".join(f"{(m >> s) & 0xFF:02x}" for s in range(40, -8, -8))


def scapy_frame(opcode, dqpn, psn, payload, src, dst, reth=None, imm=None, dscp=0) -> bytes:
    """A netagg packet (`netagg.contract.wire.Endpoint`s for `src` and `dst`) built by scapy, with
    the canonical IPv4 header (identification 0, DF, TTL 64) and UDP checksum 0."""
    pkt = (Ether(dst=mac_str(dst.mac), src=mac_str(src.mac))
           / IP(src=src.ip, dst=dst.ip, tos=dscp << 2, ttl=64, id=0, flags="DF")
           / UDP(sport=src.port, dport=dst.port, chksum=0)
           / BTH(opcode=opcode, padcount=-len(payload) % 4, psn=psn, dqpn=dqpn, pkey=0xFFFF))
    if reth is not None:
        pkt = pkt / RETH(va=reth[0], rkey=reth[1], dma_length=reth[2])
    if imm is not None:
        pkt = pkt / ImmDt(data=imm)
    if payload:
        pkt = pkt / Raw(payload + bytes(-len(payload) % 4))
    frame = bytes(pkt)
    if dst.port != W.ROCEV2_PORT:
        # scapy binds the BTH (and so computes the ICRC) on destination port 4791 only:
        # build with 4791, then put the real port back (the ICRC covers it: recompute)
        body = frame[W.BTH_OFFSET:-4]
        hdr = bytearray(frame[W.IP_OFFSET:W.BTH_OFFSET])
        hdr[22:24] = dst.port.to_bytes(2, "big")
        frame = frame[:W.IP_OFFSET] + bytes(hdr) + body
        frame += W.icrc(bytes(hdr), body).to_bytes(4, "little")
    return frame
