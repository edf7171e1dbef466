"""Which torch all_reduce calls the switch can do, and torch tensors as the worker's arrays.

The switch adds int32 lanes: it carries SUM of int32 tensors exactly, and SUM and AVG (the
worker's "mean") of float32, float16 and bfloat16 tensors in fixed point (`host.numerics`),
for dense tensors all on the CPU or all on one CUDA device (those through pinned host memory,
`host.torch_staging`). `switch_op` says so for one call, or returns None: every other op
(MAX, MIN, PRODUCT, BAND...), dtype (float64, int64, uint8, bool, complex...), and sparse,
mixed-dtype or mixed-device tensor lists go to gloo, on the CPU or CUDA alike. What neither
takes (AVG but of the switch's float dtypes: int32's is not an int32, and gloo has no AVG;
PREMUL_SUM, which gloo has not either) is an error that `refusal` words, naming the dtype, op
and device, before anything is sent.

Tensors become numpy arrays without a copy when they are contiguous (`Tensor.numpy()`
shares memory): float32, float16 and int32 as they are, bfloat16 (no numpy dtype) as its
int16 bit pattern with the worker's `dtype="bfloat16"`, which `host.numerics` reads and
writes exactly. The result of a contiguous tensor is written into it in place (its numpy
view is the worker's `out`, `in_place_outs`), as torch's all_reduce does, without a copy; a
non-contiguous tensor (or one that shares memory with another of the call) is copied once
each way, its result into the tensor (`store_result`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

FORMATS = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
           torch.int32: "int32"}
FLOATS = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class SwitchOp:
    """An allreduce the switch carries: the worker's op ("sum" or "mean") and dtype name."""

    op: str
    dtype: str


REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
STAGED_DEVICES = ("cpu", "cuda")     # CUDA tensors through pinned host memory


def switch_op(tensors, reduce_op) -> SwitchOp | None:
    """The switch's op for all_reduce of `tensors` with `reduce_op`, None for gloo's."""
    if not tensors:
        return None
    dtypes = {t.dtype for t in tensors}
    devices = {t.device for t in tensors}
    if (len(dtypes) != 1 or len(devices) != 1 or any(t.is_sparse for t in tensors)
            or devices.pop().type not in STAGED_DEVICES):
        return None
    dtype = FORMATS.get(dtypes.pop())
    if dtype is None:
        return None
    if reduce_op == dist.ReduceOp.SUM:
        return SwitchOp("sum", dtype)
    if reduce_op == dist.ReduceOp.AVG and dtype in FLOATS:
        return SwitchOp("mean", dtype)
    return None


def op_name(reduce_op) -> str:
    """"SUM", "AVG"... for a `dist.ReduceOp` or its `RedOpType`."""
    return next((n for n in REDUCE_OPS if reduce_op == getattr(dist.ReduceOp, n)),
                str(reduce_op))


def refusal(tensors, reduce_op) -> str | None:
    """Why neither the switch nor gloo takes all_reduce of `tensors` with `reduce_op`
    (AVG but of float32, float16 and bfloat16; PREMUL_SUM), None when one of them does."""
    if not tensors or switch_op(tensors, reduce_op) is not None:
        return None
    name = op_name(reduce_op)
    if name not in ("AVG", "PREMUL_SUM"):
        return None
    dtypes = ", ".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors}))
    devices = ", ".join(sorted({str(t.device) for t in tensors}))
    return (f"all_reduce {name} of {dtypes} tensors on {devices}: the switch takes SUM of "
            f"int32 and SUM and AVG of float32, float16 and bfloat16 (dense, on one device), "
            f"and gloo, which takes the rest, has no {name}")


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values as the worker takes them (a view when the tensor is contiguous)."""
    t = tensor.detach().contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def in_place_outs(tensors, arrays: list[np.ndarray]) -> list[np.ndarray | None]:
    """The worker's `out` for each tensor: its own array (`as_array`) where that is the
    tensor's memory (in place), None where the result must be copied in (`store_result`).
    Tensors that share memory with one another are all copied."""
    outs = [a if t.is_contiguous() and a.size and a.ctypes.data == t.data_ptr() else None
            for t, a in zip(tensors, arrays)]
    if any(np.may_share_memory(a, b) for i, a in enumerate(arrays) for b in arrays[:i]):
        return [None] * len(arrays)
    return outs


def store_result(tensor: torch.Tensor, result: np.ndarray) -> torch.Tensor:
    """Copy the worker's result into `tensor` (in place); returns `tensor`."""
    values = torch.from_numpy(result)
    if tensor.dtype == torch.bfloat16:
        values = values.view(torch.bfloat16)
    with torch.no_grad():
        tensor.copy_(values.view(tensor.shape))
    return tensor
