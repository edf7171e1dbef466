"""The register map's declaration (`netagg.contract.regmap`): its field layouts pack and unpack, and
the table in docs/switch.md is the one generated from it."""

from __future__ import annotations

import pathlib

import pytest

from netagg.contract import regmap as R

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "switch.md"


def test_the_documented_register_table_is_the_generated_one():
    text = DOC.read_text()
    start = text.index("tests/test_regmap.py checks it -->\n") + len(
        "tests/test_regmap.py checks it -->\n")
    end = text.index("<!-- end of the generated table -->")
    assert text[start:end] == R.markdown_table(), \
        "docs/switch.md's register table is stale: paste `python -m netagg.contract.regmap` into it"


@pytest.mark.parametrize("fields", [R.PARAMS, R.CONFIG, R.WORKER_ENDPOINT])
def test_fields_pack_and_unpack(fields):
    widths = {name: width for name, _, width in fields.fields}
    values = {name: (1 << width) - 1 - (i % 2) for i, (name, width) in enumerate(
        widths.items())}
    word = fields.pack(**values)
    assert fields.unpack(word) == values
    assert word < 1 << 32
    assert sum(widths.values()) == bin(fields.pack(**{n: (1 << w) - 1 for n, w in
                                                      widths.items()})).count("1")
    name = next(iter(widths))
    with pytest.raises(ValueError):
        fields.pack(**{name: 1 << widths[name]})
    with pytest.raises(KeyError):
        fields.pack(no_such_field=1)
