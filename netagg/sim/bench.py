"""How many contributions a simulated switch takes per second over UDP.

`contributions_per_second` starts `netagg sim serve --backend NAME` in a process of its own
(or uses the switch at `url`), configures one job of `senders` workers over `slots` slots
through control requests, and runs `senders` worker-like senders on loopback, one UDP socket
each, from one thread: as a worker does, each sender has one use of each slot in flight and
sends the slot's next use (the other version, MSN use * slots + slot) when the result of the
current one comes back, and sends again what waits longer than `rto` seconds. As a worker's
transport does, a sender takes the results waiting for it as the runs the kernel merged
(`UDP_GRO`) and sends the next uses they free as one run (`udp_offload.GsoSender`, each
datagram's ICRC for the IPv4 identification the kernel gives it). A
contribution counts once its result is back; the figure is those of the `seconds` after a
`warmup`. Every result's first lane is checked: the sum of the contributors' (rank + 1) over
its ImmDt count (all senders: the golden model; the sender alone: the echo switch).

The senders' CPU seconds in that window are reported, and the switch's when this function
started it: on a machine shared with other work, contributions per CPU second of the switch
is the steadier figure.
"""

from __future__ import annotations

import re
import select
import socket
import struct
import subprocess
import sys
import time

import psutil

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import udp_offload
from netagg.host.udp_socket import IP_MTU_DISCOVER, IP_PMTUDISC_DO, request_on
from netagg.sim.model import BENCH_KEY

# BTH, RETH and ImmDt of a contribution: the header the senders write for each use.
_HEAD = W.WRITE_IMM_HEAD
_DQPN = 2                       # contributions' destination QP (the switch ignores it)
_ICRC = W.ICRC_STRUCT
_IMM = W.IMM_STRUCT      # a result's ImmDt, after its BTH and RETH
_IMM_OFFSET = W.BTH_LEN + W.RETH_LEN
_LANE = struct.Struct("<i")     # a result's first lane, after its ImmDt
# (shift, mask) of the result ImmDt's fields the senders read
_FIELDS = {name: (shift, (1 << width) - 1) for name, shift, width in W.RESULT_IMM}
_COUNT, _VERSION, _SLOT = (_FIELDS[name] for name in ("count", "version", "slot"))
_ANCILLARY = udp_offload.gro_ancillary()


def start_server(backend: str, max_workers: int = 8, timeout: float = 120.0,
                 jobs: int | None = None):
    """`netagg sim serve --backend NAME` (`sim.serve.serve_main`) in a process and session of
    its own, as a switch started apart from its workers runs: (process, url). `jobs`: the
    switch's jobs (its slots shared among them), `sim serve`'s default when None."""
    call = f"serve_main({backend!r}, max_workers={max_workers}"
    call += f", jobs={jobs})" if jobs else ")"
    proc = subprocess.Popen(
        [sys.executable, "-c",
         f"import sys; from netagg.sim.serve import serve_main; sys.exit({call})"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not re.fullmatch(r"udp://[\d.]+:\d+\n", line):
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        raise RuntimeError(f"netagg sim serve --backend {backend} did not say where it "
                           f"listens: {line!r}")
    return proc, line.strip()


class _Sender:
    """One worker-like sender: a UDP socket, its rank, the use of each slot it has in flight
    and when it sent it, and what its contributions share."""

    def __init__(self, rank: int, job: int, switch: tuple[str, int], lanes: int, slots: int):
        self.rank, self.switch, self.slots = rank, switch, slots
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        # Don't Fragment: Linux then sends identification 0, the canonical header
        self.sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        udp_offload.enable_gro(self.sock)
        self.runs = udp_offload.GsoSender(switch)
        self.local = W.Endpoint(*self.sock.getsockname())
        self.payload = struct.pack(f"<{lanes}i", *[rank + 1] * lanes)
        ip_udp = W.ip_udp_header(self.local.ip, switch[0], self.local.port, switch[1],
                                 _HEAD.size + len(self.payload) + W.ICRC_LEN)
        self.icrc = W.icrc_state(ip_udp + W.bth(W.OP_CONTRIBUTION, _DQPN, 0)[:8])
        self.imm = [[W.pack_imm(W.REQUEST_IMM, job=job, rank=rank, version=version, slot=slot)
                     for version in (0, 1)] for slot in range(slots)]
        self.qpn, self.rkey = 0x100 + rank, 0x5EED0000 + rank
        self.use = [0] * slots              # the use of each slot in flight
        self.sent_at = [0.0] * slots

    def control(self, records) -> list[int]:
        """Apply control records from this sender's socket; the values of the answer."""
        answer = request_on(self.sock, self.switch, self.local, W.Endpoint(*self.switch),
                            records, wait=0.4)
        return [v for _, v in answer]

    def datagram(self, slot: int, now: float) -> bytes:
        """The contribution of the slot's use in flight (MSN use * slots + slot), sent at
        `now`."""
        use = self.use[slot]
        msn = use * self.slots + slot
        head = _HEAD.pack(W.OP_CONTRIBUTION, 0, W.PKEY_DEFAULT, _DQPN, msn & 0xFFFFFF,
                          W.contribution_va(msn, 0), BENCH_KEY, len(self.payload),
                          self.imm[slot][use & 1])
        crc = W.crc32(self.payload, W.crc32(head[8:], self.icrc))
        self.sent_at[slot] = now
        return b"".join((head, self.payload, _ICRC.pack(crc)))

    def send(self, slots: list[int], now: float):
        """The contributions of these slots' uses in flight, as one run."""
        if slots:
            self.runs.send(self.sock, [self.datagram(slot, now) for slot in slots])

    def received(self) -> list:
        """The datagrams waiting, each run the kernel merged cut again."""
        out = []
        while True:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(65536, _ANCILLARY)
            except BlockingIOError:
                return out
            out += udp_offload.segments(data, udp_offload.segment_size(ancillary))


def _configure(senders: list[_Sender], job: int, slots: int):
    """The job: every sender a rank (its address, the switch port its requests enter), slots
    0..slots-1, no credit limit, all workers."""
    first = senders[0]
    params, max_payload, switch_ip = first.control([(R.REG_PARAMS, 0), (R.REG_MAX_PAYLOAD, 0),
                                                    (R.REG_IP, 0)])
    fields = R.PARAMS.unpack(params)
    ports, jobs, max_workers = fields["ports"], fields["jobs"], fields["max_workers"]
    if job >= jobs or len(senders) > max_workers:
        raise ValueError(f"the switch has {jobs} jobs of at most {max_workers} workers: not "
                         f"job {job} of {len(senders)}")
    if len(first.payload) > max_payload:
        raise ValueError(f"the switch takes payloads of at most {max_payload} bytes, not "
                         f"{len(first.payload)}")
    if switch_ip == 0:
        first.control([(R.WRITE | R.REG_IP, W.ip_to_int(first.switch[0]))])
    # disabled while its rows are written (an enabled job's block is its owner's alone)
    first.control([(R.WRITE | R.job_reg(job, R.JOB_CONFIG), 0)])
    for s in senders:
        [port] = s.control([(R.REG_PORT, 0)])
        if port >= ports:
            raise RuntimeError(f"REG_PORT {port} beyond the switch's {ports} ports")
        s.control([(R.WRITE | a, v) for a, v in W.entry_records(
            job, s.rank, port, s.local, s.qpn, rkey=s.rkey)])
    first.control([(R.WRITE | R.job_reg(job, reg), value) for reg, value in (
        (R.JOB_SLOT_BASE, 0), (R.JOB_SLOT_COUNT, slots), (R.JOB_CREDITS, 0),
        (R.JOB_QUORUM, 0), (R.JOB_CONFIG, R.CONFIG.pack(enable=1, workers=len(senders))),
        (R.JOB_KEY, BENCH_KEY))])


def contributions_per_second(backend: str = "golden", senders: int = 4, seconds: float = 2.0,
                             *, url: str | None = None, slots: int = 16, lanes: int = 256,
                             job: int = 0, warmup: float = 0.5, rto: float = 0.5) -> dict:
    """Contributions of `lanes` int32 lanes (256: 1024 bytes, as a worker sends) per second
    through `netagg sim serve --backend BACKEND` (or the switch at `url`) from `senders`
    senders; see the module's docstring. Returns the figures as a dict."""
    proc = None
    if url is None:
        proc, url = start_server(backend, max_workers=max(8, senders))
    host, port = url.removeprefix("udp://").rsplit(":", 1)
    ranks = [_Sender(r, job, (host, int(port)), lanes, slots) for r in range(senders)]
    try:
        _configure(ranks, job, slots)
        return _run(ranks, slots, seconds, warmup, rto, proc) | {
            "backend": backend, "url": url, "senders": senders, "slots": slots,
            "payload_bytes": 4 * lanes}
    finally:
        for s in ranks:
            s.sock.close()
        if proc is not None:
            proc.terminate()
            proc.wait(10)
            proc.stdout.close()


def _run(ranks: list[_Sender], slots: int, seconds: float, warmup: float, rto: float,
         proc: subprocess.Popen | None) -> dict:
    everyone = len(ranks) * (len(ranks) + 1) // 2
    by_sock = {s.sock: s for s in ranks}
    counted = errors = retransmissions = 0
    switch = psutil.Process(proc.pid) if proc is not None else None
    cpu = []                                    # CPU seconds (senders, switch) at begin, end

    def cpu_times():
        cpu.append((time.process_time(), sum(switch.cpu_times()[:2]) if switch else 0.0))

    start = time.monotonic()
    begin, end = start + warmup, start + warmup + seconds
    for s in ranks:
        s.send(list(range(slots)), start)
    next_check = start + rto
    while (now := time.monotonic()) < end:
        if not cpu and now >= begin:
            cpu_times()
        counting = now >= begin
        ready, _, _ = select.select(list(by_sock), [], [], 0.05)
        for sock in ready:
            s = by_sock[sock]
            freed = []
            for data in s.received():
                if data[0] != W.OP_RESULT or len(data) < _IMM_OFFSET + 8:
                    continue
                imm = _IMM.unpack_from(data, _IMM_OFFSET)[0]
                slot = (imm >> _SLOT[0]) & _SLOT[1]
                if slot >= slots or (imm >> _VERSION[0]) & 1 != s.use[slot] & 1:
                    continue                    # a late copy of an earlier use's result
                count = (imm >> _COUNT[0]) & _COUNT[1]
                want = s.rank + 1 if count == 1 else everyone if count == len(ranks) else None
                if _LANE.unpack_from(data, _IMM_OFFSET + 4)[0] != want:
                    errors += 1
                counted += counting
                s.use[slot] += 1
                freed.append(slot)
            s.send(freed, now)
        if now >= next_check:
            for s in ranks:
                due = [slot for slot in range(slots) if now - s.sent_at[slot] > rto]
                s.send(due, now)
                retransmissions += len(due)
            next_check = now + rto / 2
    cpu_times()
    if len(cpu) < 2:
        cpu.insert(0, cpu[0])
    senders_cpu, switch_cpu = (b - a for a, b in zip(*cpu))
    return {"contributions": counted, "seconds": seconds,
            "contributions_per_second": counted / seconds,
            "senders_cpu_seconds": senders_cpu, "switch_cpu_seconds": switch_cpu or None,
            "retransmissions": retransmissions, "errors": errors}
