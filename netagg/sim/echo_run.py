"""The echo switch's run path: a run of contributions answered in a few array operations.

`answer(switch, port, heads, body, size)` takes a run of frames of one length: frame i is
`heads[i]` (Ethernet, IPv4, UDP) and the datagram at `i * size` in `body`, as a GRO run
arrives (or a batch of one sender's datagrams). The datagrams are rows of a numpy
structured array whose fields are the BTH, RETH and ImmDt fields of `hw.headers`; the rows'
frames are checked as `sim.golden.GoldenSwitch.receive` checks each, in its order:

- by their headers (`Rows`, cached per run of headers): the parser's verdict (`sim.codec`),
  a contribution of the first row's BTH, a payload the queue holds;
- the job table's: the payload's length, the job and rank (the first row's), the source
  address, the key (RETH.rkey), the slot;
- the credit (COMPLETED as it will be when the row is applied, every row before it
  answered), and the copy's state: a new use (a fresh copy, or a newer MSN), each copy once
  in the run;
- the ICRC, one CRC-32 call a row over what follows its headers.

The longest prefix of rows that pass every check is applied at once: the copies' new uses,
the counters and COMPLETED as `_complete` counts each, and the results, one run of them
(`netagg.host.udp_offload.FrameRun`) to the sender, written as one structured array from the job
table's result template (`sim.codec.ResultTemplate`), one CRC-32 call a result for its
ICRC. The row after the prefix is not the run path's (a drop, a replay, a stale or
duplicated message, one beyond the credit): the caller applies it and the rows after it
that cannot pass either (as they are now) through `EchoSwitch.send`, one at a time, and
gives the rest to `answer` again.

Cost: about eighty array operations a run and two CRC-32 calls a row, here about 60 us a
run and 0.6 us a row (a window of 64 in 100 us; `send`'s lean path takes about 6 us a frame,
so runs shorter than `sim.echo.RUN_MIN` go through it).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from netagg.contract import headers as H
from netagg.contract import wire as W
from netagg.host.udp_offload import FrameRun
from netagg.sim.codec import CHECKED, OK, checks

_HEAD = W.ICRC_HEADERS - W.IP_LEN - W.UDP_LEN      # the BTH's bytes the ICRC's state covers
_PSN = next((bit, width) for name, bit, width in H.BTH.field_offsets() if name == "psn")
_PSN_WORD = (sum(_PSN) // 8 - 4, (1 << _PSN[1]) - 1)   # the 32-bit word ending with it
_IMM_AT = W.BTH_LEN + W.RETH_LEN
_SHORTEST = _IMM_AT + H.IMMDT.length + 4 + W.ICRC_LEN  # a contribution of one lane
_MSN_SHIFT, _OFFSET_MASK = np.uint64(W.VA_MSN_SHIFT), np.uint64(W.VA_OFFSET_MASK)  # RETH.va's
_REQUEST = {name: (shift, (1 << width) - 1) for name, shift, width in W.REQUEST_IMM}
_RESULT = {name: (shift, (1 << width) - 1) for name, shift, width in W.RESULT_IMM}
_SENDER = sum(mask << shift for name, (shift, mask) in _REQUEST.items() if name in ("job", "rank"))
_DROPPABLE = _REQUEST["droppable"][1] << _REQUEST["droppable"][0]
_MISSING = object()


def _moves() -> list[tuple[int, int]]:
    """(mask of a request ImmDt's bits, shift to the result ImmDt's) for each group of the
    fields a result carries as its contribution's (job, version, slot, exponent), grouped by
    their shift."""
    groups: dict[int, int] = {}
    for name in ("job", "version", "slot", "exponent"):
        (at, mask), (to, width) = _REQUEST[name], _RESULT[name]
        if mask != width:
            raise ValueError(f"ImmDt field {name} has not one width in requests and results")
        groups[to - at] = groups.get(to - at, 0) | mask << at
    return [(mask, shift) for shift, mask in groups.items()]


_MOVES = _moves()


@functools.lru_cache(maxsize=64)
def row_dtype(size: int) -> np.dtype:
    """A datagram of `size` bytes (a contribution or its result) as a structured row: the
    BTH's first bytes (`head`, as one word) and its PSN word, the RETH's fields, the ImmDt
    (`imm`) and the ICRC (`icrc`, little-endian, last)."""
    fields = {"head": ("<u8", 0), "psn": (">u4", _PSN_WORD[0])}
    for name, bit, width in H.RETH.field_offsets():
        fields[name] = (f">u{width // 8}", W.BTH_LEN + bit // 8)
    fields["imm"] = (f">u{H.IMMDT.length}", _IMM_AT)
    fields["icrc"] = (f"<u{W.ICRC_LEN}", size - W.ICRC_LEN)
    return np.dtype({"names": list(fields), "formats": [f for f, _ in fields.values()],
                     "offsets": [at for _, at in fields.values()], "itemsize": size})


@dataclasses.dataclass(slots=True)
class Rows:
    """What the headers of a run give each of its rows (frames of `size`-byte datagrams
    whose BTH begins as the first row's): whether the parser takes it as a contribution
    the queue holds (`taken`), the ICRC's state after its headers, its source address; and
    where in the run what each row's ICRC covers after its headers is (`covered`)."""

    taken: np.ndarray
    states: list
    src_ip: np.ndarray
    start: int                  # the payload's offset in a row
    length: int                 # its length
    covered: list


def rows_of(switch, heads: tuple, head: bytes, size: int) -> Rows | None:
    """The `Rows` of a run whose rows begin with `head`; None when the parser takes none
    of them as a contribution the queue holds."""
    n, taken, states, src_ip, start, length = W.BTH_OFFSET + size, [], [], [], None, None
    for h in heads:
        verdict, header, body_end, state = checks(h[CHECKED.start:] + head, n)
        ok = (verdict == OK and header.opcode == W.OP_CONTRIBUTION
              and header.length <= switch.queue_capacity and body_end == n - W.ICRC_LEN)
        taken.append(ok)
        states.append(state if ok else 0)
        src_ip.append(header.src_ip if ok else -1)
        if ok and start is None:
            start, length = header.start - W.BTH_OFFSET, header.length
    if start is None:
        return None
    return Rows(np.array(taken), states, np.array(src_ip), start, length,
                [slice(at + _HEAD, at + size - W.ICRC_LEN)
                 for at in range(0, len(heads) * size, size)])


def _signed(v: np.ndarray, bits: int) -> np.ndarray:
    half = 1 << (bits - 1)
    return ((v + half) & ((1 << bits) - 1)) - half


def _field(imm: np.ndarray, name: str) -> np.ndarray:
    shift, mask = _REQUEST[name]
    return (imm >> shift) & mask


def answer(switch, port: int, heads: tuple, body, size: int) -> tuple[int, int, FrameRun | None]:
    """Apply the longest prefix of the run's rows that begin new uses of their copies: (its
    rows, how many rows after it cannot pass the checks either, the run of results or None
    when no result leaves)."""
    k = len(heads)
    if size < _SHORTEST:
        return 0, k, None
    key = (heads, bytes(body[:_HEAD]), size)
    rows = switch.run_layouts.get(key, _MISSING)
    if rows is _MISSING:
        if len(switch.run_layouts) >= 4096:
            switch.run_layouts.clear()
        rows = switch.run_layouts[key] = rows_of(switch, heads, key[1], size)
    length = rows.length if rows is not None else 0
    if not (4 <= length <= switch.max_payload and length % 4 == 0):
        return 0, k, None
    row = np.frombuffer(body, row_dtype(size), k)
    imm = row["imm"].astype(np.int64)
    first = int(imm[0])
    j, rank = (first >> _REQUEST["job"][0]) & _REQUEST["job"][1], \
        (first >> _REQUEST["rank"][0]) & _REQUEST["rank"][1]
    job = switch.job[j] if j < switch.jobs else None
    if job is None or not job.enable or rank >= job.workers:
        return 0, k, None
    copies, index = switch.copies, np.arange(k)
    slot, msn = _field(imm, "slot"), (row["va"] >> _MSN_SHIFT).astype(np.int64)
    lean = (rows.taken & (row["head"] == row["head"][0]) & (row["dma_length"] == length)
            & ((imm & _SENDER) == (first & _SENDER)) & (rows.src_ip == job.table[rank].ip)
            & (row["rkey"] == job.key)
            & (slot < min(job.slot_count, switch.slots - job.slot_base)))
    if job.credits:                 # COMPLETED as it is for each row, those before it taken
        lean &= _signed(msn - index - job.completed, 32) < job.credits
    c = np.where(lean, copies.index(job.slot_base + slot, _field(imm, "version"), rank), 0)
    d = (msn - copies.msn16[c]) & 0xFFFF
    lean &= (copies.count[c] == 0) & ((copies.bitmap[c] == 0) | ((d > 0) & (d < 0x8000)))
    copies.row[c[::-1]] = index[::-1]                 # a copy's second row waits
    lean &= copies.row[c] == index
    n = k if lean.all() else int(np.argmin(lean))
    view = memoryview(body)
    if n:
        icrc = np.fromiter(map(W.crc32, map(view.__getitem__, rows.covered[:n]), rows.states),
                           np.uint32, n)
        bad = icrc != row["icrc"][:n]
        if bad.any():
            n = int(np.argmax(bad))
            lean[n] = False
    later = np.flatnonzero(lean[n:])
    alone = int(later[0]) if len(later) else k - n
    if not n:
        return 0, alone, None
    return n, alone, _apply(switch, port, j, rank, row[:n], c[:n], msn[:n],
                            imm[:n], np.frombuffer(body, np.uint8, n * size).reshape(n, size),
                            heads[:n], rows)


def _apply(switch, port, j, rank, row, c, msn, imm, raw, heads, rows):
    """Rows that each begin a new use of their copy, applied: their copies, the counters,
    COMPLETED; their results as one run, or None when none leaves."""
    n, job, copies, start, length = len(row), switch.job[j], switch.copies, rows.start, \
        rows.length
    lanes = raw[:, start:start + length].view("<i4")
    null = None
    if (imm & _DROPPABLE).any():
        null = (_field(imm, "droppable") == 1) & np.array([switch.drop_threshold(h) <= 0
                                                           for h in heads])
        lanes = np.where(null[:, None], np.int32(0), lanes)
    shift, mask = _REQUEST["exponent"]
    copies.begin(c, 1 << rank, lanes, False if null is None else null, msn,
                 _signed((imm >> shift) & mask, mask.bit_length()), count=0)   # complete
    rx, counters, completed = switch.port_counters[port], switch.job_counters[j], job.completed
    rx["rx"] += n
    rx["drop_priority"] += 0 if null is None else int(null.sum())
    counters["contributions"] += n          # and each completes its use, as `_complete`
    counters["completed"] += n
    job.completed = (completed + n) & 0xFFFFFFFF
    w = job.table[rank]
    if w.port >= switch.ports:
        return None                             # no such port: no result leaves
    counters["results"] += n
    switch.port_counters[w.port]["tx"] += n
    template = switch.result_template(w, length)
    out = np.empty(n, row.dtype)
    results = out.view(np.uint8).reshape(n, -1)
    results[:, :_HEAD] = np.frombuffer(template.head, np.uint8, _HEAD, W.BTH_OFFSET)
    first = completed + 1 + job.credits         # the credit limit after the first row
    out["psn"] = np.arange(first, first + n) & _PSN_WORD[1]
    out["va"] = (row["va"] & _OFFSET_MASK) + np.uint64(w.va)      # the offset's, placed
    out["rkey"], out["dma_length"] = template.rkey, length
    count = _RESULT["count"][0]
    word = 1 << count if null is None else (~null).astype(np.int64) << count
    for bits, by in _MOVES:
        word = word | ((imm & bits) << by if by >= 0 else (imm & bits) >> -by)
    out["imm"] = word
    results[:, start:start + length] = lanes.view(np.uint8)
    view = memoryview(results.reshape(-1))
    out["icrc"] = np.fromiter(map(W.crc32, map(view.__getitem__, rows.covered[:n]),
                                  itertools.repeat(template.state, n)), np.uint32, n)
    return FrameRun(w.port, template.head[:W.BTH_OFFSET], view, row.dtype.itemsize)
