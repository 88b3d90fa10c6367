"""docs/serve-routes.md's conformance table against the code: every field ``/v1/completions``
and ``/v1/responses`` read is named in a *supported* row, every field they refuse in a *refused*
row, and no sinklab cell says a parameter is ignored (docs/serve-routes.md#conformance-routes)."""

from __future__ import annotations

import re
from pathlib import Path

from sinklab.serve import completions, responses

PAGE = Path(__file__).resolve().parents[1] / "docs" / "serve-routes.md"


def _rows() -> list[tuple[str, str]]:
    """(feature cell, sinklab cell) of each row of the table."""
    text = PAGE.read_text(encoding="utf-8")
    table = text.split('<a id="conformance-routes"></a>', 1)[1].split("\n\n", 2)[1]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 5, line
        rows.append((cells[0], cells[4]))
    return rows


def _named(cell: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+)", cell))


def test_every_sinklab_cell_is_supported_or_refused():
    rows = _rows()
    assert len(rows) > 20
    for feature, cell in rows:
        assert cell.startswith(("supported", "refused: 400")), (feature, cell)
        assert "ignored" not in cell, (feature, cell)


def test_the_table_names_every_field_as_the_code_treats_it():
    rows = _rows()
    supported = set().union(*(_named(f) for f, c in rows if c.startswith("supported")))
    refused = set().union(*(_named(f) for f, c in rows if c.startswith("refused")))
    read = set(completions.CompletionRequest.model_fields) | set(completions.SHARED)
    read |= set(responses._Req.model_fields) | set(responses.SHARED)
    read -= {"model"}
    assert read <= supported, read - supported
    refusable = set(completions.REFUSED) | set(responses.REFUSED)
    refusable -= {"parallel_tool_calls"}  # any boolean asks for nothing without tools
    assert refusable <= refused, refusable - refused
