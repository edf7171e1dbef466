"""The RoCEv2 invariant CRC, one whole beat per cycle.

The ICRC is the reflected CRC-32 of zlib (polynomial 0xEDB88320, register preset to all ones,
result complemented), computed over 8 bytes of 0xFF, then the frame from the IPv4 header to
the end of the pad, with the variant fields (IPv4 TOS, TTL and checksum, UDP checksum, BTH
byte 4) replaced by 0xFF. It is sent least significant byte first.

`IcrcEngine` folds a beat of `width` bits into the CRC register in one cycle with one XOR
matrix. Bytes outside the covered region are fed as zeros and undone with small 32x32
matrices, so no beat ever has to be shifted:

* the region starts at frame byte 14; the register is seeded with the state that, after
  the zero bytes in front of byte 14 in its beat, equals the state after the 0xFF prefix;
* the region ends at frame byte `end`; the zero bytes after it in the final beat are taken
  back by the inverse of the zero-byte step raised to their count, applied as one optional
  32x32 matrix per bit of the count (log2 of the beat's bytes of them, not one per count).

`final` is the register after the region, combinationally on the beat that holds its end.
Over a region that includes the received ICRC it equals `RESIDUE` when the ICRC is right
(the checker's use); over the region without it, its complement is the ICRC to send.
Latency: none (combinational `final`); one register of state.
"""

import functools
import zlib

from amaranth import Cat, Const, Module, Mux, Signal, unsigned
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from netagg.contract.headers import ICRC_MASKED_BYTES, ICRC_START

from .beat import beat_index, check_width

POLY = 0xEDB88320


def _bit_step(state: int, bit: int) -> int:
    return (state >> 1) ^ (POLY if (state ^ bit) & 1 else 0)


def crc_raw(state: int, data: bytes) -> int:
    """The CRC register after `data`, bit by bit: the reference the matrices come from."""
    for byte in data:
        for i in range(8):
            state = _bit_step(state, (byte >> i) & 1)
    return state


PREFIX_STATE = crc_raw(0xFFFFFFFF, b"\xff" * 8)
RESIDUE = crc_raw(0xFFFFFFFF, b"abc" + zlib.crc32(b"abc").to_bytes(4, "little"))
assert RESIDUE == crc_raw(0xFFFFFFFF, b"" + zlib.crc32(b"").to_bytes(4, "little"))


def _mat_vec(rows, vec: int) -> int:
    return sum((bin(row & vec).count("1") & 1) << j for j, row in enumerate(rows))


def _mat_mul(a, b):
    """Rows of a @ b, both 32x32 matrices given as rows of input masks."""
    return [_mat_vec_rows(row, b) for row in a]


def _mat_vec_rows(row: int, b) -> int:
    out = 0
    for i in range(32):
        if row >> i & 1:
            out ^= b[i]
    return out


@functools.lru_cache(maxsize=None)
def update_matrix(width: int):
    """Rows (one per register bit) of input masks over Cat(state[32], data[width])."""
    def step(state, data):
        for i in range(width):
            state = _bit_step(state, (data >> i) & 1)
        return state
    cols = [step(1 << i, 0) for i in range(32)] + [step(0, 1 << i) for i in range(width)]
    return tuple(sum(((col >> j) & 1) << i for i, col in enumerate(cols)) for j in range(32))


@functools.lru_cache(maxsize=None)
def unzero_matrix(nbytes: int):
    """Rows of the inverse of `nbytes` zero bytes fed to the register."""
    zero = [crc_raw(1 << i, b"\0") for i in range(32)]  # columns of one zero byte
    rows = [sum(((col >> j) & 1) << i for i, col in enumerate(zero)) for j in range(32)]
    # Invert over GF(2) by Gauss-Jordan elimination on [rows | I].
    aug = [(rows[j] | (1 << (32 + j))) for j in range(32)]
    for col in range(32):
        pivot = next(r for r in range(col, 32) if aug[r] >> col & 1)
        aug[col], aug[pivot] = aug[pivot], aug[col]
        for r in range(32):
            if r != col and aug[r] >> col & 1:
                aug[r] ^= aug[col]
    inv = [row >> 32 for row in aug]
    out = [1 << j for j in range(32)]
    for _ in range(nbytes):
        out = _mat_mul(inv, out)
    return tuple(out)


def apply(rows, vector):
    """The matrix-vector product over GF(2): the XOR of the columns that the set bits of
    `vector` select.

    Written as one 32-bit `Mux` per input bit and a balanced XOR tree, not as a parity per
    row: Amaranth turns an AND with a constant into single bits, which Verilator then
    splices one run of bits at a time, while a Mux between a constant and zero stays a
    word. Synthesis gives the same XOR trees either way.
    """
    terms = []
    for i in range(len(vector)):
        column = sum(((row >> i) & 1) << j for j, row in enumerate(rows))
        if column:
            terms.append(Mux(vector[i], Const(column, len(rows)), 0))
    while len(terms) > 1:
        terms = [a ^ b for a, b in zip(terms[0::2], terms[1::2])] + terms[len(terms) & ~1:]
    return terms[0] if terms else Const(0, len(rows))


def seed(width: int) -> int:
    """Register value to start the beat holding byte 14 with."""
    lead = ICRC_START % (width // 8)
    return _mat_vec(unzero_matrix(lead), PREFIX_STATE)


class IcrcEngine(wiring.Component):
    """The ICRC of a frame, folded one beat per cycle.

    Drive `data` and `last` with each beat that is consumed (`valid`), and `end`: the frame
    byte offset where the covered region ends; it only has to be right on the beats from the
    one holding byte 14 + `end` ... on, and a value past the beat means "not yet". The
    engine counts beats itself and restarts after `last`.
    """

    def __init__(self, width: int):
        self.width = check_width(width)
        self.nbytes = width // 8
        super().__init__({
            "valid": In(1),
            "data": In(unsigned(width)),
            "last": In(1),
            "end": In(unsigned(16)),
            "index": Out(unsigned(16)),   # beat index within the frame
            "in_region_end": Out(1),      # `end` falls in (start of beat, end of beat]
            "final": Out(unsigned(32)),   # register after the region (valid with the above)
            "ok": Out(1),                 # `final` equals the residue of a right ICRC
        })

    def elaborate(self, platform):
        m = Module()
        nb = self.nbytes
        state = Signal(32)
        first_beat = ICRC_START // nb
        base = Signal(unsigned(16))
        m.d.comb += base.eq(self.index * nb)

        # Every expression below that feeds many others is a Signal of its own: the XOR
        # matrices read each input many times, and an inlined expression would be copied
        # into every row by Verilator.
        covered = Signal(nb)
        masked = Signal(self.width)
        for i in range(nb):
            pos = Signal(unsigned(16), name=f"pos{i}")
            m.d.comb += pos.eq(base + i)
            byte = self.data[8 * i : 8 * i + 8]
            variant = Const(0, 1)
            for b in ICRC_MASKED_BYTES:
                if b // nb * nb + i == b:  # this lane can hold masked byte b
                    variant = variant | (self.index == b // nb)
            m.d.comb += covered[i].eq((pos >= ICRC_START) & (pos < self.end))
            m.d.comb += masked[8 * i : 8 * i + 8].eq(
                Mux(covered[i], Mux(variant, 0xFF, byte), 0))

        vector = Signal(32 + self.width)
        m.d.comb += vector.eq(Cat(Mux(self.index == first_beat, seed(self.width), state),
                                  masked))
        folded = Signal(32)
        m.d.comb += folded.eq(apply(update_matrix(self.width), vector))

        # Bytes of this beat after the region end, to take back: nb - (end - base), clamped;
        # undone one power of two at a time (the zero-byte step's powers commute).
        in_beat = Signal(range(nb + 1))
        extra = Signal(range(nb + 1))
        ahead = self.end - base
        m.d.comb += [
            in_beat.eq(Mux(self.end <= base, 0, Mux(ahead >= nb, nb, ahead))),
            extra.eq(nb - in_beat),
        ]
        undone = folded
        for bit in range(len(extra)):
            step = Signal(32, name=f"unzero{1 << bit}")
            m.d.comb += step.eq(Mux(extra[bit], apply(unzero_matrix(1 << bit), undone), undone))
            undone = step
        m.d.comb += self.final.eq(undone)
        m.d.comb += [
            self.in_region_end.eq((self.end > base) & (self.end <= base + nb)),
            self.ok.eq(self.final == RESIDUE),
        ]

        m.d.comb += self.index.eq(beat_index(m, self.valid, self.last))
        with m.If(self.valid & (self.index >= first_beat)):
            m.d.sync += state.eq(folded)
        return m
