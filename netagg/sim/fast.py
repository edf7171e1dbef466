"""The fast switch: the golden model's switch, its common contribution compiled.

`FastSwitch` is `sim.golden.GoldenSwitch` (the specification) with its slot copies, its job
table as the compiled core reads it and its counters in flat numpy arrays, and a C++ core
(`netagg/sim/cpp/fast_switch.h`, built by `sim.fast_build`, the GIL released) that takes the common
frame. Everything else is the golden model's own code, on the same arrays: the control path
(registers, job table, keys, owners, heartbeats, the manager), the parser's drops, the job
table's refusals, forced priority decisions. The differential fuzzer holds it to the golden
model frame for frame (`netagg fuzz --against fast`).

What the C++ takes, row by row of a run of frames of one length in at one port
(`send_run`, or `send` for one frame): a contribution the parser passes (no pad; the ICRC
checked) that its queue holds, of an enabled job, its length, rank, source address, key and
slot the job's. It counts it on its port, nulls it by priority where its class's drop
threshold is 0, and applies the rest of the golden model's steps 5 and 6: the credit
(`drop_credit`), a new use, an add (saturating int32 lanes, the exponent's maximum, the
overflow flag), a duplicate, a stale message, a replay, a wrong length, a use closed late at
its deadline, the use completed at its quorum; and writes every result from its worker's
template (lengths, IPv4 checksum, BTH.psn, RETH, ImmDt, sums, ICRC). At the first row that
is not such a contribution it stops, before changing anything for it; the row goes through
the golden model's `receive`, and the C++ goes on from the row after it. What it drops it
counts as the golden model does; nothing else is dropped.

The C++ reads the job table from arrays that `_refresh` writes from the golden model's
`Job` and `Worker` objects after any register write (a control request's, `write`'s), and
the deadlines' clock (`tick`) at each call; COMPLETED goes both ways at each call.

`run` returns the frames sent since the last `run` or `sent_runs`, in the golden model's
order; `sent_runs` returns each call's results as one `netagg.host.udp_offload.FrameRun` per
destination (its results in order), for `sim serve` to send as GSO runs.

Cost: one C++ call a run (a few microseconds) and, per contribution, its ICRC and one pass
over its lanes; per result a copy of the template, its lanes and its ICRC.
"""

from __future__ import annotations

import collections.abc
import ctypes
import dataclasses

import numpy as np

from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import cpp_build
from netagg.host.udp_offload import FrameRun
from netagg.sim import fast_build
from netagg.sim.fast_build import JOB_WORDS, TEMPLATE_BYTES, WORKER_WORDS, State, Stop
from netagg.sim.golden import GoldenSwitch, Job, SlotCopy, copy_field

_COMPLETED = JOB_WORDS.index("completed")
ARENA_BYTES = 4 << 20       # the buffer the C++ writes the frames it sends into, a call after
                            # another (a new one when it is full)


class SlotCopies:
    """Every slot copy, `SlotCopy`'s fields as arrays over copies numbered slot index * 2 +
    version; the sums as int64 lanes that hold saturated int32 sums, as the golden model's."""

    FIELDS = tuple(f.name for f in dataclasses.fields(SlotCopy) if f.name != "sums")

    def __init__(self, slots: int, lanes: int):
        for name in self.FIELDS:
            setattr(self, name, np.zeros(2 * slots, np.int64))
        self.sums = np.zeros((2 * slots, lanes), np.int64)

    def clear(self, first_slot: int, end_slot: int):
        """The copies of slots first_slot .. end_slot - 1 back to fresh."""
        span = slice(2 * first_slot, 2 * end_slot)
        for name in self.FIELDS:
            getattr(self, name)[span] = 0
        self.sums[span] = 0


class CopyView:
    """One copy of a `SlotCopies`, read and written as the golden model's code reads and
    writes a `SlotCopy`; equal to a `SlotCopy` with the same fields."""

    __slots__ = ("copies", "c")
    bitmap, count, data = copy_field("bitmap"), copy_field("count"), copy_field("data")
    length, msn16, exponent = copy_field("length"), copy_field("msn16"), copy_field("exponent")
    overflow, begun = copy_field("overflow", bool), copy_field("begun")

    def __init__(self, copies: SlotCopies, c: int):
        self.copies, self.c = copies, c

    @property
    def sums(self) -> np.ndarray | None:
        """Its lanes (a view: the golden model adds into it), None for a fresh copy."""
        if not self.copies.bitmap[self.c]:
            return None
        return self.copies.sums[self.c, :self.length // 4]

    def begin(self, bit: int, sums: np.ndarray, null: bool, msn: int, exponent: int,
              now: int):
        c, copies = self.c, self.copies
        copies.bitmap[c], copies.count[c], copies.data[c] = bit, 1, int(not null)
        copies.length[c], copies.msn16[c] = 4 * len(sums), msn & 0xFFFF
        copies.exponent[c], copies.overflow[c], copies.begun[c] = exponent, 0, now
        copies.sums[c, :len(sums)] = sums

    def __eq__(self, other):
        if not isinstance(other, (SlotCopy, CopyView)):
            return NotImplemented
        for name in (*SlotCopies.FIELDS, "sums"):
            a, b = getattr(self, name), getattr(other, name)
            same = np.array_equal(a, b) if a is not None and b is not None else a is b
            if not same:
                return False
        return True

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in SlotCopies.FIELDS)
        return f"CopyView({fields})"


class Counters(collections.abc.MutableMapping):
    """A port's or a job's counters by name, over a row of an int64 array (the C++ counts
    into the same row)."""

    __slots__ = ("row", "index")

    def __init__(self, row: np.ndarray, names):
        self.row, self.index = row, {name: i for i, name in enumerate(names)}

    def __getitem__(self, name: str) -> int:
        return int(self.row[self.index[name]])

    def __setitem__(self, name: str, value: int):
        self.row[self.index[name]] = value

    def __delitem__(self, name: str):
        raise TypeError("a switch's counters are fixed")

    def __iter__(self):
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


@dataclasses.dataclass
class Paths:
    """How many calls of the C++ there were, the rows it took, and the frames the golden
    model's `receive` took."""

    calls: int = 0
    compiled: int = 0
    golden: int = 0


class Results:
    """The frames one call of the C++ sent: rows of `frames` (whole frames, of one length)
    and, beside each, its port and its destination (job * max_workers + rank)."""

    __slots__ = ("frames", "sent")

    def __init__(self, frames: np.ndarray, sent: np.ndarray):
        self.frames, self.sent = frames, sent

    def pairs(self) -> list[tuple[int, bytes]]:
        return [(port, row.tobytes()) for port, row in zip(self.sent[:, 0].tolist(),
                                                           self.frames)]

    def runs(self) -> list[FrameRun]:
        """One `FrameRun` per destination, its frames in the order they were sent."""
        n, dest = len(self.sent), self.sent[:, 1]
        order = np.argsort(dest, kind="stable") if n > 1 else np.zeros(1, np.intp)
        datagrams = self.frames[order, W.BTH_OFFSET:]
        size = datagrams.shape[1]
        ends = [*(np.flatnonzero(np.diff(dest[order])) + 1).tolist(), n]
        out, first = [], 0
        for end in ends:
            row = int(order[first])
            out.append(FrameRun(int(self.sent[row, 0]),
                                self.frames[row, :W.BTH_OFFSET].tobytes(),
                                memoryview(datagrams[first:end].reshape(-1)), size))
            first = end
        return out


class FastSwitch(GoldenSwitch):
    """The fast switch; parameters as `GoldenSwitch`'s. `RuntimeError` where its C++ cannot
    be built or loaded (`sim.fast_build.unavailable()` says why)."""

    def __init__(self, *args, **kwargs):
        lib = fast_build.library()
        if lib is None:
            raise RuntimeError("the fast switch needs its compiled core (sim/cpp/fast.cpp): "
                               f"{fast_build.unavailable()}")
        super().__init__(*args, **kwargs)
        lanes = self.max_payload // 4
        self.copies = SlotCopies(self.slots, lanes)
        self.state = [[CopyView(self.copies, 2 * s), CopyView(self.copies, 2 * s + 1)]
                      for s in range(self.slots)]
        self._port_counts = np.zeros((self.ports, len(R.PORT_COUNTERS)), np.int64)
        self._job_counts = np.zeros((self.jobs, len(R.JOB_COUNTERS)), np.int64)
        self.port_counters = [Counters(row, R.PORT_COUNTERS) for row in self._port_counts]
        self.job_counters = [Counters(row, R.JOB_COUNTERS) for row in self._job_counts]
        self._table = np.zeros((self.jobs, len(JOB_WORDS)), np.int64)
        self._workers = np.zeros((self.jobs, self.max_workers, len(WORKER_WORDS)), np.int64)
        # each job's workers' result headers (their templates' heads), as the C++ reads them
        self.result_heads = np.zeros((self.jobs, self.max_workers, TEMPLATE_BYTES), np.uint8)
        self._thresholds = np.zeros(R.PRIORITY_CLASSES, np.int64)
        self._most = 1                  # the most results one contribution sends
        c = self.copies
        self.core = State(                  # the C++'s arguments: its arrays, and a call's
            ports=self.ports, jobs=self.jobs, max_workers=self.max_workers, slots=self.slots,
            max_payload=self.max_payload, queue_capacity=self.queue_capacity, lanes=lanes,
            crc32=cpp_build.crc32_address(), thresholds=self._thresholds.ctypes.data,
            job=self._table.ctypes.data, worker=self._workers.ctypes.data,
            templates=self.result_heads.ctypes.data,
            **{name: getattr(c, name).ctypes.data for name in SlotCopies.FIELDS},
            sums=c.sums.ctypes.data, port_counters=self._port_counts.ctypes.data,
            job_counters=self._job_counts.ctypes.data)
        self._pointer = ctypes.pointer(self.core)
        self._run = lib.fast_run
        self._arenas(0, 0)
        self._stale = True
        self.generation = 0             # how many times the C++'s table was written
        self._sent: list = []
        self.paths = Paths()

    # --- the backend interface ------------------------------------------------------------

    def send(self, port: int, frame: bytes, fill: int = 0, null: bool | None = None):
        """Apply a frame at once; `run` returns what it sent. A frame with a queue `fill` or
        a forced priority decision goes through the golden model's `receive`."""
        frame = bytes(frame)
        if fill or null is not None or not 0 <= port < self.ports or len(frame) <= W.BTH_OFFSET:
            self.golden(port, frame, fill, null)
            return
        self._take(port, frame, frame[W.BTH_OFFSET:], len(frame) - W.BTH_OFFSET, 1,
                   lambda i: frame)

    def send_run(self, port: int, heads, body, size: int):
        """Apply a run of frames at once, in order: frame i is `heads[i]` (its Ethernet,
        IPv4 and UDP headers, `W.BTH_OFFSET` bytes) and the datagram at `i * size` in `body`
        (BTH .. ICRC); `sent_runs` returns what it sent."""
        heads = tuple(heads)
        joined, rows = b"".join(heads), len(heads)
        if not isinstance(body, bytes) or len(body) != rows * size:
            body = bytes(memoryview(body).cast("B")[:rows * size])

        def frame(i: int) -> bytes:
            return heads[i] + body[i * size:(i + 1) * size]

        if (not rows or not 0 <= port < self.ports or len(joined) != rows * W.BTH_OFFSET
                or len(body) != rows * size):
            for i in range(rows):
                self.golden(port, frame(i))
            return
        self._take(port, joined, body, size, rows, frame)

    def run(self) -> list:
        out, self._sent = self._sent, []
        return [pair for item in out
                for pair in (item.pairs() if isinstance(item, Results) else (item,))]

    def sent_runs(self) -> list:
        """What `run` returns, but each call's results as one `FrameRun` per destination."""
        out, self._sent = self._sent, []
        return [run for item in out
                for run in (item.runs() if isinstance(item, Results) else (item,))]

    # --- the golden model's, kept in step with the arrays ----------------------------------

    def write(self, addr: int, value: int):
        super().write(addr, value)
        self._stale = True                  # the C++'s table comes from the registers

    def _clear(self, job: Job):
        deferred = self._cleared is not None        # to the end of the control request
        job.completed = 0
        if deferred:
            super()._clear(job)
        elif job.enable:                            # a disabled job's range is no one's
            self.copies.clear(job.slot_base, min(job.slot_base + job.slot_count, self.slots))
        self._stale = True

    def receive(self, port: int, frame: bytes, fill: int = 0,
                null: bool | None = None) -> list:
        """The golden model's `receive`; COMPLETED to the C++'s table after it."""
        out = super().receive(port, frame, fill, null)
        self._table[:, _COMPLETED] = [job.completed for job in self.job]
        return out

    def golden(self, port: int, frame: bytes, fill: int = 0, null: bool | None = None):
        """A frame through the golden model's `receive`."""
        self.paths.golden += 1
        self._sent += self.receive(port, frame, fill, null)

    def sync_table(self):
        """The C++'s job table up to date with the registers (after any write)."""
        if self._stale:
            self._refresh()

    def _refresh(self):
        """The C++'s job table from the registers: each job's and each worker's row, the
        result templates of the enabled jobs' workers, the drop thresholds."""
        self._table[:] = [[job.enable, job.workers, job.slot_base, job.slot_count, job.credits,
                           job.needed, job.key, job.deadline, job.completed]
                          for job in self.job]
        for j, job in enumerate(self.job):
            self._workers[j] = [[w.port, w.ip, _int64(w.va), w.rkey] for w in job.table]
            for rank in range(job.workers if job.enable else 0):
                self.result_heads[j, rank] = np.frombuffer(
                    self.result_template(job.table[rank], 0).head, np.uint8)
        self._thresholds[:] = self.drop_thresholds
        self._most = max([job.workers for job in self.job if job.enable] + [1])
        self._stale = False
        self.generation += 1

    def sync_completed(self):
        """COMPLETED from the C++'s table to the golden model's jobs, after the C++ took
        rows."""
        for job, completed in zip(self.job, self._table[:, _COMPLETED].tolist()):
            job.completed = completed

    # --- the C++ --------------------------------------------------------------------------

    def _take(self, port: int, heads: bytes, body: bytes, size: int, rows: int, frame):
        """Rows of a run through the C++, from the first; a row it hands back through the
        golden model's `receive` (`frame(i)`: row i's frame), and the rest through the C++
        again."""
        st, at, frame_bytes = self.core, 0, W.BTH_OFFSET + size
        st.port, st.rows, st.size = port, rows, size
        while at < rows:
            self.sync_table()
            most = (rows - at) * self._most
            if self._out_at + most * frame_bytes > len(self._out) or \
                    self._sent_at + most > len(self._records):
                self._arenas(most * frame_bytes, most)
            st.first, st.now, st.out_rows = at, self.now, most
            st.out = self._out_base + self._out_at
            st.sent = self._records_base + 16 * self._sent_at
            stop = self._run(self._pointer, heads, body)
            self.paths.calls += 1
            self.paths.compiled += st.taken - at
            n = st.results
            if n:
                frames = self._out[self._out_at:self._out_at + n * frame_bytes]
                self._sent.append(Results(frames.reshape(n, frame_bytes),
                                          self._records[self._sent_at:self._sent_at + n]))
                self._out_at += n * frame_bytes
                self._sent_at += n
            if st.taken > at:
                self.sync_completed()
            at = st.taken
            if stop == Stop.GOLDEN:
                self.golden(port, frame(at))
                at += 1
            elif stop == Stop.FULL and not n:
                raise RuntimeError("the fast switch's results do not fit its buffer")

    def _arenas(self, frame_bytes: int, rows: int):
        """New buffers for the frames the C++ sends (the frames sent before stay where they
        are, for as long as something holds them)."""
        self._out = np.empty(max(ARENA_BYTES, frame_bytes), np.uint8)
        self._records = np.empty((max(ARENA_BYTES // 256, rows), 2), np.int64)
        self._out_base, self._records_base = self._out.ctypes.data, self._records.ctypes.data
        self._out_at = self._sent_at = 0


def _int64(v: int) -> int:
    """A 64-bit register's value as the int64 that holds its bits."""
    return v - (1 << 64) if v >> 63 else v
