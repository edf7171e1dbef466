"""The examples in README.md and docs/*.md run, or at least parse.

Every fenced block is taken by its language: ```python blocks run in a subprocess; ```sh,
```bash and ```console blocks are command lines (`netagg` is `python -m netagg.apps.cli`,
`python` this interpreter), run with bash; ```text and ```json are output or data, not run.
A block that needs what the default tests cannot give says so in an HTML comment on the line
before it, `<!-- example: WHAT[, WHAT] -->`, WHAT one of `MARKS`:

- every marked block still parses: Python compiles, shell passes `bash -n`, and each `netagg`
  command line in it is accepted by the CLI's own parser (`parse_args`, nothing run); a
  synopsis's `[optional]` parts are kept, `a|b` takes `a`, `[x | y]` takes `x`;
- "needs root" (and nothing else: under ~30 s, whole as below) runs when the tests run as root;
- "slow" runs under `-m slow` when its command lines are whole (no `[...]` synopsis, no
  placeholder in capitals such as HOST or FILE, nothing left serving) and it needs nothing else;
- "writes the docs" (it rewrites files under docs/) is never run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKS = {"needs root", "needs a board", "needs a GPU", "needs network", "slow", "writes the docs"}
RUN = {"python", "sh", "bash", "console"}
NOT_RUN = {"text", "json"}
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!-- example: (.+?) -->$")
# an address a synopsis leaves to the reader (the parser resolves addresses)
PLACEHOLDER = re.compile(r"\b(HOST|IP|ADDR)\b")


@dataclass
class Example:
    doc: str
    line: int
    lang: str
    marks: frozenset
    code: str

    @property
    def id(self):
        return f"{self.doc}:{self.line}"


def examples(path: Path) -> list[Example]:
    lines = path.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
        mark = MARK.match(lines[i - 1]) if i else None
        marks = frozenset(s.strip() for s in mark.group(1).split(",")) if mark else frozenset()
        out.append(Example(str(path.relative_to(ROOT)), i + 1, m.group(1), marks,
                           "\n".join(lines[i + 1:j]) + "\n"))
        i = j + 1
    return out


ALL = [e for doc in DOCS for e in examples(doc)]


def pick(lang, test):
    chosen = [e for e in ALL if e.lang in lang and test(e)]
    return pytest.mark.parametrize("example", chosen, ids=[e.id for e in chosen])


def env():
    paths = [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


PRELUDE = f"""set -e
netagg() {{ {shlex.quote(sys.executable)} -m netagg.apps.cli "$@"; }}
python() {{ {shlex.quote(sys.executable)} "$@"; }}
python3() {{ {shlex.quote(sys.executable)} "$@"; }}
"""


def run_shell(example, tmp_path, timeout):
    done = subprocess.run(["bash", "-c", PRELUDE + example.code], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{example.id} exited {done.returncode}:\n" \
        f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def command_lines(code: str) -> list[list[str]]:
    """The shell block's commands as token lists: continuations joined (a trailing backslash,
    or a synopsis's indented next line), comments and a trailing `&` dropped."""
    joined: list[str] = []
    for line in code.split("\n"):
        if joined and (joined[-1].endswith("\\") or (line.startswith(" ") and line.strip())):
            joined[-1] = joined[-1].rstrip("\\") + " " + line.strip()
        elif line.strip():
            joined.append(line)
    out = []
    for line in joined:
        tokens = shlex.split(line, comments=True)
        while tokens and tokens[-1] in ("&", "\\"):
            tokens.pop()
        if tokens:
            out.append(tokens)
    return out


def netagg_argv(tokens: list[str]) -> list[str] | None:
    """The arguments of the `netagg` command in a command line (after `ip netns exec NAME`,
    `timeout N` or variable assignments), a synopsis reduced to one call; None if none."""
    if "netagg" not in tokens:
        return None
    args, out, depth, skip = tokens[tokens.index("netagg") + 1:], [], 0, None
    for token in args:
        if token in (">", ">>", "<", "2>", "&&", "||", ";") or (token == "|" and not depth):
            break                               # a redirection or the next command
        core = token.strip("[]")
        depth += len(token) - len(token.lstrip("["))
        if skip is None:
            if core == "|" and depth:
                skip = depth
            elif core == "...":
                if out and out[-1].startswith("--") and token.endswith("]"):
                    out.pop()
            elif core:
                out.append(core.split("|")[0] if not core.startswith("|") else core)
        depth -= len(token) - len(token.rstrip("]"))
        if skip is not None and depth < skip:
            skip = None
    return [PLACEHOLDER.sub("127.0.0.1", token) for token in out]


def parses(argv, monkeypatch, tmp_path):
    """Whether the CLI's parser accepts argv (nothing runs), in a folder where the files the
    line names (fabric.json, say: written by an earlier step of its doc) exist."""
    from netagg.apps import cli
    monkeypatch.chdir(tmp_path)
    for token in argv:
        if re.fullmatch(r"[\w-]+\.json", token):
            (tmp_path / token).write_text("{}")
    try:
        _, unknown = cli.parser().parse_known_args(argv)
    except SystemExit:
        return False
    return not unknown


def whole(example) -> bool:
    """A block the slow run can run as written: no synopsis, no placeholder, no server."""
    code = "\n".join(" ".join(tokens) for tokens in command_lines(example.code))
    return not (re.search(r"\[|\]|\.\.\.|\b[A-Z]{3,}\b(?!=)", code)
                or re.search(r"sim serve|sim board|cluster up", code))


def test_blocks_are_known():
    """Every fence has a language the test knows, and every mark is one of MARKS."""
    for e in ALL:
        assert e.lang in RUN | NOT_RUN, f"{e.id}: fence language {e.lang!r}"
        assert e.marks <= MARKS, f"{e.id}: marks {sorted(e.marks - MARKS)}"
    assert any(e.lang == "python" and not e.marks for e in ALL)


@pick({"python"}, lambda e: not e.marks)
def test_python_runs(example, tmp_path):
    done = subprocess.run([sys.executable, "-c", example.code], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{example.id}:\n{done.stderr[-3000:]}"


@pick({"python"}, lambda e: e.marks)
def test_marked_python_compiles(example):
    compile(example.code, example.id, "exec")


@pick({"sh", "bash", "console"}, lambda e: True)
def test_shell_parses(example, monkeypatch, tmp_path, capsys):
    done = subprocess.run(["bash", "-n"], input=example.code, capture_output=True, text=True)
    assert done.returncode == 0, f"{example.id}: {done.stderr}"
    for tokens in command_lines(example.code):
        argv = netagg_argv(tokens)
        if argv is not None:
            assert parses(argv, monkeypatch, tmp_path), \
                f"{example.id}: netagg {' '.join(argv)}: {capsys.readouterr().err}"


@pick({"sh", "bash", "console"}, lambda e: not e.marks)
def test_shell_runs(example, tmp_path):
    run_shell(example, tmp_path, timeout=120)


@pick({"sh", "bash", "console"}, lambda e: e.marks == {"needs root"} and whole(e))
def test_root_shell_runs(example, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root")
    run_shell(example, tmp_path, timeout=60)


@pytest.mark.slow
@pick({"sh", "bash", "console"}, lambda e: "slow" in e.marks and whole(e)
      and e.marks <= {"slow", "needs root"})
def test_slow_shell_runs(example, tmp_path):
    if "needs root" in example.marks and os.geteuid() != 0:
        pytest.skip("needs root")
    run_shell(example, tmp_path, timeout=1800)


def test_synopsis_reduction():
    """How a synopsis becomes one call."""
    line = shlex.split("netagg train --cluster [--hosts 4 | --topology 2x2 --spray] "
                       "[--backend golden|rtl] [--runs ...] [--json]")
    assert netagg_argv(line) == ["train", "--cluster", "--hosts", "4", "--backend", "golden",
                                 "--json"]
    assert netagg_argv(shlex.split("netagg bench loss --json > x.json")) == \
        ["bench", "loss", "--json"]
    assert netagg_argv(["ip", "netns", "exec", "n", "netagg", "probe", "udp://h:1"]) == \
        ["probe", "udp://h:1"]
    assert command_lines("a \\\n  b  # c\nnetagg x [--y 1]\n    [--z] &\n") == \
        [["a", "b"], ["netagg", "x", "[--y", "1]", "[--z]"]]
