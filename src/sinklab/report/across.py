"""``sinklab report --model a,b,c``: one full report per model, one model in memory at a time, and
an index page that puts them side by side.

``DIR/<model>/index.html`` is each model's own report (the same page ``sinklab report --model
<model>`` writes); ``DIR/index.html`` lists them with their summaries and, when the claims stage
ran, the claim x model table of :mod:`sinklab.claims.across`; ``DIR/results.json`` holds that
table and where each model's results are. The whole folder is written as one output: built beside
``DIR`` and moved into place at the end, like a single report.
"""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sinklab.claims.across import across_table, cell_text, differences
from sinklab.meta import attach_meta, write_json_atomic
from sinklab.outputs import check_out, output_dir
from sinklab.report.build import COMMAND, Report
from sinklab.report.html import CSS

#: loads one model by name: (loaded model, notes on sizes clamped to it, the config to use)
Loader = Callable[[str], tuple[Any, list[str], Any]]


def folder_name(model: str) -> str:
    """A model's sub-folder: its name (a path's last part) with only [A-Za-z0-9._-] kept."""
    base = Path(model.rstrip("/")).name or "model"
    return re.sub(r"[^A-Za-z0-9._-]", "_", base)


def build_across(
    models: Sequence[str],
    load: Loader,
    *,
    out: Path,
    build: Callable[[Path, Any, list[str], Any, str], Report],
) -> tuple[Path, list[tuple[str, Report]]]:
    """Build each model's report into ``out/<folder>/`` (``build(folder, loaded, notes, config,
    name)``), then the index; returns the index path and each model's report."""
    folders = [folder_name(m) for m in models]
    if len(set(folders)) != len(folders):
        from sinklab.errors import SinklabError

        raise SinklabError(f"--model names {', '.join(models)} share a folder name; name each once")
    out = check_out(out, COMMAND)
    start = time.perf_counter()
    reports: list[tuple[str, Report]] = []
    with output_dir(out, COMMAND) as tmp:
        for name, folder in zip(models, folders, strict=True):
            loaded, notes, config = load(name)
            report = build(tmp / folder, loaded, notes, config, name)
            reports.append((name, report))
            del loaded
            gc.collect()  # the next model loads into the memory this one held
        data = _index_data(reports, folders)
        attach_meta(data, None, None, {"models": list(models)}, time.perf_counter() - start)
        write_json_atomic(tmp / "results.json", data)
        (tmp / "index.html").write_text(_index_page(data, reports, folders), encoding="utf-8")
    return out / "index.html", reports


def _claims_json(report: Report) -> dict[str, Any] | None:
    stage = report.data["stages"].get("claims")
    return stage["json"] if stage and stage["status"] == "ok" and stage["json"] else None


def _index_data(reports: list[tuple[str, Report]], folders: list[str]) -> dict[str, Any]:
    runs = [(name, _claims_json(r)) for name, r in reports]
    measured = [(n, d) for n, d in runs if d is not None]
    return {
        "meta": None,
        "models": [
            {"model": name, "folder": f, "summary": r.data["summary"], "seconds": r.seconds}
            for (name, r), f in zip(reports, folders, strict=True)
        ],
        "claims_table": across_table(measured) if measured else None,
        "claims_models": [n for n, _ in measured],
    }


def _e(text: Any) -> str:
    import html

    return html.escape(str(text))


def _index_page(data: dict[str, Any], reports: list[tuple[str, Report]], folders: list[str]) -> str:
    names = [name for name, _ in reports]
    cards = "".join(
        f'<section class="card"><h2><a href="{_e(m["folder"])}/index.html">{_e(m["model"])}</a>'
        f'</h2><p class="sub">{m["seconds"]:.0f} s</p><ul>'
        + "".join(f"<li>{_e(s)}</li>" for s in m["summary"])
        + "</ul></section>"
        for m in data["models"]
    )
    table = ""
    if data["claims_table"]:
        cols = data["claims_models"]
        head = "".join(f"<th>{_e(c)}</th>" for c in ("claim", "claimed", *cols))
        body = "".join(
            f"<tr><td>{_e(r['id'])}</td><td>{_e(r['claimed'])}</td>"
            + "".join(
                f'<td data-path="claims_table.{i}.models.{_e(c)}">{_e(cell_text(r["models"][c]))}'
                "</td>"
                for c in cols
            )
            + "</tr>"
            for i, r in enumerate(data["claims_table"])
        )
        diffs = "".join(f"<li>{_e(s)}</li>" for s in differences(data["claims_table"], cols))
        table = (
            '<section class="card" id="claims"><h2>Claims across models</h2>'
            "<p>Each cell: effect [95 % interval] verdict, by the rule of docs/claims.md.</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            + (f"<h3>Verdicts that differ</h3><ul>{diffs}</ul>" if diffs else "")
            + "</section>"
        )
    written = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>sinklab report: {_e(", ".join(names))}</title>
<style>{CSS}</style>
</head>
<body>
<main>
<h1>sinklab report: {len(names)} models</h1>
<p class="sub">One full report per model (one model in memory at a time); written {written}.</p>
{table}
{cards}
</main>
</body>
</html>
"""
