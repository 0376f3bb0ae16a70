"""docs/reliability.md's fault matrix is current with tests/reliability_matrix.py: the same rows, every
test it names exists (or the row says `pending`), and no row shows a failure."""

from __future__ import annotations

from tests.reliability_matrix import DOC, ROWS, defined, outcomes_in_doc, render, section


def test_the_matrix_in_the_doc_is_current() -> None:
    text = DOC.read_text(encoding="utf-8")
    shown = outcomes_in_doc(text)
    table = section(text).strip().split("\n\n", 1)[1]  # after the line saying when it was generated
    assert table == render(shown), "run `python scripts/reliability_matrix.py` to regenerate the table"
    for row in ROWS:
        for node in row.tests:
            assert defined(node) == (shown[node] != "missing"), f"{node}: regenerate the table"
            assert shown[node] != "failed", f"{node} failed when the table was generated"
