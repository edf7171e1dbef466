"""The MAC's byte streams: the layouts of a byte on its way between GMII and the beat side
(with the frame's FCS verdict and, on the boards, its ICRC verdict), and the byte-serial
CRC-32 that both the FCS (`hw.mac`) and the ICRC stages (`hw.mac_icrc`) fold in, one byte a
cycle.
"""

from amaranth import Cat
from amaranth.lib import data

CRC_POLY = 0xEDB88320   # reflected IEEE 802.3

BYTE = data.StructLayout({"data": 8, "last": 1})
CHECKED_BYTE = data.StructLayout({"data": 8, "last": 1, "ok": 1})
ICRC_CHECKED_BYTE = data.StructLayout({"data": 8, "last": 1, "ok": 1, "icrc_ok": 1})


def crc32_byte(crc, byte):
    """The CRC-32 register after one more byte (LSB first): an XOR network, derived by
    running the bitwise algorithm on each input bit alone (the map is linear)."""
    def step(c, d):
        for i in range(8):
            c = (c >> 1) ^ (CRC_POLY if (c ^ (d >> i)) & 1 else 0)
        return c
    terms = [[] for _ in range(32)]
    inputs = [(crc[i], 1 << i, 0) for i in range(32)] + [(byte[i], 0, 1 << i) for i in range(8)]
    for signal, c, d in inputs:
        out = step(c, d)
        for bit in range(32):
            if out >> bit & 1:
                terms[bit].append(signal)
    out = []
    for bit in range(32):
        value = terms[bit][0]
        for term in terms[bit][1:]:
            value = value ^ term
        out.append(value)
    return Cat(*out)
