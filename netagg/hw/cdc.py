"""A clock-domain crossing FIFO whose every path on either side starts and ends at a
flip-flop or the storage, for the MACs' 125 MHz sides on a slow, crowded ECP5.

`amaranth.lib.fifo.AsyncFIFO` computes its read address from ``r_en`` and its write enable
from a combinational full flag; on an LFE5U-25F speed grade 6 those paths, a compare, an
increment and the fan-out into 19 LUT RAM cells, did not meet 125 MHz. Here:

- write side: `w_rdy` is a register, computed from the pointers of the cycle before, so it
  is conservative by one entry; the write address is the write pointer register;
- read side: the output is a register (`r_data`, `r_rdy`), loaded from the storage at the
  read pointer register, so no logic sits in front of the read address;
- pointers cross in Gray code through two-flip-flop synchronisers; each Gray register is
  encoded from its binary pointer a cycle later (one bit changes per step).

Storage: `depth` entries of LUT RAM (written in `w_domain`, read asynchronously in
`r_domain`). Latency: an entry is at `r_data` about 4 read cycles after it was written.
There is no reset: both domains must be reset-less (or never reset after start-up), and the
FIFO starts empty from its initial values.
"""

from amaranth import Cat, Module, Signal
from amaranth.lib import wiring
from amaranth.lib.cdc import FFSynchronizer
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out


def _gray(value):
    return value ^ (value >> 1)


def _binary(gray, bits):
    out = [gray[bits - 1]]
    for i in reversed(range(bits - 1)):
        out.insert(0, out[0] ^ gray[i])
    return Cat(*out)


class AsyncFifo(wiring.Component):
    def __init__(self, width: int, depth: int, *, w_domain: str, r_domain: str):
        if depth < 4 or depth & (depth - 1):
            raise ValueError(f"depth must be a power of two of at least 4, not {depth}")
        self.width, self.depth = width, depth
        self.w_domain, self.r_domain = w_domain, r_domain
        super().__init__({
            "w_data": In(width), "w_en": In(1), "w_rdy": Out(1),
            "r_data": Out(width), "r_en": In(1), "r_rdy": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        bits = self.depth.bit_length()          # pointers count to 2 x depth
        w, r = m.d[self.w_domain], m.d[self.r_domain]
        m.submodules.storage = storage = Memory(shape=self.width, depth=self.depth, init=[])
        write = storage.write_port(domain=self.w_domain)
        read = storage.read_port(domain="comb")
        w_ptr, w_gray = Signal(bits), Signal(bits)
        r_ptr, r_gray = Signal(bits), Signal(bits)

        # Write side: the read pointer as last seen, and whether there is room.
        r_gray_w, r_ptr_w = Signal(bits), Signal(bits)
        m.submodules.r_sync = FFSynchronizer(r_gray, r_gray_w, o_domain=self.w_domain)
        full = Signal()
        do_write = self.w_en & ~full
        m.d.comb += [
            self.w_rdy.eq(~full),
            write.addr.eq(w_ptr[:-1]), write.data.eq(self.w_data), write.en.eq(do_write),
        ]
        w += [
            w_ptr.eq(w_ptr + do_write), w_gray.eq(_gray(w_ptr)),
            r_ptr_w.eq(_binary(r_gray_w, bits)),
            # At most one entry is written in this cycle, so there is room in the next if at
            # most depth - 2 are held now (as far as the write side knows).
            full.eq((w_ptr - r_ptr_w)[:bits] >= self.depth - 1),
        ]

        # Read side: the write pointer as last seen; the output register is loaded from the
        # entry at the read pointer when it has been written and the output is free.
        w_gray_r, w_ptr_r = Signal(bits), Signal(bits)
        m.submodules.w_sync = FFSynchronizer(w_gray, w_gray_r, o_domain=self.r_domain)
        # The output register takes whatever the storage holds at the read pointer whenever
        # it is free, so that its enable does not wait for the emptiness compare.
        free = ~self.r_rdy | self.r_en
        filled = r_ptr != w_ptr_r
        m.d.comb += read.addr.eq(r_ptr[:-1])
        r += [w_ptr_r.eq(_binary(w_gray_r, bits)), r_gray.eq(_gray(r_ptr))]
        with m.If(free):
            r += [self.r_data.eq(read.data), self.r_rdy.eq(filled), r_ptr.eq(r_ptr + filled)]
        return m
