"""The control channel: the switch's registers read and written by control requests, each
kept until its answer comes and retransmitted while it does not; and `SwitchControl`, the
switch's registers, parameters and counters over a channel of its own (the same code for a
simulated switch and a board), with its manager and its jobs' owners (who may write what:
`netagg.contract.regmap`).

A request carries 1..`wire.MAX_CONTROL_RECORDS` (address, value) records (bit 31 of the
address: write); more records go out as several requests, and the callback of
`request_async` gets the last one's answer. Its PSN is the endpoint's next (`PsnCounter`:
one sequence for control requests and an engine's contributions alike). The switch answers
to the sender with a SEND Only to `CONTROL_QPN` carrying the request's PSN and, per record,
the register's value after it was applied; the answer takes the pending request of its PSN,
and one for no pending request is counted (`ignored_control`) and dropped. A request waits
the round-trip estimate's RTO, at least 50 ms, for its answer, then is sent again with the
timeout doubled (up to `rto_max`); a blocking `request` gives up after `timeout` seconds
(`NetaggTimeout`). Control requests leave by path 0, where the answers come back.

The channel notes when the switch last answered and to what (`answered`: a request names
what it is, `what`, "a beat read" say), and since when a request has waited for an answer
(`asking`): what tells a switch that stopped answering (`host.liveness.SwitchWatch`). A
blocking `request` over UDP on a channel the switch has never answered gives up after
`FIRST_ANSWER_WITHIN` seconds of asking (`NetaggSwitchGone`): nothing serves at that
address, or the path to it is down, and a switch that is there answers a request in
milliseconds.

The channel works alone (`SwitchControl`: `step` receives and retransmits) or
inside an engine, which hands it the control answers among the packets it receives and
shares its PSNs, round-trip estimate and counters with it (the engine is then its `owner`,
what a blocking `request` steps while it waits).

Cost: one packet and its timer per request awaiting its answer.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Callable

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import transport as T
from netagg.host.errors import NetaggError, NetaggSwitchGone, NetaggTimeout
from netagg.host.retransmit import RetransmitTimer, RttEstimator

CONTROL_RTO_MIN = 0.05      # the shortest wait for a control answer, in seconds
# The longest a copy of a control request may take from its sending to the switch: the
# lossy transport holds a packet back at most its max_delay (0.02 s in the tests), a LAN
# microseconds.
CONTROL_LIFETIME = 0.1
# Seconds of asking without any answer after which a switch that never answered is not there
# (the liveness watch's silence, `host.liveness.SILENT_AFTER`).
FIRST_ANSWER_WITHIN = 2.0

Records = list[tuple[int, int]]


class PsnCounter:
    """The BTH.psn of each packet an endpoint sends: 1, 2, ... modulo 2**24."""

    def __init__(self):
        self.psn = 0

    def next(self) -> int:
        self.psn = (self.psn + 1) & 0xFFFFFF
        return self.psn

    def take(self, count: int) -> list[int]:
        """The next `count` PSNs."""
        first, self.psn = self.psn + 1, (self.psn + count) & 0xFFFFFF
        return [(first + i) & 0xFFFFFF for i in range(count)]


@dataclasses.dataclass
class PendingRequest:
    """A control request awaiting its answer: `callback(records)` gets the answer; `what`
    it is, for errors ("a beat read")."""

    datagram: bytes
    callback: Callable[[Records], None]
    timer: RetransmitTimer
    what: str = "a control request"


class ControlChannel:
    def __init__(self, transport, *, timeout: float = 20.0, psns: PsnCounter | None = None,
                 rtt: RttEstimator | None = None, stats: collections.Counter | None = None,
                 owner=None):
        self.transport = transport
        self.timeout = timeout          # how long `request` waits by default
        self.psns = PsnCounter() if psns is None else psns
        self.rtt = RttEstimator() if rtt is None else rtt
        self.stats = collections.Counter() if stats is None else stats
        self.owner = self if owner is None else owner
        self.pending: dict[int, PendingRequest] = {}     # by PSN
        self.answered = (-math.inf, "")     # when the switch last answered, and to what
        self.asking: float | None = None    # the first sending since then (None: none)

    def busy(self) -> bool:
        return bool(self.pending)

    def request_async(self, records, callback: Callable[[Records], None],
                      what: str = "a control request") -> int:
        """Send a control request (`what` it is, for errors); `callback(records)` gets the
        switch's answer. Returns the PSN of its (last) request."""
        records = list(records)
        for i in range(0, len(records), W.MAX_CONTROL_RECORDS):
            part = records[i:i + W.MAX_CONTROL_RECORDS]
            psn = self.psns.next()
            pkt = W.control_request(part, psn, self.transport.local, self.transport.switch)
            timer = RetransmitTimer()
            now = time.monotonic()
            timer.sent(now, self.rtt, CONTROL_RTO_MIN)
            cb = callback if i + W.MAX_CONTROL_RECORDS >= len(records) else (lambda r: None)
            self.pending[psn] = PendingRequest(pkt.datagram(), cb, timer, what)
            if self.asking is None:
                self.asking = now
            self.transport.send(self.pending[psn].datagram)
        return psn

    def forget(self, psn: int):
        """Stop waiting for (and retransmitting) the request of `psn`: a later one stands for
        it. Its answer, if it comes, is counted as `ignored_control`."""
        self.pending.pop(psn, None)

    def request(self, records, timeout: float | None = None, settle: bool = False) -> Records:
        """Send control records and wait for the answer: (address, value after) pairs.

        `settle`: the records must not be applied again once this returns (they undo what
        others write after them: a job's claim clears its slots and the other ranks'
        entries). The switch applies every copy of a request that reaches it, and a copy
        sent again because its answer was lost, or duplicated on the way, may still be on
        its way when an earlier copy's answer arrives; so a request sent more than once, or
        over a transport that duplicates, is waited out until CONTROL_LIFETIME after its
        last sending."""
        records = list(records)
        answers = []
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        settled = 0.0               # when no copy of the requests can reach the switch
        for i in range(0, len(records), W.MAX_CONTROL_RECORDS):
            box = []
            timer = self.pending[self.request_async(records[i:i + W.MAX_CONTROL_RECORDS],
                                                    box.append)].timer
            while not box:
                self._never_answered(time.monotonic())
                if time.monotonic() > deadline:
                    for psn in [p for p, c in self.pending.items() if c.callback == box.append]:
                        del self.pending[psn]
                    raise NetaggTimeout(
                        f"the switch at {self.transport.switch.ip} (via "
                        f"{getattr(self.transport, 'url', 'in-process')}) did not answer a "
                        f"control request within {limit:.1f} s")
                self._wait_a_little(0.01)
            answers += box[0]
            if settle and (timer.attempts > 1 or self.transport.duplicates):
                settled = max(settled, timer.last_at + CONTROL_LIFETIME)
        while time.monotonic() < settled:
            self._wait_a_little(0.01)
        return answers

    def _never_answered(self, now: float):
        """`NetaggSwitchGone` where the switch at a UDP address has answered nothing on
        this channel in `FIRST_ANSWER_WITHIN` seconds of asking; its requests are dropped.
        (In process the switch is there, if slow: the RTL under load; and a lossy
        transport may lose the first requests by design.)"""
        if self.answered[0] > -math.inf or self.asking is None or \
                now - self.asking < FIRST_ANSWER_WITHIN or \
                not isinstance(self.transport, T.UdpTransport):
            return
        silent = now - self.asking
        self.pending.clear()
        self.asking = None
        switch = self.transport.switch
        address = f"{switch.ip}:{switch.port}"
        raise NetaggSwitchGone(
            f"no switch answers at {address} (via "
            f"{getattr(self.transport, 'url', 'in-process')}): {silent:.1f} s of control "
            f"requests, none answered; nothing serves there, or the path to it is down",
            address, -1, -1, silent)

    def _wait_a_little(self, timeout: float):
        driver = self.transport.driver
        if driver is not None:
            driver.drive()
            if self.owner not in driver.engines:
                self.owner.step(0.0)
            time.sleep(0)
        else:
            self.owner.step(timeout)

    def take_answer(self, datagram: bytes) -> bool:
        """Whether a datagram (its ICRC checked) is a control answer (then it is taken: its
        request's callback gets the records, none if they do not parse)."""
        if datagram[:1] != W.CONTROL_FIRST_BYTE:
            return False
        try:
            pkt = W.parse_transport(datagram, icrc_checked=True)
        except W.WireError:
            return False
        if pkt.dqpn != W.CONTROL_QPN:
            return False
        pending = self.pending.pop(pkt.psn, None)
        self.asking = None
        if pending is None:
            self.answered = (time.monotonic(), "a request it had stopped waiting for")
            self.stats["ignored_control"] += 1
            return True
        self.answered = (time.monotonic(), pending.what)
        try:
            records = W.unpack_records(pkt.payload)
        except ValueError:
            records = []
        pending.callback(records)
        return True

    def deadlines(self) -> list[float]:
        return [c.timer.deadline for c in self.pending.values()]

    def retransmit(self, now: float):
        """Send again every request whose answer is late."""
        for c in list(self.pending.values()):
            if c.timer.due(now):
                c.timer.sent(now, self.rtt)
                self.stats["control_retransmissions"] += 1
                if self.asking is None:
                    self.asking = now
                self.transport.send(c.datagram)

    def step(self, timeout: float = 0.0):
        """Alone: take the answers that arrive within `timeout` (at most until the next
        retransmission), then retransmit what is late."""
        now = time.monotonic()
        deadline = min(self.deadlines(), default=now + 0.05)
        for datagram in self.transport.recv(min(timeout, max(0.0, deadline - now))):
            self.take_answer(datagram)
        self.retransmit(time.monotonic())

    def probe(self, records, within: float = 0.5) -> Records | None:
        """The answer to one request, reading the transport directly for up to `within`
        seconds (for an endpoint that is failing: whatever else arrives is dropped, and every
        pending request is forgotten afterwards); None without an answer."""
        box = []
        try:
            self.request_async(records, box.append)
            deadline = time.monotonic() + within
            while not box and time.monotonic() < deadline:
                for datagram in self.transport.recv(0.02):
                    self.take_answer(datagram)
        except Exception:
            pass
        finally:
            self.pending.clear()
        return box[0] if box else None


def read_params(control: ControlChannel) -> dict:
    """The switch's identity, size and own addresses, through the control path; `port` is the
    switch port the request came in by."""
    names = ("magic", "params", "slots", "max_payload", "mac_hi", "mac_lo", "ip", "udp_sport",
             "port")
    values = dict(zip(names, (v for _, v in control.request(
        [(a, 0) for a in (R.REG_MAGIC, R.REG_PARAMS, R.REG_SLOTS, R.REG_MAX_PAYLOAD,
                          R.REG_MAC_HI, R.REG_MAC_LO, R.REG_IP, R.REG_UDP_SPORT,
                          R.REG_PORT)]))))
    if values["magic"] != R.MAGIC:
        raise NetaggError(f"the switch answered with magic {values['magic']:#x}, not "
                          f"netagg's {R.MAGIC:#x}")
    params = R.PARAMS.unpack(values["params"])
    return {"ports": params["ports"], "jobs": params["jobs"],
            "max_workers": params["max_workers"], "width": 64 * params["width64"],
            "slots": values["slots"], "max_payload": values["max_payload"],
            "mac": values["mac_hi"] << 32 | values["mac_lo"], "ip": ip_str(values["ip"]),
            "udp_sport": values["udp_sport"], "port": values["port"]}


def make_transport(switch, ip: str | None, paths: int = 1, bind: str | None = None):
    if isinstance(switch, T.Transport):
        if paths != 1 and switch.paths != paths:
            raise ValueError(f"the transport given has {switch.paths} paths, not {paths}")
        return switch
    if isinstance(switch, str):
        return T.UdpTransport(switch, bind_ip=bind, paths=paths)
    if hasattr(switch, "send") and (hasattr(switch, "run") or isinstance(switch, T.InProcessHub)):
        return T.InProcessTransport(switch, ip=ip, paths=paths)
    raise TypeError(f"switch must be 'udp://host:port', a backend or a Transport, not {switch!r}")


class SwitchControl:
    """The switch's registers through control packets: the same code for the simulated and
    the real switch. `switch` as for `Worker`."""

    def __init__(self, switch, timeout: float = 5.0, ip: str = "10.0.255.254"):
        self.transport = make_transport(switch, ip)
        self.control = ControlChannel(self.transport, timeout=timeout)
        self.params = self.read_params()

    def read(self, *addresses) -> list[int]:
        return [v for _, v in self.control.request([(a, 0) for a in addresses])]

    def write(self, pairs) -> list[int]:
        """Write (address, value) pairs; returns the values read back."""
        return [v for _, v in self.control.request([(a | R.WRITE, v) for a, v in pairs])]

    def read_params(self) -> dict:
        return read_params(self.control)

    def manager(self) -> str | None:
        """The switch's manager's address (REG_MANAGER), None while it has none."""
        [value] = self.read(R.REG_MANAGER)
        return ip_str(value) if value else None

    def set_manager(self, ip: str | None = None):
        """Make `ip` (default: this end's address) the switch's manager; NetaggError if
        another address is (only it may change REG_MANAGER)."""
        value = W.ip_to_int(ip or self.transport.local.ip)
        [back] = self.write([(R.REG_MANAGER, value)])
        if back != value:
            raise NetaggError(f"the switch's manager is {ip_str(back)}: only it may change "
                              f"REG_MANAGER")

    def owners(self) -> dict[int, str | None]:
        """Each job's owner's address (JOB_OWNER: whose request enabled it), None while it is
        disabled."""
        values = self.read(*(R.job_reg(j, R.JOB_OWNER) for j in range(self.params["jobs"])))
        return {j: ip_str(v) if v else None for j, v in enumerate(values)}

    def release(self, job: int):
        """Disable `job` (from its owner or the switch's manager): another address may then
        set it up. NetaggError if the switch refuses (naming the owner)."""
        config, owner = (v for _, v in self.control.request(
            [(R.job_reg(job, R.JOB_CONFIG) | R.WRITE, 0), (R.job_reg(job, R.JOB_OWNER), 0)]))
        if config >> 31:
            raise NetaggError(f"job {job} is enabled by {ip_str(owner)}: the switch refused "
                              f"this host's ({self.transport.local.ip}) write of its CONFIG; "
                              f"only its owner or the switch's manager may disable it")

    def counters(self, ports=None, jobs=None) -> dict:
        """Port and job counters, by name."""
        ports = range(self.params["ports"]) if ports is None else ports
        jobs = range(self.params["jobs"]) if jobs is None else jobs
        out = {"ports": {}, "jobs": {}}
        for p in ports:
            vals = self.read(*[R.port_counter(p, n) for n in R.PORT_COUNTERS])
            out["ports"][p] = dict(zip(R.PORT_COUNTERS, vals))
        for j in jobs:
            vals = self.read(*[R.job_counter(j, n) for n in R.JOB_COUNTERS])
            out["jobs"][j] = dict(zip(R.JOB_COUNTERS, vals))
        return out

    def close(self):
        self.transport.close()


def ip_str(ip: int) -> str:
    return ".".join(str((ip >> s) & 0xFF) for s in (24, 16, 8, 0))
