"""Non-finite values: how NaN and infinities in a float tensor reach every worker.

The rule: an element of the result is the IEEE sum of the workers' values of that element.
It is NaN if a worker holds NaN there, or one holds +inf and another -inf; +inf if some hold
+inf and none -inf or NaN; -inf likewise; otherwise the finite fixed-point sum
(`host.numerics`). Every worker gets the same bits. So a mixed-precision step that finds an
inf or a NaN in its reduced gradients (torch's GradScaler) finds it on every rank.

How it travels, with no change to the switch (which adds int32 lanes and returns the largest
exponent field):

- **The flag.** A worker whose block holds a non-finite value proposes `EXP_NONFINITE` (127,
  `hw.headers`) for it; finite proposals stop at 126 (`numerics.EXP_MAX`). The switch's
  maximum is then `EXP_NONFINITE` on every worker, before any of them sends the block's
  data, so every worker knows the block is non-finite at once, and the same way.
- **Two rounds per chunk** of a non-finite block (`Phase`), in the chunk's slot, one use
  after the other, as a redo is:
  1. `KINDS`: each lane holds which kinds this worker holds at that element, one bit per
     kind in its 8-bit field of `NONFINITE_LANE` (+inf, -inf, NaN; a hierarchical worker
     sets a bit if any of its node's sources holds that kind). The switch's sum counts, per
     element, the workers that hold each kind (at most 32, so the fields never carry into
     each other). The ImmDt exponent field carries the worker's proposal for the chunk's
     finite values alone (`chunk_proposal`), so the result's exponent is their exponent,
     agreed by every worker.
  2. `FINITE`: the chunk's finite values (non-finite ones as 0) in fixed point at that
     agreed exponent, as any chunk, redone with a larger exponent if the sum saturates. The
     first chunk of the block carries the proposal for a later block here, not in the
     `KINDS` round (whose exponent field holds the finite proposal), and every worker knows
     which round it is in.
  The result: the finite sums dequantised, then each element that any worker held
  non-finite set to its kind (`overlay`). A finite element keeps its exact fixed-point sum
  within the usual bound, at the chunk's finite exponent (`numerics.shared_exponents`).
- **Never droppable.** Every round of a non-finite block is sent in the tensor's own class,
  not droppable, and its `KINDS` round completes only with every worker's contribution
  (the check lane's fill-in asks the missing ranks for theirs, whatever the loss budget): a
  kind dropped or estimated would be lost.
- **Quorum.** Without the check lane's membership (more than 16 workers) a `KINDS` round
  short of contributions is redone whole, and with a quorum it completes with the loss
  budget's allowance: a worker whose contribution it closed without has its non-finite
  values missing from the result. Likewise an exponent proposal lost to a quorum's early
  close (a block agreed finite while a late worker's block holds NaN or inf): that worker
  sends its non-finite values as 0, as a missing contribution, and the result is the same on
  every worker, without them.

Cost: nothing measurable for a finite tensor (a block's proposal finds NaN and inf in the
maximum magnitude it takes anyway; the window checks the blocks its next messages need); a
non-finite block takes two rounds per chunk instead of one, through the engine's message
path (`host.window` hands over to it).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np

from netagg.contract import wire as W
from netagg.host import numerics as N

if TYPE_CHECKING:
    from netagg.host.messages import Work

_SHIFT = {name: shift for name, shift, _ in W.NONFINITE_LANE}
_FIELD = (1 << dict((name, width) for name, _, width in W.NONFINITE_LANE)["nan"]) - 1


class Phase(enum.Enum):
    """Which round of its chunk a data message is."""

    VALUES = "values"           # the chunk's values at its block's shared exponent
    KINDS = "kinds"             # a non-finite block's chunk: the kinds this worker holds
    FINITE = "finite"           # then its finite values, at the agreed finite exponent


def kind_bits(values: np.ndarray) -> np.ndarray:
    """Per element (float64 values), the `NONFINITE_LANE` bits of the kinds it is."""
    bits = np.zeros(len(values), np.int64)
    bits[values == np.inf] |= 1 << _SHIFT["pos_inf"]
    bits[values == -np.inf] |= 1 << _SHIFT["neg_inf"]
    bits[np.isnan(values)] |= 1 << _SHIFT["nan"]
    return bits


def overlay(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`values` (float64) with each element whose `counts` (summed `kind_bits`) show a
    non-finite kind set to the IEEE sum's: NaN, +inf or -inf."""
    counts = np.asarray(counts, np.int64)
    pos = (counts >> _SHIFT["pos_inf"] & _FIELD) > 0
    neg = (counts >> _SHIFT["neg_inf"] & _FIELD) > 0
    nan = ((counts >> _SHIFT["nan"] & _FIELD) > 0) | (pos & neg)
    out = np.where(pos, np.inf, values)
    out = np.where(neg, -np.inf, out)
    return np.where(nan, np.nan, out)


def finite_mask(values: np.ndarray, fmt: N.Format) -> np.ndarray:
    """Per element of a tensor's own array (bfloat16 as bits), whether it is finite."""
    if fmt is N.BFLOAT16 and values.dtype.name != "bfloat16":
        return (values.view(np.uint16) & 0x7F80) != 0x7F80
    return np.isfinite(values)


def chunk_kinds(work: Work, chunk: int) -> np.ndarray:
    """This worker's `KINDS` lanes of a data chunk (the check lane 0): per element, the bits
    of the kinds any of its sources holds there."""
    part = work.values(chunk)
    row = np.zeros(work.lanes + 1, np.int32)
    bits = np.zeros(part.stop - part.start, np.int64)
    for src in work.sources:
        bits |= kind_bits(N.to_float64(src[part], work.fmt))
    row[:len(bits)] = bits
    return row


def chunk_proposal(work: Work, chunk: int) -> int:
    """This worker's exponent proposal for a data chunk's finite values (the largest over
    its sources, as for a block), for the `KINDS` round's exponent field."""
    part = work.values(chunk)
    top = 0.0
    for src in work.sources:
        v = np.abs(N.to_float64(src[part], work.fmt))
        top = max(top, float(v[np.isfinite(v)].max(initial=0.0)))
    return int(np.clip(N.exponent_of(np.array(top)), N.EXP_MIN, N.EXP_MAX))
