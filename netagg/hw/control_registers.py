"""What `hw.control.Control` keeps of its registers and record addresses: a register's
address, value, field and write rules (`Register`), a record's address decoded into the jobs'
blocks, worker entries and heartbeats (`RecordAddress`), and the decoding of a block of
registers at a base and stride (`region`). Declarations and one helper, no state."""

import dataclasses

from amaranth import Const, Value
from amaranth.utils import ceil_log2, exact_log2


@dataclasses.dataclass(frozen=True, eq=False)
class Register:
    """A register as Control keeps it: its address and what a read shows (`value`); the
    field a write sets (None: read only), whether the request may write it (`allowed`) and
    whether it is fixed now (`fixed`: the write is refused and counted); and `copy`, when a
    read shows the store's copy of the field as last written instead (its reset value), or
    None."""
    addr: int
    value: Value
    field: Value | None = None
    allowed: Value = dataclasses.field(default_factory=lambda: Const(1))
    fixed: Value = dataclasses.field(default_factory=lambda: Const(0))
    copy: int | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class RecordAddress:
    """A record's address decoded (Amaranth values): in a job's block (its registers or a
    worker entry of a rank it may have), in a worker entry; the job, the rank and the entry's
    field it names; in the heartbeats, and the heartbeat's index (job * max_workers + rank)."""
    in_block: Value
    in_entry: Value
    job: Value
    rank: Value
    field: Value
    in_beats: Value
    beat: Value


def region(addr: Value, base: int, stride: int, count: int) -> tuple[Value, Value, Value]:
    """Whether `addr` is in `count` blocks of `stride` (a power of 2) words from `base`, which
    block, and the offset in it. On a base aligned to the blocks' span, a slice of the
    address's bits; else the block number is the address's high bits less base's."""
    shift, bits = exact_log2(stride), ceil_log2(count)
    if base % stride:
        raise ValueError(f"{base:#x} is not a multiple of its stride {stride:#x}")
    if base % (stride << bits) == 0:
        high = addr[shift + bits:]
        number = addr[shift: shift + bits]
        inside = (high == base >> (shift + bits)) & (number < count)
    else:
        number = (addr[shift:] - (base >> shift))[:len(addr) - shift]
        inside = number < count
        if (base >> shift) + count > 1 << (len(addr) - shift):
            raise ValueError(f"{count} blocks of {stride:#x} from {base:#x} pass the address")
        number = number[:bits]
    return inside, number, addr[:shift]
