"""Number formats: how tensors become int32 lanes the switch can add, and back.

int32 is carried as it is: the switch's sum is exact unless it saturates, and a saturated sum
(the result's overflow flag) is an `OverflowError`, never a returned value.

float32, float16 and bfloat16 are carried in fixed point with a shared exponent (SwitchML's
scheme). A tensor is cut into chunks of `LANES` values (one packet each) and the chunks into
blocks of `block` chunks. Every worker proposes, for each block, the exponent `e` of its largest
magnitude (`|x| < 2**e`, `math.frexp`); the switch returns the maximum `E` over the workers (the
result's exponent field), so every worker scales the block by the same `2**(F - E)` and rounds
to the nearest integer. With `F = fraction_bits(world_size)`, `world_size * 2**F <= 2**31 - 1`:
the sum of `world_size` such integers cannot overflow int32.

Error bound, per element of a block with shared exponent `E`: each worker's rounding error is at
most `2**(E - F - 1)`, so the sum is within `world_size * 2**(E - F - 1)` of the exact sum of
the inputs (about `2**-(F + 1)` relative to the block's largest magnitude: 2**-29 at 4 workers),
plus one rounding to the output dtype (half an ulp of the result). `mean` divides that by
`world_size`. `error_bound` computes it per element.

NaN and infinities (`host.nonfinite`): an element of the result is the IEEE sum of the
workers' values (NaN if any holds NaN, or +inf and -inf meet; +inf if only +inf; -inf if only
-inf), the same on every worker. A worker proposes `EXP_NONFINITE` (127, the exponent field's
largest value) for a block that holds one, so finite proposals stop at `EXP_MAX` = 126 (a
finite value at or beyond 2**126 then saturates its chunk and is redone with a larger
exponent, as any overflow); a block agreed non-finite sends each chunk twice: the kinds each
worker holds per element, then the finite values (non-finite ones as 0) at the exponent of
the chunk's finite values over the workers, which `shared_exponents` gives for the bound.

The overflow flag still has a use: when a proposal was wrong (a corrupted or stale packet) or
`fraction_bits` is forced higher than safe, the sum saturates; the engine then redoes the chunk
with `E + 1`, as often as needed, so a saturated sum is never returned.

bfloat16 arrays are numpy uint16 views of the bit patterns (`dtype="bfloat16"` on the call), or
`ml_dtypes.bfloat16` arrays when that package is installed.
"""

from __future__ import annotations

import math

import numpy as np

from netagg.contract import wire as W

LANES = W.MAX_PAYLOAD // 4 - 1      # data lanes per packet; the last lane is the check lane
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
EXP_NONFINITE = W.EXP_NONFINITE     # the proposal of a block that holds NaN or inf (127)
EXP_MIN, EXP_MAX = -127, EXP_NONFINITE - 1      # finite proposals (8-bit signed field)
EXP_NONE = -128                     # no proposal
DEFAULT_BLOCK = 16                  # chunks per shared exponent
BFLOAT16_NAN = 0x7FC0               # the bfloat16 bits a NaN result is written as


def fraction_bits(world_size: int) -> int:
    """The largest F with world_size * 2**F <= 2**31 - 1."""
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    return 30 - int(math.floor(math.log2(world_size)))


class Format:
    """How one dtype travels: `kind` is "int" (exact int32) or "fixed" (fixed point)."""

    def __init__(self, name: str, kind: str, eps: float):
        self.name, self.kind, self.eps = name, kind, eps

    def __repr__(self):
        return f"Format({self.name})"


INT32 = Format("int32", "int", 0.0)
FLOAT32 = Format("float32", "fixed", 2.0 ** -24)
FLOAT16 = Format("float16", "fixed", 2.0 ** -11)
BFLOAT16 = Format("bfloat16", "fixed", 2.0 ** -8)


def format_of(array: np.ndarray, dtype: str | None = None) -> Format:
    """The format for an array; `dtype="bfloat16"` reads a uint16 array as bfloat16 bits."""
    if dtype is not None:
        fmt = {"int32": INT32, "float32": FLOAT32, "float16": FLOAT16,
               "bfloat16": BFLOAT16}.get(str(dtype))
        if fmt is None:
            raise TypeError(f"unsupported dtype {dtype!r}: int32, float32, float16, bfloat16")
        if fmt is BFLOAT16 and array.dtype not in (np.uint16, np.int16) \
                and array.dtype.name != "bfloat16":
            raise TypeError(f"bfloat16 bits come as a uint16 array, not {array.dtype}")
        if fmt is not BFLOAT16 and array.dtype.name != fmt.name:
            raise TypeError(f"dtype={dtype!r} does not match the array's {array.dtype}")
        return fmt
    name = array.dtype.name
    if name == "bfloat16":
        return BFLOAT16
    fmt = {"int32": INT32, "float32": FLOAT32, "float16": FLOAT16}.get(name)
    if fmt is None:
        raise TypeError(f"cannot allreduce {name}: int32, float32, float16 and bfloat16 "
                        f"(uint16 bits with dtype='bfloat16') are supported")
    return fmt


def to_float64(array: np.ndarray, fmt: Format) -> np.ndarray:
    """The values as float64 (bfloat16 bits widened exactly)."""
    if fmt is BFLOAT16 and array.dtype.name != "bfloat16":
        bits = array.view(np.uint16).astype(np.uint32) << 16
        with np.errstate(invalid="ignore"):
            return bits.view(np.float32).astype(np.float64)
    return array.astype(np.float64)


def from_float64(values: np.ndarray, fmt: Format, like: np.ndarray) -> np.ndarray:
    """float64 values in the array's own dtype (bfloat16 rounded to nearest even)."""
    if fmt is BFLOAT16 and like.dtype.name != "bfloat16":
        bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = np.isnan(values)
        out = rounded.astype(np.uint16)
        out[nan] = BFLOAT16_NAN
        return out.view(like.dtype)
    return values.astype(like.dtype)


def _exactly_float(values: np.ndarray, fmt: Format) -> np.ndarray:
    """The values in a float dtype that holds them exactly (bfloat16 bits as float32)."""
    if fmt is BFLOAT16 and values.dtype.name != "bfloat16":
        return (values.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if values.dtype.kind == "f":
        return values
    return to_float64(values, fmt)


def exponent_of(magnitude: np.ndarray) -> np.ndarray:
    """Per element, the e with magnitude < 2**e (frexp's exponent), EXP_MIN for zero."""
    _, e = np.frexp(magnitude)
    return np.where(magnitude > 0, e, EXP_MIN).astype(np.int64)


def block_proposals(values: np.ndarray, fmt: Format, per: int) -> np.ndarray:
    """A worker's exponent proposal for each block of `per` values of a tensor (its own
    dtype, one block for an empty one): EXP_NONFINITE where the block holds NaN or an
    infinity, else the exponent of its largest magnitude within EXP_MIN..EXP_MAX."""
    n = len(values)
    full = n // per
    top = np.zeros(max(1, -(-n // per)))
    exact = _exactly_float(values, fmt)     # (abs and max are exact in any float dtype)
    if full:                    # (the largest and the smallest: no temporary array)
        blocks = exact[:full * per].reshape(full, per)
        top[:full] = np.maximum(blocks.max(axis=1), -blocks.min(axis=1))    # NaN: NaN
    if full * per < n:
        tail = exact[full * per:]
        top[full] = np.maximum(tail.max(), -tail.min())
    return proposals_of(top)


def proposals_of(top: np.ndarray) -> np.ndarray:
    """The exponent proposals of blocks whose largest magnitudes are `top` (NaN or an
    infinity: EXP_NONFINITE)."""
    finite = np.isfinite(top)
    out = np.clip(exponent_of(np.where(finite, top, 0.0)), EXP_MIN, EXP_MAX)
    return np.where(finite, out, EXP_NONFINITE)


def quantize(values: np.ndarray, exponent: int, frac: int) -> np.ndarray:
    """round(values * 2**(frac - exponent)) as int64 (not yet clipped)."""
    return np.rint(np.ldexp(values, frac - exponent)).astype(np.int64)


def dequantize(sums: np.ndarray, exponent: int, frac: int) -> np.ndarray:
    return np.ldexp(sums.astype(np.float64), exponent - frac)


def error_bound(result: np.ndarray, exponents: np.ndarray, world_size: int, fmt: Format,
                frac: int | None = None, mean: bool = False) -> np.ndarray:
    """Per element, how far a fixed-point allreduce result may be from the exact sum (or mean)
    of the inputs: world_size * 2**(E - F - 1) (divided by world_size for a mean) plus half an
    ulp of the output dtype. `exponents` are the shared exponents per element."""
    frac = fraction_bits(world_size) if frac is None else frac
    bound = world_size * np.ldexp(1.0, exponents - frac - 1)
    if mean:
        bound = bound / world_size
    return bound + half_ulp(result, fmt)


def half_ulp(values: np.ndarray, fmt: Format) -> np.ndarray:
    """Half the spacing of the output dtype at `values` (subnormals included)."""
    if fmt is INT32:
        return np.zeros(np.shape(values))
    v = np.abs(np.asarray(values, np.float64))
    if fmt is BFLOAT16:
        return np.spacing(v.astype(np.float32)).astype(np.float64) * 2.0 ** 16 / 2
    dtype = np.float16 if fmt is FLOAT16 else np.float32
    with np.errstate(over="ignore", invalid="ignore"):      # (NaN or inf: NaN)
        return np.spacing(v.astype(dtype)).astype(np.float64) / 2


def shared_exponents(arrays, fmt: Format, lanes: int = LANES,
                     block: int = DEFAULT_BLOCK) -> np.ndarray:
    """Per element, the shared exponent E every worker uses for it (the maximum over the
    workers' proposals for its block; in a block that holds NaN or inf, the maximum over the
    workers of its chunk's finite values' exponent): what `error_bound` needs, computed from
    all inputs."""
    values = [to_float64(np.asarray(a).reshape(-1), fmt) for a in arrays]
    n = len(values[0])
    per = lanes * block
    out = np.empty(n, np.int64)
    for i in range(0, n, per):
        finite = all(np.isfinite(v[i:i + per]).all() for v in values)
        for lo in range(i, min(i + per, n), per if finite else lanes):
            hi = min(lo + (per if finite else lanes), n)
            m = max(float(np.abs(np.where(np.isfinite(v[lo:hi]), v[lo:hi], 0.0)).max(
                initial=0.0)) for v in values)
            out[lo:hi] = np.clip(exponent_of(np.array(m)), EXP_MIN, EXP_MAX)
    return out
