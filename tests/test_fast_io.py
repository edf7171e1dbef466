"""The fast switch's compiled socket loop (`sim.fast_io`, `netagg/sim/cpp/fast_io.h`), behind
`netagg sim serve` with the headers as received (root): the same scapy-built traffic, sent
over loopback UDP to it and to the golden model's server, gives every worker the same
results in the same order and both switches the same counters, with GSO runs cut into the
kernel's segments, and a corrupted datagram, a refused one, a duplicate, a control request,
a stranger's datagram and a truncated one in the middle of the runs (each handed back to the
Python path and decided there)."""

from __future__ import annotations

import os
import random
import socket
import time

import numpy as np
import pytest

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import udp_offload as U
from netagg.host.udp_socket import IP_MTU_DISCOVER, IP_PMTUDISC_DO, switch_port_for
from netagg.sim import fast_build
from netagg.sim.fast import FastSwitch
from netagg.sim.golden import GoldenSwitch
from netagg.sim.serve import SimServer
from tests.frames import scapy_frame
from tests.switch_traffic import Worker, job_key

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the packet socket the loop reads needs root"),
    pytest.mark.skipif(fast_build.library() is None, reason=f"{fast_build.unavailable()}")]

WORKERS, SLOTS, ROUNDS, VALUES = 3, 16, 3, 200


def _workers(ports: int) -> list[Worker]:
    rng = random.Random(5)
    ips = [f"127.77.0.{10 + r}" for r in range(WORKERS)]
    return [Worker(job=0, rank=r, ip=ips[r], mac=0x020000000000 | r, udp_port=0xC200 + r,
                   port=switch_port_for(ips[r], 0xC200 + r, ports),
                   qpn=rng.randrange(1, 1 << 24), rkey=rng.randrange(1 << 32),
                   va=rng.randrange(1 << 63), slot_count=SLOTS, key=job_key(0))
            for r in range(WORKERS)]


def _config(server: SimServer, workers: list[Worker]) -> list[tuple[int, int]]:
    """(register, value) pairs: the switch's address, then job 0 over SLOTS slots."""
    pairs = [(R.REG_IP, W.ip_to_int(server.bound_ip)),
             (R.job_reg(0, R.JOB_CONFIG), 0), (R.job_reg(0, R.JOB_SLOT_BASE), 0),
             (R.job_reg(0, R.JOB_SLOT_COUNT), SLOTS), (R.job_reg(0, R.JOB_KEY), job_key(0))]
    for w in workers:
        pairs += W.entry_records(0, w.rank, w.port, W.Endpoint(w.ip, w.udp_port, w.mac), w.qpn,
                                 va=w.va, rkey=w.rkey)
    return pairs + [(R.job_reg(0, R.JOB_CONFIG), R.CONFIG.pack(enable=1, workers=WORKERS))]


def _datagram(frame: bytes) -> bytes:
    return frame[W.BTH_OFFSET:]


def _traffic(server: SimServer, workers: list[Worker], rng: random.Random) -> list:
    """Per round, what each socket sends, in order: ("run", rank, datagrams) a GSO run,
    ("one", rank, datagram), ("stranger", datagram), ("control", datagram)."""
    switch = W.Endpoint(server.bound_ip, W.ROCEV2_PORT, 0)
    rounds = []
    for use in range(ROUNDS):
        steps = []
        for w in workers:
            lanes = [np.array([rng.randrange(-1 << 20, 1 << 20) for _ in range(VALUES)],
                              np.int32) for _ in range(SLOTS)]
            frames = []
            for slot in range(SLOTS):
                payload = lanes[slot].astype("<i4").tobytes()
                msn = use * SLOTS + slot
                imm = W.pack_imm(W.REQUEST_IMM, job=0, rank=w.rank, version=use % 2,
                                 slot=slot, exponent=0, droppable=0)
                frames.append(scapy_frame(
                    W.OP_CONTRIBUTION, 2, msn, payload, W.Endpoint(w.ip, w.udp_port, w.mac),
                    switch, reth=(W.contribution_va(msn, 0), job_key(0), len(payload)),
                    imm=imm))
            datagrams = [_datagram(f) for f in frames]
            if w.rank == 0 and use == 1:            # a corrupted one in the middle
                bad = bytearray(datagrams[5])
                bad[60] ^= 0x10
                steps.append(("run", w.rank, datagrams[:5] + [bytes(bad)] + datagrams[6:]))
                steps.append(("one", w.rank, datagrams[5]))     # and again, whole
            elif w.rank == 1 and use == 2:          # a wrong key in the middle
                wrong = _datagram(scapy_frame(
                    W.OP_CONTRIBUTION, 2, 999, bytes(4 * VALUES),
                    W.Endpoint(w.ip, w.udp_port, w.mac), switch,
                    reth=(W.contribution_va(use * SLOTS + 3, 0), job_key(0) ^ 1, 4 * VALUES),
                    imm=W.pack_imm(W.REQUEST_IMM, job=0, rank=w.rank, version=use % 2, slot=3,
                                   exponent=0, droppable=0)))
                steps.append(("run", w.rank, datagrams[:7] + [wrong] + datagrams[7:]))
            else:
                steps.append(("run", w.rank, datagrams))
            if w.rank == 2:                         # a duplicate and a truncated copy
                steps.append(("one", w.rank, datagrams[1]))
                steps.append(("one", w.rank, datagrams[2][:-9]))
        control = scapy_frame(W.OP_CONTROL, W.CONTROL_QPN, use, W.pack_records(
            [(R.REG_PORT, 0)]), W.Endpoint("127.77.0.99", 0xD100, 0x02BB00000009), switch)
        steps.insert(1, ("control", _datagram(control)))
        steps.insert(2, ("stranger", _datagram(scapy_frame(
            W.OP_CONTRIBUTION, 2, 1, bytes(16), W.Endpoint("127.77.0.98", 0xD200, 0), switch,
            reth=(0, 0, 16), imm=0))))
        rounds.append(steps)
    return rounds


def _socket(ip: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
    s.bind((ip, port))
    s.settimeout(0.05)
    return s


def _run(server: SimServer, seed: int) -> tuple[list, dict]:
    """The traffic through `server`: each worker's results (datagrams but the ICRC, which
    covers the server's address) in order, and the switch's counters."""
    workers = _workers(server.ports)
    socks = [_socket(w.ip, w.udp_port) for w in workers]
    control = _socket("127.77.0.99", 0xD100)
    stranger = _socket("127.77.0.98", 0xD200)
    gso = U.GsoSender(server.address)
    with server.lock:
        for addr, value in _config(server, workers):
            server.backend.write(addr, value)
    got: list[list[bytes]] = [[] for _ in workers]
    for i, steps in enumerate(_traffic(server, workers, random.Random(seed))):
        for kind, *what in steps:
            if kind == "run":
                gso.send(socks[what[0]], what[1])
            elif kind == "one":
                socks[what[0]].sendto(what[1], server.address)
            else:
                (control if kind == "control" else stranger).sendto(what[0], server.address)
        deadline = time.monotonic() + 5
        # a round's results before the next round reuses the slots, as workers wait
        while time.monotonic() < deadline and min(map(len, got)) < (i + 1) * SLOTS:
            for r, s in enumerate(socks):
                try:
                    got[r].append(s.recv(4096)[:-W.ICRC_LEN])
                except TimeoutError:
                    pass
    time.sleep(0.2)
    for r, s in enumerate(socks):       # whatever came late (replays)
        s.settimeout(0.01)
        while True:
            try:
                got[r].append(s.recv(4096)[:-W.ICRC_LEN])
            except TimeoutError:
                break
    for s in (*socks, control, stranger):
        s.close()
    with server.lock:
        return got, server.backend.counters()


def test_the_compiled_loop_answers_as_the_golden_models_server():
    with SimServer(FastSwitch()).start() as fast, SimServer(GoldenSwitch()).start() as golden:
        assert fast.fast_io is not None and golden.fast_io is None
        got, counters = _run(fast, seed=3)
        want, golden_counters = _run(golden, seed=3)
        io = fast.fast_io.counts()
        paths = fast.backend.paths
    assert [len(g) for g in got] == [len(w) for w in want]
    assert all(len(g) >= ROUNDS * SLOTS for g in got)
    assert got == want
    assert counters == golden_counters
    # the loop took the runs, and the hostile and control datagrams went the Python way
    assert io["datagrams_in"] >= ROUNDS * WORKERS * 2 and io["datagrams_out"] > 0
    assert paths.compiled >= ROUNDS * WORKERS * SLOTS - 4 and paths.golden >= ROUNDS * 3


@pytest.mark.parametrize("backend", [FastSwitch, GoldenSwitch])
def test_a_datagram_is_one_frame_whatever_its_headers_claim(backend):
    """`netagg sim serve` cuts a run where the sender's kernel cut it (the segment size the
    packet socket reports), never where a datagram's own RETH says: a datagram holding a
    valid 8-lane contribution and 36 bytes more under one ICRC, and 64-byte payloads under DMA
    lengths of 0 and 60, are each one frame the switch drops as a bad payload, as a board
    does; a real GSO run beside them is taken datagram by datagram."""
    with SimServer(backend()).start() as server:
        workers = _workers(server.ports)
        w, switch = workers[0], W.Endpoint(server.bound_ip, W.ROCEV2_PORT, 0)
        with server.lock:
            for addr, value in _config(server, workers):
                server.backend.write(addr, value)
            before = server.backend.counters()

        def contribution(slot: int, payload: bytes, dma_length: int) -> bytes:
            imm = W.pack_imm(W.REQUEST_IMM, job=0, rank=w.rank, version=0, slot=slot,
                             exponent=0, droppable=0)
            return _datagram(scapy_frame(
                W.OP_CONTRIBUTION, 2, slot, payload, W.Endpoint(w.ip, w.udp_port, w.mac),
                switch, reth=(W.contribution_va(slot, 0), job_key(0), dma_length), imm=imm))
        lanes = np.arange(8, dtype="<i4").tobytes()
        hostile = [contribution(0, lanes + bytes(range(36)), 32),
                   contribution(0, bytes(64), 0), contribution(0, bytes(64), 60)]
        run = [contribution(slot, np.full(8, slot, "<i4").tobytes(), 32)
               for slot in range(1, SLOTS)]
        sock = _socket(w.ip, w.udp_port)
        for datagram in hostile:
            sock.sendto(datagram, server.address)
        gso = U.GsoSender(server.address)
        gso.send(sock, run)
        assert gso.gso          # (one buffer the kernel cuts)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with server.lock:
                after = server.backend.counters()
            if after["jobs"][0]["contributions"] - before["jobs"][0]["contributions"] \
                    >= len(run) and _drops(after, before, "drop_bad_payload") >= 3:
                break
            time.sleep(0.05)
        sock.close()
    assert after["jobs"][0]["contributions"] - before["jobs"][0]["contributions"] == len(run)
    assert _drops(after, before, "drop_bad_payload") == len(hostile)
    for name in ("drop_bad_icrc", "drop_truncated", "drop_bad_length"):
        assert _drops(after, before, name) == 0, name


def _drops(after: dict, before: dict, name: str) -> int:
    return sum(a[name] - b[name] for a, b in zip(after["ports"], before["ports"]))
