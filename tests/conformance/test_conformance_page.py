"""The documentation's conformance table (docs/conformance.md) is exactly the one rendered
from expected.py."""

import os

import expected

PAGE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "conformance.md")


def test_the_conformance_page_has_the_rendered_table():
    with open(PAGE) as f:
        text = f.read()
    assert text.count(expected.TABLE_START) == 1 and text.count(expected.TABLE_END) == 1
    start = text.index(expected.TABLE_START)
    end = text.index(expected.TABLE_END) + len(expected.TABLE_END)
    assert text[start:end] == expected.render_table(), (
        "docs/conformance.md's table is stale: paste expected.render_table() between the "
        "markers")


def test_table_shows_every_cell_once():
    table = expected.render_table()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(expected.harness.FEATURE_NAMES)
    for row, feature in zip(rows, expected.harness.FEATURE_NAMES):
        cells = [c.strip() for c in row.strip("|").split(" | ")][2:]
        assert len(cells) == len(expected.COLUMNS), row
        for cell, column in zip(cells, expected.COLUMNS):
            kind, _ = expected.cell_status(feature, column)
            assert cell.startswith(kind if kind != "not run" else ""), (feature, column, cell)
    gaps = sum(row.count("known gap") for row in rows)
    assert gaps == len(expected.KNOWN_GAPS)
