"""The wire format as numpy records: a step's contributions written, and its results read,
a batch at a time. The bytes are `netagg.contract.wire`'s, field for field.

`ContributionWriter` writes the contributions a worker starts in one step into one buffer:
the BTH, RETH (va: the MSN and the chunk's offset, `wire.CONTRIBUTION_VA`; rkey: the job's
key) and ImmDt of all of them as array assignments, the lanes (each with its check
lane) as one copy, then the ICRC of each, a CRC-32 continued from the cached state of its
source path's IPv4 and UDP headers (`wire.icrc_state`). Each datagram is a memoryview of
that buffer.

`read_results` takes the datagrams of one step (their ICRC already checked by the
transport) and reads, in one numpy pass over their concatenation, every result of the job:
a WRITE Only with Immediate of the job's result length (BTH, RETH, ImmDt, `lanes + 1` int32
lanes, ICRC), to this worker's queue pair (BTH.dqpn), with the session's R_Key
(RETH.rkey), of this job and of one of its slots (ImmDt). What passes is a `ResultBatch`:
per result its slot, version, count, exponent, overflow flag, check lane, the job's credit
limit it carries (BTH.psn unwrapped near the engine's) and its lanes, a view of the one
buffer. Everything else (control answers, foreign or malformed packets) comes back as it
was, for the engine to read one at a time and count.

Cost: a handful of array operations a batch, and per packet one CRC-32 call (writing).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from netagg.contract import headers as H
from netagg.contract import wire as W
from netagg.host import numerics as N
from netagg.host.messages import Result

# BTH, RETH and ImmDt as the contract's words: opcode, se_migreq_padcnt_tver (the BTH's
# flags), pkey, dqpn, psn, va, rkey, dma_length, data (the ImmDt)
_HEAD = H.numpy_fields(H.BTH, H.RETH, H.IMMDT)
_FLAGS = "se_migreq_padcnt_tver"


@functools.lru_cache(maxsize=64)
def write_imm_dtype(lanes: int) -> np.dtype:
    """A contribution or result datagram of `lanes` data lanes (and the check lane) as a
    numpy record: BTH, RETH, ImmDt, lanes, ICRC."""
    return np.dtype(_HEAD + [("lanes", "<i4", (lanes + 1,)), ("icrc", "<u4")])


_REQUEST = {name: (shift, (1 << width) - 1) for name, shift, width in W.REQUEST_IMM}


@functools.lru_cache(maxsize=256)
def _slices(size: int, k: int) -> tuple[list[slice], list[slice]]:
    """`k` datagrams of `size` bytes one after another: the slice of each, and of what its
    ICRC covers after its BTH's first 8 bytes."""
    starts = range(0, k * size, size)
    return ([slice(at, at + size) for at in starts],
            [slice(at + 8, at + size - W.ICRC_LEN) for at in starts])


class ContributionWriter:
    """The contribution datagrams of one worker of one job, for a UDP socket or a bridge to
    add the canonical IPv4 and UDP headers from path `p`'s source (`sources[p]`) to the
    switch."""

    def __init__(self, job: int, rank: int, sources: list[W.Endpoint], switch: W.Endpoint,
                 dqpn: int = 2, *, key: int):
        self.sources, self.switch, self.dqpn, self.key = sources, switch, dqpn, key
        self.imm = W.pack_imm(W.REQUEST_IMM, job=job, rank=rank)
        # the first 8 bytes of every contribution's BTH (opcode .. dqpn)
        self.bth_head = np.frombuffer(W.bth(W.OP_CONTRIBUTION, dqpn, 0)[:8], np.uint8)
        self._states: dict[tuple[int, int], int] = {}       # (path, lanes) -> ICRC state

    def icrc_state(self, path: int, lanes: int) -> int:
        """The CRC state after the canonical IPv4 and UDP headers and the BTH's first 8
        bytes of path `path`'s contributions of `lanes` data lanes (cached): the ICRC of a
        datagram continues from it over the rest."""
        state = self._states.get((path, lanes))
        if state is None:
            src, dst = self.sources[path], self.switch
            ip_udp = W.ip_udp_header(src.ip, dst.ip, src.port, dst.port,
                                     write_imm_dtype(lanes).itemsize)
            state = W.icrc_state(ip_udp + W.bth(W.OP_CONTRIBUTION, self.dqpn, 0)[:8])
            self._states[path, lanes] = state
        return state

    def datagrams(self, lanes: np.ndarray, *, paths: list[int], slot: list[int],
                  version: list[int], offset: list[int], msn: list[int], psn: list[int],
                  exponent: list[int], droppable: list[bool]) -> list[memoryview]:
        """Contributions of `lanes` (one int32 row each, the check lane last), one per
        entry of the field lists, each from its path's source."""
        k, width = lanes.shape
        if not 2 <= width <= W.MAX_PAYLOAD // 4:
            raise ValueError(f"a contribution carries 4..{W.MAX_PAYLOAD} bytes of int32 "
                             f"lanes, not {4 * width}")
        slot_ = np.asarray(slot, np.int64)
        exponent_ = np.asarray(exponent, np.int64)
        if (slot_ >= W.MAX_SLOTS).any() or (exponent_ < -128).any() \
                or (exponent_ > 127).any():
            raise ValueError("a slot or an exponent does not fit its ImmDt field")
        recs = np.empty(k, write_imm_dtype(width - 1))
        size = recs.itemsize
        recs.view(np.uint8).reshape(k, size)[:, :8] = self.bth_head   # opcode .. dqpn
        recs["dma_length"] = 4 * width
        recs["psn"] = np.asarray(psn, np.int64) & 0xFFFFFF
        msn_ = np.asarray(msn, np.int64).astype(np.uint64) & np.uint64(0xFFFFFFFF)
        offset_ = np.asarray(offset, np.int64).astype(np.uint64) & np.uint64(W.VA_OFFSET_MASK)
        recs["va"] = msn_ << np.uint64(W.VA_MSN_SHIFT) | offset_
        recs["rkey"] = self.key
        field = {name: shift for name, (shift, _) in _REQUEST.items()}
        recs["data"] = (self.imm | np.asarray(version, np.int64) << field["version"]
                       | slot_ << field["slot"] | (exponent_ & 0xFF) << field["exponent"]
                       | np.asarray(droppable, np.int64) << field["droppable"])
        recs["lanes"] = lanes
        buf = memoryview(recs.view(np.uint8))
        states = [self.icrc_state(p, width - 1) for p in range(len(self.sources))]
        whole, covered = _slices(size, k)
        recs["icrc"] = np.fromiter(map(W.crc32, map(buf.__getitem__, covered),
                                       map(states.__getitem__, paths)), np.uint32, k)
        return list(map(buf.__getitem__, whole))


@dataclasses.dataclass
class ResultBatch:
    """The results of a step, as arrays (one entry per result, in arrival order)."""

    slot: np.ndarray            # int64, as the fields below
    version: np.ndarray
    count: np.ndarray
    exponent: np.ndarray
    overflow: np.ndarray        # bool: the overflow flag, or a worker's saturation marker
    check: np.ndarray           # the check lane
    limit: np.ndarray           # the job's credit limit (BTH.psn, unwrapped)
    lanes: np.ndarray           # (results, lanes + 1) int32: the sums, then the check lane

    def __len__(self) -> int:
        return len(self.slot)

    def result(self, i: int) -> Result:
        """Result `i` as the engine's one-at-a-time reading makes it."""
        return Result(int(self.slot[i]), int(self.version[i]), int(self.count[i]),
                      int(self.exponent[i]), bool(self.overflow[i]), self.lanes[i],
                      int(self.limit[i]), int(self.check[i]))


def read_results(datagrams: list[bytes], *, lanes: int, qpn: int, rkey: int, job: int,
                 slots: int, near: int) -> tuple[ResultBatch | None, list[bytes]]:
    """The job's results among `datagrams` (None if there are none), and the others."""
    dtype = write_imm_dtype(lanes)
    size = dtype.itemsize
    joined = b"".join(datagrams) if set(map(len, datagrams)) == {size} else None
    if joined is not None and (np.frombuffer(joined, np.uint8)[::size] == W.OP_RESULT).all():
        mine, rest = datagrams, []      # (a step's usual datagrams: results only)
    else:
        mine = [d for d in datagrams if len(d) == size and d[0] == W.OP_RESULT]
        rest = [d for d in datagrams if len(d) != size or d[0] != W.OP_RESULT] \
            if len(mine) < len(datagrams) else []
        joined = b"".join(mine)
    if not mine or not slots:
        return None, datagrams
    recs = np.frombuffer(joined, dtype)
    imm = recs["data"].astype(np.int64)
    f = {name: imm >> shift & ((1 << width) - 1) for name, shift, width in W.RESULT_IMM}
    ok = ((recs[_FLAGS] & 0x3F) == 0) & ((recs["dqpn"] & 0xFFFFFF) == qpn) \
        & (recs["rkey"] == rkey) & (f["job"] == job) & (f["slot"] < slots)
    if not ok.all():
        rest += [d for d, good in zip(mine, ok.tolist()) if not good]
        recs, f = recs[ok], {name: v[ok] for name, v in f.items()}
        if not len(recs):
            return None, rest
    span = 1 << 24                      # BTH.psn unwrapped near `near`, as `wire.unwrap`
    delta = (recs["psn"].astype(np.int64) - near) % span
    limit = near + np.where(delta >= span // 2, delta - span, delta)
    sums = recs["lanes"]
    check = sums[:, -1]
    exponent = f["exponent"] - ((f["exponent"] & 0x80) << 1)
    overflow = (f["overflow"] != 0) | (check == N.INT32_MAX)
    return ResultBatch(f["slot"], f["version"], f["count"], exponent, overflow,
                       check, limit, sums), rest
