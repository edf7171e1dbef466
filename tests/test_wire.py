"""netagg/contract/wire.py against scapy's RoCEv2: contributions, results and control packets are
the bytes scapy builds (ICRC included), and parse_frame rejects truncated and corrupted frames."""

from __future__ import annotations

import random

import pytest

from netagg.contract import regmap as R
from netagg.contract import wire as W
from tests.frames import scapy_frame

WORKER = W.Endpoint("10.1.0.7", 0xC123, 0x02AB00000007)
SWITCH = W.Endpoint("10.0.0.1", W.ROCEV2_PORT, 0x02AA00000001)
RESULT_SRC = W.Endpoint("10.0.0.1", 0xC000, 0x02AA00000001)


@pytest.mark.parametrize("lanes", [1, 7, 255, 256])
def test_contribution_is_scapys(lanes):
    rng = random.Random(lanes)
    payload = bytes(rng.randrange(256) for _ in range(4 * lanes))
    fields = dict(job=3, rank=17, slot=4000, version=1, exponent=-5, droppable=True)
    msn, key = rng.randrange(1 << 32), rng.randrange(1 << 32)
    pkt = W.contribution(**fields, offset=0x9ABC_DEF0, lanes=payload, psn=0xABCDEF,
                         src=WORKER, dst=SWITCH, dscp=5, dqpn=2, msn=msn, key=key)
    imm = W.pack_imm(W.REQUEST_IMM, **{k: int(v) for k, v in fields.items()})
    expected = scapy_frame(W.OP_CONTRIBUTION, 2, 0xABCDEF, payload, WORKER, SWITCH,
                           reth=(msn << 32 | 0x9ABC_DEF0, key, len(payload)), imm=imm, dscp=5)
    assert pkt.frame() == expected
    assert pkt.datagram() == expected[W.BTH_OFFSET:]
    back = W.parse_frame(expected)
    assert (back.opcode, back.psn, W.split_va(back.va), back.rkey, back.dma_length,
            back.payload, back.dscp) == \
        (W.OP_CONTRIBUTION, 0xABCDEF, (msn, 0x9ABC_DEF0), key, len(payload), payload, 5)
    assert W.unpack_imm(W.REQUEST_IMM, back.imm) == {**fields, "droppable": 1, "reserved": 0}
    # a UDP receiver gets the datagram only: it checks the ICRC against the canonical headers
    assert W.parse_transport(expected[W.BTH_OFFSET:], WORKER, SWITCH).payload == payload


def test_result_is_scapys():
    payload = bytes(range(256)) * 4
    imm = W.pack_imm(W.RESULT_IMM, job=2, count=32 - 1, version=0, slot=9, exponent=127,
                     overflow=1)
    pkt = W.Packet(W.OP_RESULT, 0x123456, 77, payload, va=(1 << 63) + 1024, rkey=0xDEADBEEF,
                   imm=imm, src=RESULT_SRC, dst=WORKER)
    expected = scapy_frame(W.OP_RESULT, 0x123456, 77, payload, RESULT_SRC, WORKER,
                           reth=((1 << 63) + 1024, 0xDEADBEEF, len(payload)), imm=imm)
    assert pkt.frame() == expected
    back = W.parse_frame(expected)
    assert W.unpack_imm(W.RESULT_IMM, back.imm) == dict(job=2, count=31, version=0, slot=9,
                                                         exponent=127, overflow=1)
    assert (back.dst.ip, back.dst.port, back.rkey) == (WORKER.ip, WORKER.port, 0xDEADBEEF)


def test_control_request_and_reply_are_scapys():
    records = [(R.WRITE | R.worker_reg(1, 3, R.WORKER_IP), W.ip_to_int(WORKER.ip)),
               (R.REG_MAGIC, 0), (R.job_counter(2, "results"), 0)]
    req = W.control_request(records, 5, WORKER, SWITCH)
    expected = scapy_frame(W.OP_CONTROL, W.CONTROL_QPN, 5, W.pack_records(records), WORKER,
                           SWITCH)
    assert req.frame() == expected
    assert W.unpack_records(W.parse_frame(expected).payload) == records
    reply = W.Packet(W.OP_CONTROL, W.CONTROL_QPN, 5, W.pack_records(records), src=SWITCH,
                     dst=WORKER)
    assert reply.frame() == scapy_frame(W.OP_CONTROL, W.CONTROL_QPN, 5,
                                        W.pack_records(records), SWITCH, WORKER)
    with pytest.raises(ValueError):
        W.control_request([], 0, WORKER, SWITCH)
    with pytest.raises(ValueError):
        W.control_request([(0, 0)] * (W.MAX_CONTROL_RECORDS + 1), 0, WORKER, SWITCH)


def test_msn_and_offset_are_the_halves_of_the_va():
    """RETH.va is the MSN (32 bits, most significant) and the offset (32 bits), each kept
    modulo 2**32, as `hw.headers.CONTRIBUTION_VA` lays them out; RETH.rkey is the key."""
    assert [(n, w) for n, _, w in W.CONTRIBUTION_VA] == [("msn", 32), ("offset", 32)]
    for msn, offset, va in ((0, 0, 0), (0xFFFFFFFF, 0, 0xFFFFFFFF << 32), (1 << 32 | 7, 5,
                            7 << 32 | 5), (-1, 1 << 32 | 9, 0xFFFFFFFF << 32 | 9)):
        pkt = W.contribution(job=0, rank=0, slot=0, version=0, offset=offset, lanes=bytes(4),
                             psn=0, src=WORKER, dst=SWITCH, msn=msn, key=0xC0FFEE)
        back = W.parse_frame(pkt.frame())
        assert (back.va, back.rkey) == (va, 0xC0FFEE)
        assert W.split_va(back.va) == (msn & 0xFFFFFFFF, offset & 0xFFFFFFFF)


def test_priority_dscp():
    assert [W.priority_dscp(c) for c in range(8)] == [0, 8, 16, 24, 32, 40, 48, 56]
    assert all(W.priority_dscp(c) >> 3 == c for c in range(R.PRIORITY_CLASSES))
    for bad in (-1, 8):
        with pytest.raises(ValueError):
            W.priority_dscp(bad)


def test_unwrap():
    span = 1 << 24
    assert W.unwrap(5, 3) == 5
    assert W.unwrap(2, span - 3) == span + 2                 # forward across the wrap
    assert W.unwrap(span - 1, span + 2) == span - 1          # backward across it
    assert W.unwrap(0, 3 * span) == 3 * span
    rng = random.Random(3)
    for _ in range(1000):
        near = rng.randrange(1 << 40)
        total = near + rng.randrange(-span // 2, span // 2)
        assert W.unwrap(total % span, near) == total
    assert W.unwrap(0x1234, 0x10000, bits=16) == 0x11234


def test_imm_fields_round_trip_and_range():
    rng = random.Random(1)
    for _ in range(200):
        v = dict(job=rng.randrange(16), rank=rng.randrange(32), version=rng.randrange(2),
                 slot=rng.randrange(4096), exponent=rng.randrange(-128, 128),
                 droppable=rng.randrange(2), reserved=0)
        assert W.unpack_imm(W.REQUEST_IMM, W.pack_imm(W.REQUEST_IMM, **v)) == v
    for bad in (dict(job=16), dict(slot=4096), dict(exponent=128), dict(exponent=-129)):
        with pytest.raises(ValueError):
            W.pack_imm(W.REQUEST_IMM, **bad)


def _frame():
    pkt = W.contribution(job=1, rank=2, slot=3, version=0, offset=4096,
                         lanes=bytes(range(200)) + bytes(56), psn=9, src=WORKER, dst=SWITCH,
                         key=0x1234)
    return pkt.frame()


def test_parse_rejects_every_truncation():
    frame = _frame()
    W.parse_frame(frame)
    for n in range(len(frame)):
        with pytest.raises(W.WireError):
            W.parse_frame(frame[:n])


# Bytes the ICRC does not cover and parse_frame does not check: the MAC addresses, IPv4
# DSCP/ECN, TTL and header checksum, UDP checksum, BTH FECN/BECN byte.
UNCHECKED = set(range(12)) | {15, 22, 24, 25, 40, 41, 46}


def test_parse_rejects_every_corrupted_byte():
    frame = _frame()
    rng = random.Random(7)
    for i in range(len(frame)):
        bad = bytearray(frame)
        bad[i] ^= 1 << rng.randrange(8)
        if i in UNCHECKED:
            W.parse_frame(bytes(bad))          # variant fields: still a good frame
            continue
        with pytest.raises(W.WireError):
            W.parse_frame(bytes(bad))


def test_datagram_checked_against_the_addresses():
    pkt = W.contribution(job=0, rank=0, slot=0, version=0, offset=0, lanes=bytes(8), psn=1,
                         src=WORKER, dst=SWITCH, key=1)
    dgram = pkt.datagram()
    W.parse_transport(dgram, WORKER, SWITCH)
    other = W.Endpoint(WORKER.ip, WORKER.port + 1)
    with pytest.raises(W.WireError):
        W.parse_transport(dgram, other, SWITCH)
    with pytest.raises(W.WireError):
        W.parse_transport(dgram[:10], WORKER, SWITCH)


def test_a_steps_contributions_as_arrays_are_the_packets_one_at_a_time():
    """`wire_arrays.ContributionWriter` writes, from each path's source, the bytes
    `wire.contribution(...).datagram()` writes, field for field (whose frames scapy reads
    above)."""
    import numpy as np

    from netagg.host.wire_arrays import ContributionWriter
    other = W.Endpoint(WORKER.ip, WORKER.port + 1, WORKER.mac)
    rng = np.random.default_rng(3)
    lanes = rng.integers(-2**31, 2**31, (3, 256), dtype=np.int64).astype(np.int32)
    fields = dict(paths=[0, 1, 0], slot=[0, 4095, 17], version=[1, 0, 1],
                  offset=[0, 1020, 2**40], msn=[0, 2**32 - 1, 99],
                  psn=[1, 2**24 + 5, 0xFFFFFF], exponent=[-128, 127, 0],
                  droppable=[True, False, True])
    rows = ContributionWriter(5, 17, [WORKER, other], SWITCH, key=0xFEEDF00D).datagrams(
        lanes, **fields)
    for i in range(3):
        expected = W.contribution(
            job=5, rank=17, slot=fields["slot"][i], version=fields["version"][i],
            offset=fields["offset"][i], lanes=lanes[i].tobytes(), psn=fields["psn"][i],
            src=[WORKER, other][fields["paths"][i]], dst=SWITCH,
            exponent=fields["exponent"][i], msn=fields["msn"][i],
            droppable=fields["droppable"][i], key=0xFEEDF00D).datagram()
        assert bytes(rows[i]) == expected
