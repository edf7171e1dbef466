"""The golden model's frame codec (sim.codec) against scapy and netagg.contract.wire: results
written from templates are the frames `netagg.contract.wire` builds and scapy rebuilds, byte for
byte; the ICRC from a cached header state is scapy's, over the fields RoCEv2 masks and not over the
others; a frame's header checks are cached per headers and length, never across lengths."""

from __future__ import annotations

import random

import pytest
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from netagg.contract import wire as W
from netagg.contract.headers import Verdict
from netagg.sim import codec as C
from netagg.sim.scapy_frames import roce_frame
from tests.frames import CLASS_OPCODES
from tests.switch_traffic import scapy_rebuilds


@pytest.mark.parametrize("seed", range(8))
def test_result_template_writes_the_frames_host_wire_builds(seed):
    rng = random.Random(seed)
    src = (rng.randrange(1 << 48), rng.randrange(1 << 32), rng.randrange(1 << 16))
    dst = (rng.randrange(1 << 48), rng.randrange(1 << 32), rng.randrange(1 << 16))
    qpn, rkey = rng.randrange(1 << 32), rng.randrange(1 << 32)      # QPN: 24 bits kept
    length = 4 * rng.randrange(1, 257)
    template = C.ResultTemplate(src, dst, qpn, rkey, length)
    for _ in range(4):
        psn, va, imm = rng.randrange(1 << 32), rng.randrange(1 << 66), rng.randrange(1 << 32)
        payload = rng.randbytes(length)
        want = W.Packet(W.OP_RESULT, qpn, psn, payload, va=va, rkey=rkey, imm=imm,
                        src=W.Endpoint(W.ip_text(src[1].to_bytes(4, "big")), src[2], src[0]),
                        dst=W.Endpoint(W.ip_text(dst[1].to_bytes(4, "big")), dst[2], dst[0]))
        frame = template.frame(psn, va, imm, payload)
        assert frame == want.frame()
        assert scapy_rebuilds(frame)


def _with_icrc(frame: bytes) -> bytes:
    """The frame with the ICRC scapy computes over it."""
    pkt = Ether(frame)
    pkt[BTH].icrc = None
    return bytes(pkt)


@pytest.mark.parametrize("opcode", [op for ops in CLASS_OPCODES.values() for op in ops])
def test_icrc_masks_exactly_the_fields_rocev2_masks(opcode):
    """The ICRC stays good when only a masked field changes (DSCP/ECN with the IPv4
    checksum redone, the UDP checksum, BTH byte 4), and fails when any other byte from the
    IPv4 header on does, the checksum redone."""
    rng = random.Random(opcode)
    frame = bytes(roce_frame(opcode, rng.randbytes(rng.randrange(0, 64)), rng=rng, psn=5))
    assert C.decode(frame)[0] == Verdict.OK
    tos = Ether(frame)
    tos[IP].tos, tos[IP].chksum, tos[UDP].chksum = 0xB9, None, 0x1234
    assert C.decode(bytes(tos))[0] == Verdict.OK
    resv = bytearray(frame)
    resv[W.BTH_OFFSET + 4] ^= 0xFF
    assert C.decode(bytes(resv))[0] == Verdict.OK
    for offset in (W.IP_OFFSET + 12, W.UDP_OFFSET, W.BTH_OFFSET + 5, W.BTH_OFFSET + 11,
                   len(frame) - 5):
        changed = bytearray(frame)
        changed[offset] ^= 0x01
        pkt = Ether(bytes(changed))
        pkt[IP].chksum = None
        assert C.decode(bytes(pkt))[0] == Verdict.BAD_ICRC, offset
        assert C.decode(_with_icrc(bytes(pkt)))[0] == Verdict.OK


def test_header_checks_are_cached_per_length():
    """The same headers on frames of other lengths: truncated or padded frames get their
    own verdicts, not the good frame's."""
    frame = bytes(roce_frame(0x2B, bytes(64), rng=random.Random(3)))
    header = C.decode(frame)[1]
    assert header.start == W.BTH_OFFSET + W.BTH_LEN + 20 and header.length == 64
    assert C.decode(frame[:-1])[0] == Verdict.TRUNCATED
    assert C.decode(frame + bytes(4))[0] == Verdict.BAD_LENGTH
    assert C.decode(frame)[1] == header
    short = bytes(roce_frame(0x24, b"", rng=random.Random(4)))      # 58 bytes: padded to 60
    assert len(short) < C.MIN_ETHERNET_FRAME
    assert C.decode(short + bytes(C.MIN_ETHERNET_FRAME - len(short)))[0] == Verdict.OK
    assert C.decode(short + bytes(C.MIN_ETHERNET_FRAME + 1 - len(short)))[0] == Verdict.BAD_LENGTH
