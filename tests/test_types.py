"""A type checker resolves every import of the project: `ty check` (Astral's checker, the
`test` extra; skipped where its binary is missing) over what `[tool.ty.src]` includes
(netagg/, tests/, noxfile.py), against this interpreter's environment, reports no import it
cannot resolve.

Only unresolved imports are held here (`import-not-found`, formerly `unresolved-import`, and
`missing-module-member`, a `from m import name` that m lacks): ty's other diagnostics are not
this test's. An import of a package the environment's site-packages do not have at all (an
optional dependency left out: torch without the `torch` extra, nox outside a nox session) is
not the project's fault and is left out; any other (a module of netagg or tests it cannot
find, a sys.path hack, an import by a path relative to a directory on sys.path) is.
"""

from __future__ import annotations

import importlib.machinery
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RULES = ("import-not-found", "unresolved-import", "missing-module-member")
_MODULE = re.compile(r"(?:Cannot resolve imported module|Module) `([^`]+)`")


def _ty() -> str | None:
    """The ty binary: beside this interpreter (a virtual environment's), else on PATH."""
    beside = Path(sys.executable).parent / "ty"
    return str(beside) if beside.exists() else shutil.which("ty")


def _absent(line: str) -> bool:
    """Whether an unresolved import's top-level package is one the environment lacks
    altogether (an optional dependency not installed): neither the project's (a module or
    package at the root or in tests/, which is what a bare `import frames` means) nor in the
    standard library or site-packages. sys.path is not asked: what the test run added to it
    is what a type checker does not see."""
    found = _MODULE.search(line)
    if found is None:
        return False
    top = found.group(1).split(".")[0]
    if any((d / top).is_dir() or (d / f"{top}.py").exists() for d in (ROOT, ROOT / "tests")):
        return False
    paths = sysconfig.get_paths()
    where = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    return top not in sys.builtin_module_names \
        and importlib.machinery.PathFinder.find_spec(top, where) is None


def unresolved_imports() -> list[str]:
    ty = _ty()
    if ty is None:
        pytest.skip("ty is not installed (pip install -e .[test])")
    run = subprocess.run([ty, "check", "--python", sys.prefix, "--output-format", "concise",
                          "--exit-zero", "--no-progress"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = (run.stdout + run.stderr).splitlines()
    return [line for line in lines
            if any(f"[{rule}]" in line for rule in RULES) and not _absent(line)]


def test_ty_resolves_every_import_of_the_project():
    found = unresolved_imports()
    assert not found, "imports ty cannot resolve:\n" + "\n".join(found)
