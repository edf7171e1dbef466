"""Property 2's rows, on the aggregator's sums stage (`hw.aggregator_sums.Sums`).

`hw.formal.aggregate` proves which commands the decide stage queues for a use (OVERWRITE
begins it, ADD adds to it, a completion, a CLOSE or a REPLAY sends it, a drained packet
sends nothing) and that a result's command carries the use's count. `SumsHarness` proves
what the sums stage makes of those commands: the real `Sums`, with 1 port, beats of 64 bits
(two int32 lanes), 2 slots and payloads of up to 16 bytes (2 rows a copy, 8 rows in all),
takes any command in any cycle (any action but CONTROL, slot, version, emit, ports,
descriptor; a null contribution's length as the lookup stage checks it) and any payload
beat, and the egress takes a beat whenever it likes. The control path's request and reply
are the records stage's, which serves only a CONTROL command: here they stay idle.

The harness keeps a model of each row of each slot copy (`expected`): beat k of a command's
payload is row k (modulo the rows: a drained frame may be longer), a null contribution's
beats are zeros, as many as its length's, and a lane of a beat is its payload's when its
first byte is kept, else 0. An OVERWRITE sets the row to its lanes and its exponent, with no
overflow; an ADD adds its lanes, each saturating at the int32 bounds (computed 40 bits
wide), sets the overflow bit when a lane saturated and keeps the larger exponent; DRAIN,
REPLAY and CLOSE leave the row as it is. It asserts, as property 2 (`Property.COMPLETE`):

- a beat leaves exactly for each beat of a command that emits, one cycle after it is taken,
  with the row as the model has it once the beat is added: its lanes, its exponent, and its
  overflow, or that of an earlier row of the same payload; with the command's ports and
  descriptor otherwise;
- the stage takes a payload beat only from the command's port, when the egress has room,
  and the command when its payload's last beat is taken (at once when it has none);
- a completion whose sums saturated is counted (`overflowed`) once, at its last beat.

Together with `hw.formal.aggregate`'s property 2, a result's rows are the saturating sums of
its use's contributions, in the order the decide stage queued them.

For k-induction the harness also asserts (`invariants`) that the memory holds the model's
rows (read by a port of the harness's own on the stage's memory) and that the stage's second
stage holds the beat the model took: these registers (`d_valid`, `d_row_addr`, ...) are
found by name among the signals the stage's module drives, as `hw.formal.control` finds
`Control`'s. Covers show a saturated row sent, an ADD to a row that was not zero sent
unsaturated, a use begun over an earlier one, a replay, a close and a null contribution.

A planted bug (`SumsBug`) changes the command the stage reads, in this harness's wiring.
"""

import enum

from amaranth import Array, Cat, Module, Mux, Signal, signed
from amaranth.hdl import Assert, Assume, Cover, ResetSignal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In

from ..aggregator_command import Action, command, result_descriptor, sums_row
from ..aggregator_sums import Sums
from ..beat import BeatLayout, FrameStream
from .aggregate import Property

INT32_MAX, INT32_MIN = (1 << 31) - 1, -(1 << 31)


class SumsBug(enum.Enum):
    """A fault planted in the harness's wiring of `Sums`."""
    OVERWRITE_ADDS = "the sums stage reads each OVERWRITE as an ADD"


class _OpenSums(Sums):
    """`Sums`, elaborated once, so that the harness can read the registers its module
    drives and add a read port to its memory before adding it."""

    module = None

    def elaborate(self, platform):
        if self.module is None:
            self.module = super().elaborate(platform)
        return self.module


class SumsHarness(wiring.Component):
    def __init__(self, *, invariants: bool = True, bug: SumsBug | None = None,
                 ports: int = 1, width: int = 64, max_workers: int = 3, slots: int = 2,
                 max_payload: int = 16):
        self.invariants, self.bug = invariants, bug
        self.ports, self.width, self.max_workers = ports, width, max_workers
        self.slots, self.max_payload = slots, max_payload
        super().__init__({
            "head": In(stream.Signature(command(ports, slots, max_workers))),
            "payload": In(FrameStream(width)).array(ports),
            "egress_ready": In(1),
        })

    def elaborate(self, platform):
        m = Module()
        P, W, MW = self.ports, self.width, self.max_workers
        lanes, beat_bytes = W // 32, W // 8
        sums = _OpenSums(ports=P, width=W, max_workers=MW, slots=self.slots,
                         max_payload=self.max_payload)
        module = sums.elaborate(platform)
        driven = {signal.name: signal for signal in module._driving}
        memory = module.submodules.sums
        rows, depth = sums.rows, memory.depth
        stage_read = memory.read_ports[0]
        peek = [memory.read_port(domain="comb") for _ in range(depth)]
        m.submodules.sums = sums

        # The environment: no reset after the start; commands for the rows (the records
        # stage serves CONTROL), from a port there is, a null one of a length the lookup
        # stage lets through; the egress takes a beat when it likes.
        c = self.head.payload
        m.d.comb += [
            Assume(~ResetSignal()),
            Assume(~self.head.valid | ((c.action != Action.CONTROL) & (c.action <= max(Action))
                                       & (c.port < P))),
            Assume(~(self.head.valid & c.null)
                   | ((c.desc.length >= 4) & (c.desc.length <= self.max_payload)
                      & (c.desc.length[:2] == 0))),
        ]
        # ... and the command queue holds its head until the stage takes it
        waiting = Signal()
        held = Signal.like(c, name="held")
        m.d.sync += [waiting.eq(self.head.valid & ~self.head.ready), held.eq(c)]
        m.d.comb += Assume(~waiting | (self.head.valid & (c.as_value() == held.as_value())))
        wiring.connect(m, wiring.flipped(self.head), sums.head)
        if self.bug is SumsBug.OVERWRITE_ADDS:
            with m.If(c.action == Action.OVERWRITE):
                m.d.comb += sums.head.payload.action.eq(Action.ADD)
        for p in range(P):
            wiring.connect(m, wiring.flipped(self.payload[p]), sums.payload[p])
        m.d.comb += [sums.request.ready.eq(0), sums.reply.valid.eq(0),
                     sums.egress.ready.eq(self.egress_ready)]

        # The model: each row as it should be, and the beat in flight.
        layout = sums_row(lanes)
        expected = [Signal(layout, name=f"row{a}_expected") for a in range(depth)]
        row = Signal(range(rows), name="model_row")        # the next beat's row
        port_beat = Array(s.payload for s in self.payload)[c.port]
        port_valid = Array(s.valid for s in self.payload)[c.port]
        egress = sums.egress
        room = ~egress.valid | egress.ready
        takes = Signal()        # a beat of the command's payload is taken
        m.d.comb += takes.eq(self.head.valid & c.has_payload & room & (c.null | port_valid))
        last = Signal()         # ... its last
        m.d.comb += last.eq(Mux(c.null, (c.desc.length - 1) >> (beat_bytes.bit_length() - 1)
                                == row, port_beat.last))

        flight = {      # the beat taken, until it leaves the stage's second stage
            "valid": Signal(name="flight_valid"), "action": Signal(Action, name="flight_action"),
            "emit": Signal(name="flight_emit"), "last": Signal(name="flight_last"),
            "null": Signal(name="flight_null"),
            "address": Signal(range(depth), name="flight_address"),
            "lanes": [Signal(signed(32), name=f"flight_lane{i}") for i in range(lanes)],
            "ports": Signal(P, name="flight_ports"),
            "desc": Signal(result_descriptor(MW), name="flight_desc"),
            "overflow": Signal(name="flight_overflow"),   # an earlier row of its payload's
        }
        address = Cat(row, c.desc.version, c.index) if rows > 1 else Cat(c.desc.version,
                                                                       c.index)
        retires = flight["valid"] & room
        with m.If(retires):
            m.d.sync += flight["valid"].eq(0)
        with m.If(takes):
            m.d.sync += [
                flight["valid"].eq(1), flight["action"].eq(c.action), flight["emit"].eq(c.emit),
                flight["last"].eq(last), flight["null"].eq(c.null),
                flight["address"].eq(address),
                flight["ports"].eq(c.ports), flight["desc"].eq(c.desc),
                row.eq(Mux(last, 0, row + 1)),
            ]
            for i in range(lanes):
                lane = port_beat.data[32 * i: 32 * i + 32].as_signed()
                m.d.sync += flight["lanes"][i].eq(Mux(~c.null & port_beat.keep[4 * i], lane, 0))

        before = Signal(layout)         # the in-flight beat's row, before it
        m.d.comb += before.eq(Array(expected)[flight["address"]])
        after = Signal(layout)          # ... and after it
        action = flight["action"]
        adds, overwrites = action == Action.ADD, action == Action.OVERWRITE
        saturated = Signal(lanes)
        m.d.comb += after.eq(before)
        with m.If(adds | overwrites):
            for i in range(lanes):
                total = Signal(signed(40), name=f"total{i}")
                m.d.comb += total.eq(Mux(adds, before.lanes[i], 0) + flight["lanes"][i])
                high, low = total > INT32_MAX, total < INT32_MIN
                m.d.comb += [saturated[i].eq(high | low),
                             after.lanes[i].eq(Mux(high, INT32_MAX, Mux(low, INT32_MIN, total)))]
            exponent = flight["desc"].exponent
            m.d.comb += [
                after.overflow.eq((adds & before.overflow) | saturated.any()),
                after.exponent.eq(Mux(adds & (before.exponent > exponent), before.exponent,
                                      exponent)),
            ]
        with m.If(retires):
            with m.If(adds | overwrites):
                m.d.sync += Array(expected)[flight["address"]].eq(after)
            m.d.sync += flight["overflow"].eq(~flight["last"]
                                              & (flight["overflow"] | after.overflow))

        checks = []

        def check(prop, test, name):
            checks.append(Assert(test, name, src_loc_at=1))

        out = egress.payload
        sent = out.desc
        check(Property.COMPLETE, egress.valid == (flight["valid"] & flight["emit"]),
              "a beat leaves exactly for each beat of a command that emits")
        check(Property.COMPLETE, ~egress.valid | ((out.beat.data == after.lanes.as_value())
                                                  & (sent.exponent == after.exponent)
                                                  & (sent.overflow == (flight["overflow"]
                                                                       | after.overflow))),
              "a result beat carries its row's saturating sums, exponent and overflow")
        same = [getattr(sent, name) == getattr(flight["desc"], name)
                for name, _ in result_descriptor(MW) if name not in ("exponent", "overflow")]
        check(Property.COMPLETE, ~egress.valid | ((out.ports == flight["ports"])
                                                  & (out.beat.last == flight["last"])
                                                  & Cat(*same).all()),
              "a result beat carries its command's ports and descriptor")
        for p, s in enumerate(self.payload):
            check(Property.COMPLETE, s.ready == (takes & ~c.null & (c.port == p)),
                  f"a beat of port {p} is taken only for the command, when there is room")
        check(Property.COMPLETE,
              self.head.ready == (self.head.valid & (~c.has_payload | (takes & last))),
              "a command is done at its payload's last beat")
        completes = (adds | overwrites | (action == Action.CLOSE)) & flight["last"]
        check(Property.COMPLETE, sums.overflowed == (egress.valid & egress.ready & completes
                                                     & (flight["overflow"] | after.overflow)),
              "a completion whose sums saturated is counted once, at its last beat")
        m.d.comb += checks

        if self.invariants:
            self._invariants(m, driven, stage_read, peek, expected, flight, row, before)
            # a payload's later rows only under its command, held, and within its length
            within = ~held.null | (row * beat_bytes < held.desc.length)
            m.d.comb += Assert((row == 0) | (waiting & held.has_payload & within))
        self._covers(m, egress, flight, before, after, saturated, adds, overwrites)
        return m

    def _invariants(self, m, driven, stage_read, peek, expected, flight, row, before):
        """The memory holds the model's rows; the stage's second stage holds the beat in
        flight, with its row as read (the row before the beat); its row counter is the
        model's."""
        lanes = self.width // 32
        for a, port in enumerate(peek):
            m.d.comb += [port.addr.eq(a),
                         Assert(port.data.as_value() == expected[a].as_value())]
        beat = BeatLayout(self.width)(driven["d_beat"])
        desc = result_descriptor(self.max_workers)(driven["d_desc"])
        m.d.comb += [
            Assert(driven["d_valid"] == flight["valid"]),
            Assert(driven["d_overflow"] == flight["overflow"]),
            Assert(driven["row"] == row),
        ]
        with m.If(flight["valid"]):
            m.d.comb += [
                Assert(driven["d_action"] == flight["action"]),
                Assert(driven["d_emit"] == flight["emit"]),
                Assert(driven["d_row_addr"] == flight["address"]),
                Assert(driven["d_ports"] == flight["ports"]),
                Assert(desc.as_value() == flight["desc"].as_value()),
                Assert(beat.last == flight["last"]),
                Assert(stage_read.data.as_value() == before.as_value()),
            ]
            for i in range(lanes):
                lane = Mux(beat.keep[4 * i], beat.data[32 * i: 32 * i + 32], 0)
                m.d.comb += Assert(lane == flight["lanes"][i].as_unsigned())

    def _covers(self, m, egress, flight, before, after, saturated, adds, overwrites):
        sent = egress.valid & egress.ready
        action = flight["action"]
        m.d.comb += [
            Cover(sent & adds & saturated.any(), "a saturated row is sent"),
            Cover(sent & adds & ~saturated.any() & (before.lanes[0] != 0)
                  & (flight["lanes"][0] != 0) & (after.lanes[0] != 0),
                  "an ADD to a row that was not zero is sent unsaturated"),
            Cover(sent & overwrites & (before.lanes.as_value() != 0)
                  & (after.lanes.as_value() != before.lanes.as_value()),
                  "a use begins over an earlier one's row"),
            Cover(sent & (action == Action.REPLAY) & (before.lanes.as_value() != 0),
                  "a row is replayed"),
            Cover(sent & (action == Action.CLOSE) & (before.lanes.as_value() != 0),
                  "a row is closed"),
            Cover(sent & flight["last"] & (flight["overflow"] & ~after.overflow),
                  "an earlier row's overflow is carried to the last beat"),
            Cover(sent & adds & flight["null"] & (before.lanes.as_value() != 0),
                  "a null contribution's zeros are added to a row"),
        ]
