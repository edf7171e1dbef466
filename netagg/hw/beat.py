"""Frames on a stream: the beat layout shared by every stage of the datapath.

A frame is a sequence of beats of `width` bits. Byte ``i`` of a beat is ``data[8*i:8*i+8]``
(the first byte on the wire is the least significant), ``keep[i]`` says whether it holds a
byte of the frame, and ``last`` marks the frame's final beat. Every beat but the last is full;
the last holds ``1..width/8`` bytes, packed from byte 0. Streams of beats follow
`amaranth.lib.stream`'s rules.

A port whose MAC checks the ICRC (`hw.mac.Mac` with ``icrc=True``) gives beats with one more
field, ``icrc_ok``: on a frame's last beat, whether the frame's ICRC was right.
"""

from amaranth import Signal, unsigned
from amaranth.lib import data, stream

WIDTHS = (64, 128, 256, 512)


def check_width(width: int) -> int:
    if not isinstance(width, int) or width not in WIDTHS:
        raise ValueError(f"datapath width must be one of {WIDTHS}, not {width!r}")
    return width


def check_icrc(icrc: str) -> str:
    """Where a stage's ICRC is done: "engine" (`hw.icrc`, in the stage) or "mac" (by the MAC in
    front of the port, the beats then checked)."""
    if icrc not in ("engine", "mac"):
        raise ValueError(f"icrc must be 'engine' or 'mac', not {icrc!r}")
    return icrc


def check_wide_width(width: int) -> int:
    """Widths inside the switch, where ports' beats are gathered, may be wider."""
    if not isinstance(width, int) or width < 64 or width & (width - 1):
        raise ValueError(f"beat width must be a power of two of at least 64, not {width!r}")
    return width


class BeatLayout(data.StructLayout):
    """One beat of a frame: ``data``, ``keep`` (byte enables) and ``last``; with `checked`,
    also ``icrc_ok`` (read on the last beat)."""

    def __init__(self, width: int, checked: bool = False):
        check_wide_width(width)
        self.width = width
        self.bytes = width // 8
        self.checked = checked
        fields = {"data": unsigned(width), "keep": unsigned(width // 8), "last": 1}
        super().__init__({**fields, "icrc_ok": 1} if checked else fields)

    def __eq__(self, other):
        return (isinstance(other, BeatLayout) and other.width == self.width
                and other.checked == self.checked)

    def __hash__(self):
        return hash((BeatLayout, self.width, self.checked))

    def __repr__(self):
        return f"BeatLayout({self.width}{', checked=True' if self.checked else ''})"


def FrameStream(width: int, checked: bool = False) -> stream.Signature:
    """The signature of a stream of frame beats (with ``icrc_ok`` when `checked`)."""
    return stream.Signature(BeatLayout(width, checked))


def beat_index(m, fire, last, name: str = "index") -> Signal:
    """A beat's index within its frame: counts beats taken (`fire`), back to 0 after `last`,
    and stays at 0xFFFF in a frame that long."""
    index = Signal(unsigned(16), name=name)
    with m.If(fire):
        with m.If(last):
            m.d.sync += index.eq(0)
        with m.Elif(index != 0xFFFF):
            m.d.sync += index.eq(index + 1)
    return index
