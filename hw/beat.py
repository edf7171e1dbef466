"""Frames on a stream: the beat layout shared by every stage of the datapath.

A frame is a sequence of beats of `width` bits. Byte ``i`` of a beat is ``data[8*i:8*i+8]``
(the first byte on the wire is the least significant), ``keep[i]`` says whether it holds a
byte of the frame, and ``last`` marks the frame's final beat. Every beat but the last is full;
the last holds ``1..width/8`` bytes, packed from byte 0. Streams of beats follow
`amaranth.lib.stream`'s rules.
"""

from amaranth import unsigned
from amaranth.lib import data, stream

WIDTHS = (64, 128, 256, 512)


def check_width(width: int) -> int:
    if not isinstance(width, int) or width not in WIDTHS:
        raise ValueError(f"datapath width must be one of {WIDTHS}, not {width!r}")
    return width


def check_wide_width(width: int) -> int:
    """Widths inside the switch, where ports' beats are gathered, may be wider."""
    if not isinstance(width, int) or width < 64 or width & (width - 1):
        raise ValueError(f"beat width must be a power of two of at least 64, not {width!r}")
    return width


class BeatLayout(data.StructLayout):
    """One beat of a frame: ``data``, ``keep`` (byte enables) and ``last``."""

    def __init__(self, width: int):
        check_wide_width(width)
        self.width = width
        self.bytes = width // 8
        super().__init__({"data": unsigned(width), "keep": unsigned(width // 8), "last": 1})

    def __eq__(self, other):
        return isinstance(other, BeatLayout) and other.width == self.width

    def __hash__(self):
        return hash((BeatLayout, self.width))

    def __repr__(self):
        return f"BeatLayout({self.width})"


def FrameStream(width: int) -> stream.Signature:
    """The signature of a stream of frame beats."""
    return stream.Signature(BeatLayout(width))
