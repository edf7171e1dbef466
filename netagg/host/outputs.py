"""Where an allreduce's results go: new arrays, or the caller's (`out=`), checked.

`Worker.allreduce(arrays, out=...)` writes each tensor's result into the caller's array:
one array for one tensor, or a list matching `arrays` (an entry None: a new array for that
tensor). Each must be a writeable, C-contiguous numpy array of its tensor's shape and
dtype, and may be that tensor's own input (in place, as torch.distributed's all_reduce):
the whole of it, not a part.

In place is safe because every read of a tensor's values happens before the sum of the
values read is written, chunk by chunk (a chunk of `Work.lanes` values, and its result,
cover the same elements): the exponent proposals and the loss budget's chunk norms are
taken at the call; a chunk's lanes are quantised before its first packet, and again from
the sources only while the chunk is not complete (a round redone after an overflow, fill-in
rounds after a quorum or a deadline closed its use, a non-finite block's KINDS and FINITE
rounds); a retransmission resends the packet kept; the sums are written when the chunk
completes, after which nothing reads its values (a block quantised later, when the window
hands over, recomputes rows of completed chunks from the sums, and takes only the rows of
chunks not complete). The compiled step (netagg/host/cpp/step.cpp) quantises a chunk into its
datagram when it starts it and writes its sums when it takes its result, the same order.
The hierarchical path copies the inputs into the node's shared memory at the call, and
writes `out` from the shared result at the end.

Across calls (`racing`): a flat allreduce started while earlier ones of the worker are in
flight first waits for each that writes memory this call reads or writes (its `out`), or
reads memory this call writes (its sources): results are written chunk by chunk as they
arrive, so a second allreduce of an array the first writes in place would otherwise read a
mixture (torch orders two all_reduce calls on one tensor the same way).

Refused with a ValueError that names the tensor and what is wrong: an `out` of another
shape or dtype, not C-contiguous, read-only, not a numpy array, or one that shares memory
with another tensor's input or output, or with part of its own input (a shifted view, whose
chunks would read values already summed).
"""

from __future__ import annotations

import numpy as np


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.strides == b.strides)


def _overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    return np.may_share_memory(a, b) and np.shares_memory(a, b, max_work=1 << 20)


def outputs(arrays: list[np.ndarray], out, single: bool) -> list[np.ndarray]:
    """The arrays the results of `arrays` go into: new ones (C order) where `out` has none,
    else `out`'s, checked (see the module)."""
    if out is None:
        return [np.empty(a.shape, a.dtype) for a in arrays]
    if single:
        if isinstance(out, (list, tuple)):
            raise ValueError("out must be one array for one tensor, not a list")
        outs = [out]
    else:
        if not isinstance(out, (list, tuple)) or len(out) != len(arrays):
            raise ValueError(f"out must be a list of {len(arrays)} arrays (or None) matching "
                             f"the tensors, not {type(out).__name__}"
                             + (f" of {len(out)}" if isinstance(out, (list, tuple)) else ""))
        outs = list(out)
    for i, (a, o) in enumerate(zip(arrays, outs)):
        if o is None:
            outs[i] = np.empty(a.shape, a.dtype)
            continue
        what = f"out for tensor {i}"
        if not isinstance(o, np.ndarray):
            raise ValueError(f"{what} must be a numpy array, not {type(o).__name__}")
        if o.shape != a.shape:
            raise ValueError(f"{what} has shape {o.shape}, the tensor {a.shape}")
        if o.dtype != a.dtype:
            raise ValueError(f"{what} has dtype {o.dtype}, the tensor {a.dtype}")
        if not o.flags.c_contiguous:
            raise ValueError(f"{what} is not C-contiguous")
        if not o.flags.writeable:
            raise ValueError(f"{what} is read-only")
    given = [out] if single else list(out)
    for i, o in enumerate(outs):
        if given[i] is None or o.size == 0:
            continue
        for j, a in enumerate(arrays):
            if _overlaps(o, a) and not (i == j and _same_memory(o, a)):
                where = "part of its own input" if i == j else f"tensor {j}'s input"
                raise ValueError(f"out for tensor {i} shares memory with {where}: it may "
                                 f"be its own input, whole, or memory of its own")
        for j in range(i):
            if outs[j].size and _overlaps(o, outs[j]):
                raise ValueError(f"out for tensor {i} shares memory with the out for "
                                 f"tensor {j}")
    return outs


def racing(works: list, arrays: list[np.ndarray], outs: list[np.ndarray]) -> list:
    """The works among `works` (submitted, not done) that a call of `arrays` into `outs`
    must wait for: an earlier `out` that overlaps this call's inputs or outputs, or an
    earlier source that overlaps its outputs."""
    return [w for w in works if not w.done and (
        any(_overlaps(w.out, x) for x in (*arrays, *outs))
        or any(_overlaps(s, o) for s in w.sources for o in outs))]
