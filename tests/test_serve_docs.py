"""docs/serve.md's conformance table against the code: every request field the server reads is a
row it calls *supported*, every field it refuses a row it calls *refused*, and no sinklab cell
says a parameter is ignored (docs/serve.md#conformance-table)."""

from __future__ import annotations

import re
from pathlib import Path

from sinklab.serve.protocol import MESSAGE_REFUSED, REFUSED, ChatRequest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "serve.md"


def _rows() -> list[tuple[str, str]]:
    """(feature cell, sinklab cell) of each row of the conformance table."""
    text = PAGE.read_text(encoding="utf-8")
    table = text.split('<a id="conformance-table"></a>', 1)[1].split("\n\n", 2)[1]
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
        assert cell.startswith(("supported", "refused: 400", "refused: 404")), (feature, cell)
        assert "ignored" not in cell, (feature, cell)


def test_the_table_names_every_field_as_the_code_treats_it():
    rows = _rows()
    supported = set().union(*(_named(f) for f, c in rows if c.startswith("supported")))
    refused = set().union(*(_named(f) for f, c in rows if c.startswith("refused")))
    read = set(ChatRequest.model_fields) - {"model", "messages"}
    assert read <= supported, read - supported
    assert set(REFUSED) | set(MESSAGE_REFUSED) <= refused, (
        set(REFUSED) | set(MESSAGE_REFUSED)
    ) - refused


def test_the_route_rows_are_the_routes_the_app_serves():
    """Each route row (`POST /v1/...`, `GET /v1/...`) says *supported* exactly when the app binds
    that route to a handler of its own, and *refused: 404* when it binds the 404 that names the
    chat route (so the table cannot keep calling a route refused after it is built)."""
    from sinklab.serve.app import build_app
    from sinklab.serve.config import ServeConfig
    from sinklab.serve.metrics import Metrics

    app = build_app(None, ServeConfig(), Metrics(), lambda line: None)  # routes only: no engine
    bound = {
        (method, route.path.replace("{mid:path}", "{id}")): route.endpoint.__name__
        for route in app.routes
        for method in getattr(route, "methods", ()) or ()
    }
    checked = 0
    for feature, cell in _rows():
        if not feature.startswith(("`GET /", "`POST /")):
            continue  # a feature row that mentions a route in passing
        for method, path in re.findall(r"`(GET|POST|DELETE) (/v1/[a-z_/{}]+)`", feature):
            assert (method, path) in bound, (feature, sorted(bound))
            refused = bound[(method, path)] == "elsewhere"
            assert cell.startswith("refused: 404" if refused else "supported"), (feature, cell)
            checked += 1
    assert checked >= 5
