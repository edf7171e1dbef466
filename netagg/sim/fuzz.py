"""Differential fuzzing of the switch: one seeded stream of frames into the switch's RTL
(`sim.model`) and into its golden model (`sim.golden`), every output compared.

The stream (`stream`) is good traffic (`sim.fuzz_traffic`: jobs configured through the
control path as the host configures them, then uses of their slots by every worker, so that
uses complete, duplicates are dropped, results are replayed and, between ticks of the
deadlines' clock, uses past their deadline close short, and a read of every register
and counter at the end of each epoch) interleaved with mutated copies of recent good frames
(`sim.fuzz_mutations`), sometimes ahead of the good frame they come from, so that they may
take its place. The same seed gives the same frames.

The comparer (`Comparer`) sends the stream in batches of at most one frame per port (a
control request alone; a tick alone, to both switches' `tick`; a leaf's link change alone,
to both), runs the RTL until its ports
are quiet, and applies the batch to the golden model in the switch's commit order (the frame
that ends first, then the lower port), so the two see the same thing. It compares:

- every frame out, port by port, byte for byte: a frame one side sends and the other does not,
  or sends different bytes, is a difference, reported with the index and bytes of the input
  frame that made it (the golden model's) and both outputs;
- every register and counter at each read (each epoch's end and the stream's end), value by
  value, by name;
- every result's sums and count against a ledger kept apart from the golden model's slot
  state: the int32 lanes of the contributions counted into each use, summed with saturation,
  and how many of them brought data (a result that differs is a wrong sum).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import random
import time
from collections.abc import Iterable, Iterator

import numpy as np

from netagg.contract import wire as W
from netagg.sim.codec import OK, contribution, decode
from netagg.sim.fuzz_mutations import Mutator
from netagg.sim.fuzz_spine import partial_of
from netagg.sim.fuzz_traffic import HOST, SWITCH, Frame, Kind, Traffic, reads, register_names

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
MUTATION_RATE = 0.5           # mutated frames per good frame after it (a fifth more ahead)
DETAILS = 20                  # differences reported in full; the rest are counted
CONTROL_IDLE = 600            # quiet cycles that end a run after a control request (64 records)
LATE_CYCLES = 1 << 16         # how long to wait for a frame the golden model sent


def stream(seed: int, frames: int, *, ports: int = 4, jobs: int = 4, max_workers: int = 8,
           slots: int = 64, max_payload: int = W.MAX_PAYLOAD,
           mutation_rate: float = MUTATION_RATE, spine: bool = False,
           leaf: bool = False) -> Iterator[Frame]:
    """`frames` frames of good traffic and mutations, the same for the same seed; with
    `spine`, leaves' partials to a spine (`sim.fuzz_spine`); with `leaf`, a leaf's local
    traffic, its jobs with a parent (`sim.fuzz_leaf`)."""
    rng = random.Random(seed)
    if leaf:
        from netagg.sim.fuzz_leaf import leaf_parts
        traffic, mutator = leaf_parts(rng, ports, jobs, max_workers, slots, max_payload, HOST,
                                      SWITCH)
    elif spine:
        from netagg.sim.fuzz_spine import spine_parts
        traffic, mutator = spine_parts(rng, ports, jobs, max_workers, slots, max_payload, HOST,
                                       SWITCH)
    else:
        traffic = Traffic(rng, ports, jobs, max_workers, slots, max_payload)
        mutator = Mutator(rng, ports, jobs, max_workers, HOST, SWITCH, traffic.keys)
    recent: list[Frame] = []
    sent = 0

    def mutated(source: Frame) -> Frame:
        data, kind, note = mutator.mutate(source.data)
        return Frame(source.port if rng.random() < 0.5 else rng.randrange(ports), data, kind,
                     note)

    while sent < frames:
        for good in traffic.epoch():
            if good.kind.mutable and rng.random() < mutation_rate / 5 and sent < frames - 1:
                yield mutated(good)       # ahead of its good frame: it may take its place
                sent += 1
            yield good
            sent += 1
            if good.kind.mutable:
                recent = recent[-63:] + [good]
            while recent and sent < frames and rng.random() < mutation_rate / (1 + mutation_rate):
                yield mutated(rng.choice(recent))
                sent += 1
            if sent >= frames:
                return


class DiffKind(enum.Enum):
    OUTPUT = "output"          # a frame out that only one side sends, or with other bytes
    REGISTER = "register"      # a register or counter read differs
    WRONG_SUM = "wrong sum"    # a result whose sums or count are not its use's
    HANG = "hang"              # the RTL did not go quiet


@dataclasses.dataclass
class Difference:
    kind: DiffKind
    index: int                 # the input frame's index in the stream
    port: int                  # where the frame went out (OUTPUT, WRONG_SUM) or came in
    input: str                 # the input frame, hex
    rtl: str | None            # the RTL's output frame (hex), or value
    golden: str | None         # the golden model's
    note: str = ""             # the mutation, the register, the side with a wrong sum

    def text(self) -> str:
        return (f"{self.kind.value} at frame {self.index} (port {self.port}) {self.note}\n"
                f"  input  {self.input}\n  rtl    {self.rtl}\n  golden {self.golden}")


@dataclasses.dataclass
class Summary:
    seed: int
    frames: int = 0            # frames of the stream
    mutated: int = 0
    reads: int = 0             # register reads (control requests)
    batches: int = 0
    outputs: int = 0           # frames the golden model sent
    results: int = 0           # results whose sums the ledger checked
    counters: int = 0          # register and counter values compared
    differences: int = 0
    wrong_sums: int = 0
    seconds: float = 0.0
    details: list[Difference] = dataclasses.field(default_factory=list)
    minimised: list[dict] = dataclasses.field(default_factory=list)   # the first difference's

    def text(self) -> str:
        lines = [f"seed {self.seed}: {self.frames} frames ({self.mutated} mutated) in "
                 f"{self.batches} batches, {self.outputs} frames out, {self.results} results' "
                 f"sums checked, {self.counters} register values compared in {self.reads} "
                 f"reads: {self.differences} differences, {self.wrong_sums} wrong sums "
                 f"({self.seconds:.1f} s)"]
        lines += [d.text() for d in self.details]
        if self.minimised:
            lines.append(f"the first difference, minimised to {len(self.minimised)} frames:")
            lines += [f"  port {f['port']} {f['kind']} {f['note']}\n    {f['data']}"
                      for f in self.minimised]
        return "\n".join(lines)

    def json(self) -> dict:
        out = dataclasses.asdict(self)
        out["details"] = [{**dataclasses.asdict(d), "kind": d.kind.value} for d in self.details]
        return out


def _saturated_sum(contributions: list[np.ndarray]) -> np.ndarray:
    total = np.zeros(len(contributions[0]), np.int64)
    for lanes in contributions:
        total = np.clip(total + lanes, INT32_MIN, INT32_MAX)
    return total.astype("<i4")


class Ledger:
    """The contributions the golden model counted into each slot copy's use, apart from its
    sums: for every completed use, the sums and the count its results must carry."""

    def __init__(self, golden):
        self.golden = golden
        self.open: dict[tuple[int, int], list[tuple[np.ndarray, bool]]] = {}
        self.done: dict[tuple[int, int], list[tuple[bytes, int]]] = {}

    def receive(self, port: int, frame: bytes) -> list:
        """The golden model's `receive`, noting what it counted."""
        g = self.golden
        verdict, header = decode(frame)
        request = contribution(frame, header) if verdict == OK else None
        if request is None or request[1].job >= g.jobs:
            return g.receive(port, frame)
        if g.from_parent(header):
            return self._from_parent(port, frame, header, request[0])
        req = request[1]
        counters = g.job_counters[req.job]
        before = counters["contributions"], counters["completed"]
        partials = getattr(g.job[req.job], "partials", False)     # a spine's job
        nulls = g.port_counters[port]["drop_priority"]
        out = g.receive(port, frame)
        key = (g.job[req.job].slot_base + req.slot, req.version)
        if counters["contributions"] == before[0]:
            if counters["completed"] != before[1]:      # closed short at its deadline
                self._done(key)
            return out
        data = g.port_counters[port]["drop_priority"] == nulls
        payload = frame[header.start:header.start + header.length] if data else \
            bytes(header.length)
        part = partial_of(frame) if partials else {"final": 0, "count": int(data)}
        if g.state[key[0]][key[1]].bitmap == 1 << req.rank or part["final"]:
            self.open[key] = []           # a new use begins, or a final is the use's sums
        self.open[key].append((np.frombuffer(payload, "<i4").astype(np.int64), part["count"]))
        if counters["completed"] != before[1]:
            self._done(key)
        return out

    def _from_parent(self, port: int, frame: bytes, header, reth) -> list:
        """A spine's frame at a leaf: a result the leaf takes is what its use's results
        carry (its sums and count, as they are)."""
        g = self.golden
        imm = W.unpack_imm(W.RESULT_IMM, reth.imm)
        if imm["job"] >= g.jobs:
            return g.receive(port, frame)
        taken = g.fabric_counters[imm["job"]]["parent_results"]
        out = g.receive(port, frame)
        if g.fabric_counters[imm["job"]]["parent_results"] != taken:
            key = (g.job[imm["job"]].slot_base + imm["slot"], imm["version"])
            done = (frame[header.start:header.start + header.length], imm["count"])
            self.done[key] = self.done.get(key, [])[-3:] + [done]
        return out

    def _done(self, key: tuple[int, int]):
        """The use open in slot copy `key` completed: what its results carry."""
        lanes = [lanes for lanes, _ in self.open[key]]
        done = (_saturated_sum(lanes).tobytes(), sum(d for _, d in self.open[key]) & 0x3F)
        self.done[key] = self.done.get(key, [])[-3:] + [done]

    def wrong(self, frame: bytes) -> bool | None:
        """Whether a result carries sums or a count other than its use's (None: not a result,
        or a use the ledger does not know)."""
        try:
            packet = W.parse_frame(frame)
        except W.WireError:
            return None
        if packet.opcode != W.OP_RESULT or packet.imm is None or not packet.payload \
                or packet.dqpn == 0:
            return None       # not a result: a spine's pull (no payload), a leaf's partial
        job, count, version, slot, _, _ = W.unpack_result_imm(packet.imm)
        if job >= self.golden.jobs:
            return True
        done = self.done.get((self.golden.job[job].slot_base + slot, version))
        return None if not done else (packet.payload, count) not in done


class Comparer:
    """Sends frames into the RTL and the golden model and compares what comes out."""

    def __init__(self, rtl, golden, seed: int = 0):
        self.rtl, self.golden, self.ledger = rtl, golden, Ledger(golden)
        self.beat = rtl.width // 8
        self.wide = self.beat << (golden.ports - 1).bit_length()    # the aggregator's beat
        self.names = register_names(golden.ports, golden.jobs, golden.max_workers)
        self.summary = Summary(seed)

    def _difference(self, d: Difference):
        if d.kind is DiffKind.WRONG_SUM:
            self.summary.wrong_sums += 1
        else:
            self.summary.differences += 1
        if len(self.summary.details) < DETAILS:
            self.summary.details.append(d)

    def run(self, frames: Iterable[Frame], batch: int | None = None,
            stop: bool = False) -> Summary:
        """Compare the switches on `frames` (then a read of every register), `batch` frames
        at a time at most (default: one per port); `stop` at the first difference."""
        s, started = self.summary, time.perf_counter()
        batch = batch or self.golden.ports
        tail = reads(self.golden.ports, self.golden.jobs, self.golden.max_workers,
                     random.Random(0), 1 << 20)
        pending: list[tuple[int, Frame]] = []
        indexed = itertools.chain(enumerate(frames), ((-1, f) for f in tail))
        for index, frame in indexed:
            if index >= 0:
                s.frames += 1
                s.mutated += frame.kind.mutated
            if pending and (frame.alone or pending[0][1].alone or len(pending) >= batch
                            or frame.port in {f.port for _, f in pending}):
                if not self._batch(pending) or (stop and s.differences + s.wrong_sums):
                    pending = []
                    break
                pending = []
            pending.append((index, frame))
        if pending:
            self._batch(pending)
        s.seconds = round(s.seconds + time.perf_counter() - started, 2)
        return s

    def _batch(self, batch: list[tuple[int, Frame]]) -> bool:
        """One batch through both switches; False if the RTL did not go quiet."""
        from netagg.sim.model import SimulationTimeout

        s = self.summary
        s.batches += 1
        if batch[0][1].kind is Kind.TICK:
            self.golden.tick()
            self.rtl.tick()
            return True
        if batch[0][1].kind is Kind.LINK:
            link = batch[0][1]
            self.golden.set_link(link.port, bool(link.data[0]))
            self.rtl.set_link(link.port, bool(link.data[0]))
            return True
        s.reads += sum(f.kind is Kind.READ for _, f in batch)
        want: dict[int, list[tuple[int, Frame, bytes]]] = {}
        for index, f in sorted(batch, key=lambda b: (-(-len(b[1].data) // self.beat),
                                                     b[1].port)):
            for port, out in self.ledger.receive(f.port, f.data):
                want.setdefault(port, []).append((index, f, out))
        for _, f in batch:
            self.rtl.send(f.port, f.data)
        # quiet for longer than the aggregator's work on the batch: then its queues are empty
        work = sum(-(-len(f.data) // self.wide) + 8 for _, f in batch)
        try:
            got = self.rtl.run(idle_cycles=CONTROL_IDLE if batch[0][1].control else 64 + work)
            for _ in range(LATE_CYCLES // 1024):     # a frame the golden model sends is late
                sent = collections.Counter(p for p, _ in got)
                if all(sent[p] >= len(w) for p, w in want.items()):
                    break
                got += self.rtl.step(1024)
        except SimulationTimeout as e:
            index, f = batch[0]
            self._difference(Difference(DiffKind.HANG, index, f.port, f.data.hex(), str(e),
                                        None, f.note))
            return False
        have: dict[int, list[bytes]] = {}
        for port, out in got:
            have.setdefault(port, []).append(out)
        for port in sorted(set(want) | set(have)):
            w, h = want.get(port, []), have.get(port, [])
            s.outputs += len(w)
            for k in range(max(len(w), len(h))):
                index, f, expected = w[k] if k < len(w) else (batch[0][0], batch[0][1], None)
                actual = h[k] if k < len(h) else None
                self._check_sums(index, f, port, expected, actual)
                if f.kind is Kind.READ and actual and expected:
                    self._compare_reads(index, f, port, actual, expected)
                elif actual != expected:
                    self._difference(Difference(
                        DiffKind.OUTPUT, index, port, f.data.hex(),
                        actual and actual.hex(), expected and expected.hex(),
                        f"{f.kind.value} {f.note}".strip()))
        return True

    def _check_sums(self, index: int, f: Frame, port: int, expected, actual):
        for side, out in (("golden", expected), ("rtl", actual)):
            if out is None or (side == "rtl" and out == expected):
                continue
            wrong = self.ledger.wrong(out)
            self.summary.results += side == "golden" and wrong is not None
            if wrong:
                self._difference(Difference(
                    DiffKind.WRONG_SUM, index, port, f.data.hex(),
                    actual and actual.hex(), expected and expected.hex(),
                    f"the {side} result's sums or count are not its use's"))

    def _compare_reads(self, index: int, f: Frame, port: int, actual: bytes, expected: bytes):
        """A read's replies, register by register."""
        values = [_records(actual), _records(expected)]
        self.summary.counters += len(values[1])
        differ = [(a, r, g) for (a, r), (_, g) in zip(*values) if r != g]
        for address, rtl, golden in differ:
            self._difference(Difference(DiffKind.REGISTER, index, port, f.data.hex(), str(rtl),
                                        str(golden), self.names.get(address, f"{address:#x}")))
        if actual != expected and not differ:
            self._difference(Difference(DiffKind.OUTPUT, index, port, f.data.hex(),
                                        actual.hex(), expected.hex(), "read reply"))


def _records(frame: bytes) -> list[tuple[int, int]]:
    """The (address, value) records of a control reply ([] if it is not one)."""
    try:
        return W.unpack_records(W.parse_frame(frame).payload)
    except (W.WireError, ValueError):
        return []


def minimise(rtl, make_golden, frames: list[Frame], batch: int | None = None) -> list[Frame]:
    """The shortest sublist of `frames` found (delta debugging) on which the RTL and the
    golden model still differ; `make_golden()` gives a fresh golden model, and the RTL is
    reset before each try."""
    def differs(candidate):
        rtl.reset()
        s = Comparer(rtl, make_golden()).run(candidate, batch, stop=True)
        return s.differences + s.wrong_sums > 0

    chunks = 2
    while len(frames) >= 2:
        size = -(-len(frames) // chunks)
        for start in range(0, len(frames), size):
            candidate = frames[:start] + frames[start + size:]
            if differs(candidate):
                frames, chunks = candidate, max(chunks - 1, 2)
                break
        else:
            if chunks >= len(frames):
                break
            chunks = min(len(frames), 2 * chunks)
    return frames


class InOrder:
    """A switch without cycles in the RTL's place (`make()` gives one: the fast switch,
    `sim.fast`): a batch sent is applied at `run`, in the switch's commit order (the frame
    that ends first on a `width`-bit port, then the lower port), as the comparer applies it
    to the golden model."""

    busy = False

    def __init__(self, make, width: int = 64):
        self.make, self.width = make, width
        self.switch = make()
        self._batch: list[tuple[int, bytes]] = []

    def send(self, port: int, frame: bytes):
        self._batch.append((port, frame))

    def run(self, idle_cycles: int = 0) -> list:
        beat = self.width // 8
        batch, self._batch = self._batch, []
        for port, frame in sorted(batch, key=lambda b: (-(-len(b[1]) // beat), b[0])):
            self.switch.send(port, frame)
        return self.switch.run()

    def step(self, cycles: int) -> list:
        return []

    def tick(self):
        self.switch.tick()

    def reset(self):
        self.switch, self._batch = self.make(), []


def golden_of(width: int = 64, spine: bool = False, leaf: bool = False):
    """The golden model the fuzzer compares the RTL with: `GoldenSwitch`, with `spine`
    `GoldenSpine`, with `leaf` a `GoldenLeaf` of `sim.fuzz_leaf.UPLINKS`."""
    if leaf:
        from netagg.sim.fuzz_leaf import UPLINKS
        from netagg.sim.golden_leaf import GoldenLeaf
        return GoldenLeaf(width=width, uplinks=UPLINKS)
    if spine:
        from netagg.sim.golden_spine import GoldenSpine
        return GoldenSpine(width=width)
    from netagg.sim.golden import GoldenSwitch
    return GoldenSwitch(width=width)


def main(frames: int, seed: int, as_json: bool = False, width: int = 64,
         shrink: bool = False, spine: bool = False, leaf: bool = False,
         against: str = "rtl") -> int:
    """`netagg fuzz`: the summary (one JSON object with `as_json`), and the first difference
    minimised with `shrink`; exit status 1 on any difference or wrong sum. With `spine`, a
    switch built as a spine against `GoldenSpine`, on leaves' partials; with `leaf`, one
    built with uplinks against `GoldenLeaf`, on a leaf's local traffic. `against` "fast":
    the fast switch (`sim.fast`) in the RTL's place (a single switch: neither `spine` nor
    `leaf`)."""
    import contextlib
    import json

    from netagg.sim.fuzz_leaf import UPLINKS

    if against == "fast":
        if spine or leaf:
            raise ValueError("the fast switch is a single switch: no --spine or --leaf")
        from netagg.sim.fast import FastSwitch
        switch = contextlib.nullcontext(InOrder(lambda: FastSwitch(width=width), width))
    elif against == "rtl":
        from netagg.sim.model import make_switch
        switch = make_switch(width=width, spine=spine, uplinks=UPLINKS if leaf else 0)
    else:
        raise ValueError(f"fuzz against rtl or fast, not {against!r}")
    with switch as rtl:
        s = Comparer(rtl, golden_of(width, spine, leaf), seed).run(
            stream(seed, frames, spine=spine, leaf=leaf))
        if shrink and s.details:
            first = s.details[0].index          # -1: the read after the stream
            upto = first + 8 if first >= 0 else None          # its batch included
            prefix = list(itertools.islice(stream(seed, frames, spine=spine, leaf=leaf),
                                           upto))
            s.minimised = [{"port": f.port, "kind": f.kind.value, "note": f.note,
                            "data": f.data.hex()}
                           for f in minimise(rtl, lambda: golden_of(width, spine, leaf),
                                             prefix)]
    print(json.dumps(s.json()) if as_json else s.text())
    return 1 if s.differences or s.wrong_sums else 0
