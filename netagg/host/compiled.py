"""The plain window's steady state, compiled: `CompiledStep` runs a `PlainWindow`'s steps in
C++ (`netagg/host/cpp/step.cpp`, built by `host.compiled_build`) with the GIL released, over the
worker's UDP socket, for as long as every step is the plain case.

A call (`CompiledStep.run`, from `PlainWindow.start`) hands the C++ the window's own state
arrays, the span its messages in flight and next belong to, and every number of the wire
it needs, taken from their Python declarations (the writer's template, ICRC states and
layout, the ImmDt fields, the check lane's tags, sealed lanes and complete check lanes for
each slot's next uses, computed here by `host.checklane`). The C++ then starts slots,
sends GSO runs, waits for results, takes and writes them, step after step, until one of
`Status`; it leaves the arrays as the window's Python would have. Here, afterwards, the
engine's counters, its credit limit, PSNs and round-trip estimate, the work's exponents
and finished chunks are brought up to date, and what the C++ stopped at is handed to the
Python path: a datagram it did not take, and the rest of the runs it received with it
(`rx_runs`), go through the transport's reading and the engine's `receive` (which
may leave the window), a non-finite block leaves the window, a due message is the
engine's `_retransmit`'s, the rest the next Python step's. A heartbeat
or a read of the beats that falls due (`host.liveness`) is sent between two calls, and the
run goes on: it costs a return to Python, not a Python step.

It runs only where it can: a `UdpTransport` of one path, a span of one work whose
sources and tensor are contiguous arrays of a format it carries (int32, float32, float16
where the compiler has `_Float16`, bfloat16 as uint16 or int16 bits), and the library
built (`host.compiled_build.library`; NETAGG_COMPILED=0 turns it off). Counters:
`compiled_runs`, `compiled_packets` (sent by the C++).

Cost: per call a few dozen Python operations (the window's array addresses are kept
between calls); per full window of 64 packets about one wait for the socket and three
system calls in the C++.
"""

from __future__ import annotations

import ctypes
import functools
import ipaddress
import time

import numpy as np

from netagg.contract import wire as W
from netagg.host import numerics as N
from netagg.host import udp_offload
from netagg.host.compiled_build import RX_RUNS, Fmt, Run, Status, library
from netagg.host.cpp_build import crc32_address
from netagg.host.progress import wanted
from netagg.host.retransmit import REORDER_SHARE, probe_timeout
from netagg.host.transport import UdpTransport
from netagg.host.wire_arrays import write_imm_dtype

RUN_SECONDS = 0.25      # the longest a call runs (the engine's checks wait at most this)
SAMPLES = 32            # round-trip samples a call keeps (its latest: an average's weight)
RX_BYTES = 65536        # a run's part of the receive buffer: the largest GRO run

# the window's arrays the C++ reads and writes: (`PlainWindow` attribute, `Run` field)
_WINDOW_ARRAYS = [(name, name) for name in ("next", "cur", "use", "cur_use", "tag", "whole",
                                            "last_psn", "sent_at", "deadline", "attempts")]
_WINDOW_ARRAYS.append(("rto", "rtos"))
_FORMATS = {N.INT32: Fmt.INT32, N.FLOAT32: Fmt.FLOAT32, N.FLOAT16: Fmt.FLOAT16,
            N.BFLOAT16: Fmt.BFLOAT16}
_DTYPES = {Fmt.INT32: ("int32",), Fmt.FLOAT32: ("float32",), Fmt.FLOAT16: ("float16",),
           Fmt.BFLOAT16: ("uint16", "int16")}


@functools.lru_cache(maxsize=64)
def _ip(address: str) -> int:
    return int(ipaddress.IPv4Address(address))


def _addr(array: np.ndarray) -> int:
    return array.ctypes.data


def carries(work) -> Fmt | None:
    """The format the compiled step carries `work` in, None if it does not."""
    lib = library()
    fmt = _FORMATS.get(work.fmt)
    if lib is None or fmt is None or (fmt is Fmt.FLOAT16 and not lib.step_float16()):
        return None
    arrays = [*work.sources, work.out]
    if len(work.sources) > 8 or any(a.ndim != 1 or not a.flags.c_contiguous
                                    or a.dtype.name not in _DTYPES[fmt] for a in arrays):
        return None
    return fmt


def block_proposals(values: np.ndarray, fmt: N.Format, per: int) -> np.ndarray:
    """`numerics.block_proposals` in one compiled pass over the values (`step_block_top`:
    the largest magnitude of each block, by the bits), where the library is built and the
    values are a contiguous 1-D array of a float format it carries; else numerics'."""
    lib = library()
    kind = _FORMATS.get(fmt)
    if lib is None or kind in (None, Fmt.INT32) or values.ndim != 1 or not len(values) \
            or not values.flags.c_contiguous or values.dtype.name not in _DTYPES[kind]:
        return N.block_proposals(values, fmt, per)
    top = np.empty(-(-len(values) // per))
    lib.step_block_top(_addr(values), int(kind), len(values), per, _addr(top))
    return N.proposals_of(top)


class CompiledStep:
    """The compiled step of one `PlainWindow` (`window`), over its engine's UDP transport."""

    @staticmethod
    def of(window) -> CompiledStep | None:
        e = window.engine
        if library() is None or not isinstance(e.transport, UdpTransport) \
                or e.transport.paths != 1 or window.slots > W.MAX_SLOTS:
            return None
        return CompiledStep(window)

    def __init__(self, window):
        self.window = w = window
        e = self.engine = w.engine
        t = self.transport = e.transport
        self.lib = library()
        self.size = size = write_imm_dtype(e.lanes).itemsize
        n = w.slots
        self.packets = np.zeros((n, size), np.uint8)        # each slot's datagram in flight
        self.rx = np.zeros(RX_RUNS * RX_BYTES, np.uint8)
        self.rx_runs = np.zeros((RX_RUNS, 5), np.int64)     # (at, length, segment, ip, port)
        self.samples = np.zeros(SAMPLES)
        self.started = np.zeros(n, np.uint8)
        self.deltas = np.ascontiguousarray(udp_offload.ident_deltas(size), np.uint32)
        self.tx_head = np.ascontiguousarray(e.writer.bth_head, np.uint8)
        self.rx_head = np.frombuffer(W.bth(W.OP_RESULT, e.qpn, 0)[:8], np.uint8).copy()
        self.tag_base = np.zeros(n, np.int64)
        self.tag_table = self.seal_table = self.whole_table = np.zeros((n, 1), np.int64)
        self.rows = [memoryview(row) for row in self.packets]  # (`window.packets`' items)
        self.rx_head_bytes = self.rx_head.tobytes()
        self.span = self.fmt = None
        self.window_arrays: dict[str, tuple] = {}          # name: (array, its address)
        self.sources = np.zeros(8, np.int64)
        self.wanted = wanted(e)             # threads waiting for the engine: return
        self.r = r = Run()
        r.wanted = _addr(self.wanted)
        fields = write_imm_dtype(e.lanes).fields
        for name in ("psn", "va", "rkey", "lanes", "icrc"):
            setattr(r, f"off_{name}", fields[name][1])
        r.off_dma, r.off_imm = fields["dma_length"][1], fields["data"][1]
        r.size, r.lanes = size, e.lanes
        request = {name: shift for name, shift, _ in W.REQUEST_IMM}
        r.sh_version, r.sh_slot = request["version"], request["slot"]
        r.sh_exponent = request["exponent"]
        result = {name: (shift, (1 << width) - 1) for name, shift, width in W.RESULT_IMM}
        for name in ("job", "count", "version", "slot", "exponent", "overflow"):
            shift, mask = result[name]
            setattr(r, f"rs_{name}", shift)
            setattr(r, f"rm_{name}", mask)
        r.exp_sign = (result["exponent"][1] + 1) >> 1
        r.exp_mask = result["exponent"][1]
        r.va_msn_shift, r.va_offset_mask = W.VA_MSN_SHIFT, W.VA_OFFSET_MASK
        r.msn_mask, r.psn_mask = 0xFFFFFFFF, 0xFFFFFF
        r.int32_max, r.exp_none, r.exp_nonfinite = N.INT32_MAX, N.EXP_NONE, N.EXP_NONFINITE
        r.bf16_nan = N.BFLOAT16_NAN
        r.sol_udp, r.udp_segment, r.udp_gro = (ctypes.c_int(17).value, udp_offload.UDP_SEGMENT,
                                               udp_offload.UDP_GRO)
        r.crc32 = crc32_address()
        r.dst_ip, r.dst_port = _ip(t.switch.ip), t.switch.port
        r.per_run = udp_offload.most_rows(size)
        for name, array in (("deltas", self.deltas), ("tx_head", self.tx_head),
                            ("rx_head", self.rx_head), ("packets", self.packets),
                            ("rx", self.rx), ("rx_runs", self.rx_runs),
                            ("samples", self.samples), ("started", self.started),
                            ("tag_base", self.tag_base), ("sources", self.sources)):
            setattr(r, name, _addr(array))
        r.rx_cap, r.samples_cap = RX_BYTES, SAMPLES
        r.job, r.nslots, r.workers = e.job, n, e.workers

    # --- a call -------------------------------------------------------------------------

    def _span(self):
        """The span every message in flight and every next message belongs to, if one and
        if no exponent message is next."""
        w = self.window
        free = (w.cur < 0) & (w.next < w.total)
        active = np.concatenate([w.cur[w.cur >= 0], w.next[free]])
        if not len(active):
            return None
        lo, hi = int(active.min()), int(active.max())
        for span in w.spans:
            if span.first <= lo and hi < span.first + span.count:
                # an exponent message to start is the Python window's (the C++ would
                # return at once)
                exponent = (w.next[free] < span.first + span.leading).any()
                return None if exponent else span
        return None

    def run(self, now: float):
        """Run steps in C++ while they are plain (see the module): again after a datagram
        it handed over or a heartbeat that fell due, for up to `RUN_SECONDS` in all, until
        it stops for something else."""
        w, e, t = self.window, self.engine, self.transport
        end = now + RUN_SECONDS
        while e.window is w and not self.wanted[0]:
            if e.liveness.next_due <= now:      # a beat or a read of the beats: sent here,
                e.liveness.watch(e, now)        # and the run goes on (its answer is handed)
            until = min(e.liveness.next_due, end, *e.control.deadlines())
            span = self._span()
            fmt = span and (self.fmt if span is self.span else carries(span.work))
            if until <= now or fmt is None:
                return
            self._enter(span, fmt, until)
            status = self._call()
            while status is Status.TAGS:
                self._tags()
                status = self._call()
            self._leave(span)
            if status is Status.NONFINITE:
                w.leave()
            now = time.monotonic()
            if status is Status.UNTIL:          # (a beat due: sent above; else it returns)
                continue
            if status is not Status.HANDED:
                return
            r, datagrams = self.r, []
            for i in range(r.rx_run, r.rx_nruns):      # the datagram not taken, and after
                at, length, segment, ip, port = self.rx_runs[i].tolist()
                data = bytes(self.rx[r.rx_from if i == r.rx_run else at:at + length])
                datagrams += t.accept(data, segment or None,
                                      (str(ipaddress.IPv4Address(ip)), port))
            if datagrams:
                e.receive(datagrams)

    def adopt(self, span, fmt: Fmt):
        """Take `span` as the one the next calls run: its arrays, its tensors' addresses,
        its DSCP and the check lane's tags from each slot's next use on (`PlainWindow.lead`
        has the caller's thread do it at submission; else the first call of the span)."""
        r, t = self.r, self.transport
        if span is not self.span:
            self.span, self.fmt, work = span, fmt, span.work
            for b, x in work.exponents.items():     # (the span's own record of them)
                span.known[b], span.shared[b] = True, x
            self.arrays = [np.ascontiguousarray(getattr(span, name), np.int64)
                           for name in ("chunk", "needs", "carries", "field", "offset")]
            for name, array in zip(("chunk", "needs", "carries", "field", "offset"),
                                   self.arrays):
                setattr(r, name, _addr(array))
            r.first, r.count, r.leading = span.first, span.count, span.leading
            r.known, r.shared = _addr(span.known), _addr(span.shared)
            r.fmt, r.nsources = int(fmt), len(work.sources)
            self.sources[:len(work.sources)] = [_addr(s) for s in work.sources]
            r.out, r.n, r.frac = _addr(work.out), work.n, work.frac
            r.mean, r.world_size = int(work.mean), work.world_size
            t.set_dscp(0, int(span.dscp[-1]))
            self._tags()

    def _enter(self, span, fmt: Fmt, until: float):
        w, e, r, t = self.window, self.engine, self.r, self.transport
        self.adopt(span, fmt)
        writer = e.writer
        r.fd = t.sock.fileno()
        r.gso, r.renumber = int(t.runs.gso), int(t.runs.renumber)
        r.result_ip, r.result_port = _ip(t.result_source.ip), t.result_source.port
        r.tx_state, r.imm_base, r.key = writer.icrc_state(0, e.lanes), writer.imm, writer.key
        r.rx_state = t.icrc.state_of((t.result_source.ip, t.result_source.port),
                                    self.size - W.ICRC_LEN, self.rx_head_bytes)
        r.rkey = e.session_tag
        known = self.window_arrays
        for name, field in _WINDOW_ARRAYS:
            array = getattr(w, name)
            cached = known.get(name)
            if cached is None or cached[0] is not array:
                cached = known[name] = (array, _addr(array))
                setattr(r, field, cached[1])
        r.total, r.dealt, r.credits, r.limit = w.total, w.dealt, e.credits, e.limit
        r.rto, r.psn, r.until = e.rtt.rto, e.psns.psn, until
        srtt, recent = e.rtt.srtt, e.recent     # (`host.retransmit.RecentAnswer`'s rules)
        r.reorder = REORDER_SHARE * srtt if srtt is not None else np.inf
        r.pto = (probe_timeout(e.rtt, recent.lossy(time.monotonic())) if srtt is not None
                 else np.inf)
        r.newest, r.heard, r.probed = recent.newest, recent.heard, recent.probed
        self.known_before = span.known.copy()
        for name in ("packets_sent", "packets_received", "credit_waits", "tensor_bytes",
                     "chunks_done", "nsamples", "rx_nruns", "rx_run", "rx_from", "gso_failed",
                     "gso_runs"):
            setattr(r, name, 0)
        r.max_inflight, r.progress_at = e.stats["max_inflight"], 0.0

    def _tags(self):
        """Each slot's check-lane tags from its next use on, for the span's remaining
        messages (`CheckLane.tags`), sealed and complete (`seal`, `whole`)."""
        w, e, r = self.window, self.engine, self.r
        cols = max(2, -(-(self.span.first + self.span.count - int(w.next.min())) // w.slots)
                   + 2)
        self.tag_base[:] = w.use
        uses = self.tag_base[:, None] + np.arange(cols)
        tags = e.check_lane.tags(np.repeat(np.arange(w.slots), cols), uses.ravel())
        # (use - tag_base, slot) order: the slots a step starts are at one use, side by side
        self.tag_table = np.ascontiguousarray(tags.reshape(w.slots, cols).T)
        self.seal_table = np.ascontiguousarray(e.check_lane.seal(self.tag_table, e.rank),
                                               np.int64)
        self.whole_table = np.ascontiguousarray(e.check_lane.whole(self.tag_table), np.int64)
        r.tag_cols = cols
        r.tag_table, r.seal_table = _addr(self.tag_table), _addr(self.seal_table)
        r.whole_table = _addr(self.whole_table)

    def _call(self) -> Status:
        return Status(self.lib.step_run(ctypes.byref(self.r)))

    def _leave(self, span):
        """The engine's counters and state after a call (see the module)."""
        w, e, r = self.window, self.engine, self.r
        stats = e.stats
        stats["compiled_runs"] += 1
        if r.packets_sent:
            stats["compiled_packets"] += r.packets_sent
            stats["packets_sent"] += r.packets_sent
            stats["bytes_sent"] += r.packets_sent * self.size
        if r.packets_received:
            e.heard = time.monotonic()      # (the switch answered within the run)
            stats["packets_received"] += r.packets_received
            stats["bytes_received"] += r.packets_received * self.size
        for name in ("credit_waits", "tensor_bytes"):
            if getattr(r, name):
                stats[name] += getattr(r, name)
        stats["max_inflight"] = max(stats["max_inflight"], r.max_inflight)
        if r.gso_failed:
            self.transport.runs.gso = False
        self.transport.runs.runs += r.gso_runs     # (the worker's `gso_runs` counter)
        e.psns.psn = r.psn
        e.recent.newest, e.recent.heard, e.recent.probed = r.newest, r.heard, bool(r.probed)
        e.limit = max(e.limit, r.limit)
        for i in range(max(0, r.nsamples - SAMPLES), r.nsamples):     # the latest, in order
            e.rtt.sample(float(self.samples[i % SAMPLES]))
        if r.progress_at:
            e.last_progress = max(e.last_progress, r.progress_at)
        for s in np.flatnonzero(self.started).tolist():
            w.packets[s] = self.rows[s]
        self.started[:] = 0
        for b in np.flatnonzero(span.known != self.known_before).tolist():
            span.work.exponents[b] = int(span.shared[b])
        if r.chunks_done:
            e.finish_chunks(span.work, r.chunks_done)
            if span.work.done:
                w.spans = [s for s in w.spans if not s.work.done]
                self.span = None
        e.earliest = min(e.earliest, w.due_at())
