"""The docs' benchmark tables are what `netagg.apps.figures` renders from docs/figures/*.json
(the benchmarks' `--json` output as measured), so a table cannot drift from its run."""

from __future__ import annotations

import json

import pytest

from netagg.apps import figures as F


def test_every_table_is_its_json():
    for doc in F.DOCS:
        text = doc.read_text()
        assert F.rewrite(text) == text, \
            f"{doc.name}: a table differs from docs/figures (python -m netagg.apps.figures)"
    assert F.main(["--check"]) == 0


def test_every_figure_is_shown_and_well_formed():
    names = {name for doc in F.DOCS for name in F.marked(doc.read_text())}
    assert names <= set(F.RENDER), f"no renderer for {sorted(names - set(F.RENDER))}"
    files = {p.stem for p in F.FIGURES.glob("*.json")}
    assert {n.split(".")[0] for n in names} == files
    for path in F.FIGURES.glob("*.json"):
        figure = json.loads(path.read_text())
        assert {"date", "machine", "command", "result"} <= set(figure), path.name
        assert figure["command"].startswith("netagg bench ") and "--json" in figure["command"]


@pytest.mark.parametrize("name", sorted(F.RENDER))
def test_a_changed_figure_changes_the_table(name, monkeypatch):
    """The table is made from the file: a run with other figures renders another table."""
    before = F.render(name)
    figure = F.load(name)
    text = json.dumps(figure).replace("2026-", "2027-")
    changed = json.loads(text)
    changed["machine"] = "another machine"
    monkeypatch.setattr(F, "load", lambda _: changed)
    assert F.render(name) != before and "another machine" in F.render(name)
