"""The gateware's view of the wire: an `amaranth.lib.data.StructLayout` for each header the
contract declares (`netagg.contract.headers`, whose fields, opcodes and limits the gateware
reads from there), and the one place where byte order is handled.

A layout lists the contract's fields reversed, so that the header's first wire field is its
most significant bits. On the wire the first byte is sent first; in a beat it is the least
significant byte (see `netagg.hw.beat`). `from_wire` turns a run of wire bytes into a header
value by reversing the byte order once, which makes the whole header one big-endian number
whose first field is its top bits; `to_wire` does the inverse. No field accessor anywhere
else swaps bytes.
"""

from amaranth import Cat, Const, Signal, unsigned
from amaranth.lib import data

from netagg.contract import headers as C


class Header(data.StructLayout):
    """The layout of the contract's header `header` (its fields, most significant first)."""

    def __init__(self, header: C.Header):
        self.contract = header
        self.name, self.length, self.wire_fields = header.name, header.length, header.wire_fields
        super().__init__(dict(reversed(list(header.wire_fields.items()))))

    def __repr__(self):
        return f"Header({self.name!r})"

    def byte_offset(self, name: str) -> int:
        return self.contract.byte_offset(name)

    def field_offsets(self):
        return self.contract.field_offsets()


def from_wire(layout: data.Layout, wire):
    """View `len(layout)/8` wire bytes (first byte least significant) as a header value."""
    nbytes = layout.size // 8
    wire = Cat(wire)
    return layout(Cat(*(wire[8 * i : 8 * i + 8] for i in reversed(range(nbytes)))))


def to_wire(value):
    """The wire bytes of a header value, first byte least significant."""
    bits = Cat(value.as_value() if isinstance(value, data.View) else value)
    nbytes = len(bits) // 8
    return Cat(*(bits[8 * i : 8 * i + 8] for i in reversed(range(nbytes))))


ETHERNET, IPV4, UDP, BTH = Header(C.ETHERNET), Header(C.IPV4), Header(C.UDP), Header(C.BTH)
RETH, IMMDT, AETH = Header(C.RETH), Header(C.IMMDT), Header(C.AETH)
REQUEST_IMM, RESULT_IMM = Header(C.REQUEST_IMM), Header(C.RESULT_IMM)
CONTRIBUTION_VA, PARTIAL = Header(C.CONTRIBUTION_VA), Header(C.PARTIAL)
NONFINITE_LANE, CONTROL_RECORD = Header(C.NONFINITE_LANE), Header(C.CONTROL_RECORD)


def payload_start(m, opclass, beat_bytes: int):
    """Where the payload of a frame of class `opclass` starts, for beats of `beat_bytes`:
    (extension headers' length, index of the beat holding the first payload byte, its lane
    in that beat), as Signals driven combinationally in module `m`. The parser and the
    deparser both place the payload with these."""
    ext_length = Signal(range(C.MAX_EXT_LENGTH + 1))
    first_beat = Signal(range(C.MAX_HEADER_LENGTH // beat_bytes + 1))
    lane = Signal(range(beat_bytes))
    with m.Switch(opclass):
        for cls, length in C.EXT_LENGTH.items():
            with m.Case(cls):
                m.d.comb += [
                    ext_length.eq(length),
                    first_beat.eq((C.EXT_OFFSET + length) // beat_bytes),
                    lane.eq((C.EXT_OFFSET + length) % beat_bytes),
                ]
    return ext_length, first_beat, lane


# What travels on a header stream: every header, the opcode's class, the payload length
# (without pad and ICRC) and the parser's verdict. The deparser reads the same layout and
# ignores the verdict and the lengths and checksums it computes itself.
PACKET_HEADER = data.StructLayout({
    "eth": ETHERNET,
    "ip": IPV4,
    "udp": UDP,
    "bth": BTH,
    "reth": RETH,
    "immdt": IMMDT,
    "aeth": AETH,
    "opclass": unsigned(max(C.OpClass).bit_length()),
    "payload_length": unsigned(16),
    "verdict": unsigned(max(C.Verdict).bit_length()),
})


def opclass_rom():
    """(supported, class) for every opcode, as a list of 256 constants for a ROM."""
    return [
        Const(((1 if op in C.OPCODE_CLASSES else 0) << 3) | int(C.OPCODE_CLASSES.get(op, 0)), 4)
        for op in range(256)
    ]


def ones_complement_fold(total):
    """A sum of 16-bit words folded to their 16-bit one's complement sum."""
    folded = total[:16] + total[16:]
    return (folded[:16] + folded[16:])[:16]


def ipv4_checksum_sum(wire_bytes):
    """One's complement sum of the 16-bit words of an IPv4 header, folded to 16 bits."""
    words = [Cat(wire_bytes[2 * i + 1], wire_bytes[2 * i]) for i in range(len(wire_bytes) // 2)]
    return ones_complement_fold(sum(words))


def is_control(bth):
    """Whether a packet with this BTH is a control request."""
    return (bth.opcode == C.OP_CONTROL) & (bth.dqpn == C.CONTROL_QPN)
