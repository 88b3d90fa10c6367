"""Render the report as one self-contained HTML page.

Figures are embedded as base64 PNG ``data:`` URIs and the CSS is inline; the page has no scripts
and no external references, so it opens from disk, offline, anywhere. Every number in a table
carries ``data-path`` (where it lives in ``results.json``) and, when derived from a list,
``data-agg``, so the printed numbers can be checked against the JSON.
"""

from __future__ import annotations

import base64
import html
import json
import math
import shlex
from pathlib import Path
from typing import Any

from sinklab.report.cells import Cell, TableSpec, aggregate, lookup
from sinklab.report.stages import StageResult

CSS = """
:root { --ink:#1d232b; --muted:#5b6673; --line:#dde2e8; --ok:#1f7a4d; --bad:#b42318;
        --accent:#2952a3; --bg:#fafbfc; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
       font: 15px/1.55 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1120px; margin: 0 auto; padding: 28px 28px 12px; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 20px; margin: 0 0 6px; display:flex; align-items:center; gap:10px; }
h3 { font-size: 15px; margin: 18px 0 6px; color: var(--muted); text-transform: uppercase;
     letter-spacing: .04em; }
.sub { color: var(--muted); margin: 0 0 18px; }
.card { background:#fff; border:1px solid var(--line); border-radius:10px; padding:18px 22px;
        margin: 0 0 22px; }
.summary { border-left: 5px solid var(--accent); }
.summary ul { margin: 6px 0 0; padding-left: 20px; }
.summary li { margin: 4px 0; }
.badge { font-size: 12px; font-weight: 600; padding: 2px 8px; border-radius: 999px;
         color:#fff; white-space: nowrap; }
.badge.ok { background: var(--ok); } .badge.failed { background: var(--bad); }
.secs { font-size: 13px; color: var(--muted); font-weight: normal; }
nav ol { columns: 2; margin: 4px 0 0; padding-left: 22px; }
nav a { color: var(--accent); text-decoration: none; }
.about { color: #343c46; margin: 4px 0 10px; }
.note { color: var(--muted); font-size: 13.5px; margin: 2px 0; }
.error { background:#fef3f2; border:1px solid #fecdca; color: var(--bad); border-radius:8px;
         padding: 10px 14px; font-family: ui-monospace, Menlo, Consolas, monospace;
         font-size: 13px; overflow-wrap: anywhere; }
.figs { display:flex; flex-wrap: wrap; gap: 14px; align-items: flex-start; }
figure { margin:0; flex: 1 1 420px; max-width: 660px; }
figure.wide { flex-basis: 100%; max-width: 100%; }
figure img { width:100%; height:auto; border:1px solid var(--line); border-radius:6px;
             background:#fff; }
.summary b { color: var(--accent); }
figcaption { font-size: 13px; color: var(--muted); margin-top: 4px; }
.tables { display:flex; flex-wrap: wrap; gap: 8px 28px; align-items: flex-start; margin-top: 12px; }
.tbl { max-width: 100%; }
.tcap { color: var(--muted); font-size: 13px; margin: 0 0 4px; max-width: 560px; }
.tablewrap { overflow-x: auto; max-height: 420px; overflow-y: auto; margin-bottom: 8px;
             border: 1px solid var(--line); border-radius: 6px; background: #fff; }
table { border-collapse: collapse; font-size: 13.5px; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 10px; text-align: left; }
th { background:#f3f5f8; position: sticky; top: 0; }
td.num { font-variant-numeric: tabular-nums; font-family: ui-monospace, Menlo, monospace;
         text-align: right; }
.verdicts { padding: 14px 18px; }
.verdicts h2 { margin-bottom: 8px; }
.verdicts table { width: 100%; font-size: 13.5px; }
.verdicts th { position: static; }
.verdicts td { padding: 3px 10px; white-space: nowrap; }
.verdicts td.reason { max-width: 0; width: 100%; overflow: hidden; text-overflow: ellipsis;
                      color: var(--muted); }
.verdict { font-size: 12px; font-weight: 600; padding: 1px 8px; border-radius: 999px;
           color: #fff; white-space: nowrap; }
.verdict.supported { background: var(--ok); } .verdict.not-supported { background: var(--bad); }
.verdict.inconclusive { background: #8a6d00; }
pre { background:#f3f5f8; border:1px solid var(--line); border-radius:6px; padding: 8px 12px;
      white-space: pre-wrap; overflow-wrap: anywhere; font-size: 13px; margin: 4px 0 0; }
details summary { cursor: pointer; color: var(--muted); font-size: 14px; margin-top: 10px; }
footer { max-width:1120px; margin: 0 auto 30px; padding: 0 28px; color: var(--muted);
         font-size: 13px; }
footer code { font-size: 12px; }
"""


def fmt(value: Any) -> str:
    """How a value is printed on the page (the test formats results.json the same way)."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3f}"
    return str(value)


def data_uri(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def _wide(png: Path) -> str:
    """' class="wide"' for a PNG wider than 900 px (multi-panel figures get the full width)."""
    head = png.read_bytes()[:24]
    width = int.from_bytes(head[16:20], "big") if head[12:16] == b"IHDR" else 0
    return ' class="wide"' if width > 900 else ""


def _sentence(text: str) -> str:
    """A summary sentence, its 'Label:' lead (if short) in bold."""
    lead, sep, rest = text.partition(": ")
    if sep and len(lead) <= 28:
        return f"<b>{_e(lead)}:</b> {_e(rest)}"
    return _e(text)


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _path_attr(stage: str, path: tuple) -> str:
    return "/".join(["stages", stage, "json", *(str(p) for p in path)])


def _cell(stage: str, data: dict[str, Any], cell: Cell) -> str:
    if cell.path is None:
        return f"<td>{_e(cell.value)}</td>"
    value = aggregate(lookup(data, cell.path), cell.agg)
    agg = f' data-agg="{cell.agg}"' if cell.agg else ""
    where = _e(_path_attr(stage, cell.path))
    return f'<td class="num" data-path="{where}"{agg}>{_e(fmt(value))}</td>'


def _table(stage: str, data: dict[str, Any], table: TableSpec) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in table.columns)
    body = "".join(
        "<tr>" + "".join(_cell(stage, data, c) for c in row) + "</tr>" for row in table.rows
    )
    return (
        f'<div class="tbl"><p class="tcap">{_e(table.caption)}</p><div class="tablewrap"><table>'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div></div>"
    )


def _params(params: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><td>{_e(k)}</td><td>{_e(v if isinstance(v, str) else json.dumps(v))}</td></tr>"
        for k, v in params.items()
    )
    return f"<table><tbody>{rows}</tbody></table>"


def _section(result: StageResult) -> str:
    badge = f'<span class="badge {result.status}">{_e(result.status)}</span>'
    parts = [
        f'<section class="card stage" id="stage-{_e(result.name)}" data-stage="{_e(result.name)}">',
        f'<h2>{_e(result.title)} {badge} <span class="secs">{result.seconds:.1f} s</span></h2>',
        f'<p class="about">{_e(result.about)}</p>',
    ]
    if result.status != "ok":
        parts.append(f'<div class="error">{_e(result.error)}</div>')
        if result.traceback:
            parts.append(
                f"<details><summary>Traceback</summary><pre>{_e(result.traceback)}</pre></details>"
            )
    out = result.output
    if out is not None:
        parts += [f'<p class="note">{_e(n)}</p>' for n in out.notes]
        if out.figures:
            figs = "".join(
                f'<figure{_wide(f.path)}><img src="{data_uri(f.path)}" alt="{_e(f.caption)}">'
                f"<figcaption>{_e(f.caption)}</figcaption></figure>"
                for f in out.figures
            )
            parts.append(f'<div class="figs">{figs}</div>')
        if out.tables:
            tables = "".join(_table(result.name, out.json, t) for t in out.tables)
            parts.append(f'<div class="tables">{tables}</div>')
    if result.params:
        parts.append(f"<details><summary>Parameters</summary>{_params(result.params)}</details>")
    if result.command:
        parts.append(
            '<h3>Reproduce this section</h3><pre class="command">'
            f"{_e(shlex.join(result.command))}</pre>"
        )
    parts.append("</section>")
    return "\n".join(parts)


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def verdict_rows(claims: list[dict[str, Any]]) -> list[tuple[str, str, str, str, str, str]]:
    """The first screen's table, one row per claim: (claim, verdict, the verdict as stated (a
    proxy's names the proxy: "not supported on backcopy"), effect and 95 % interval, the
    claimed side of its threshold, the reason's first sentence)."""
    from sinklab.claims.table import claimed

    rows = []
    for r in claims:
        iv = r["interval"]
        effect = _num(r["effect"]) + ("" if iv is None else f" [{_num(iv[0])}, {_num(iv[1])}]")
        reason = str(r.get("reason") or "").split(". ")[0].rstrip(".")
        stated = r.get("verdict_stated") or r["verdict"]
        rows.append((r["id"], r["verdict"], stated, effect, claimed(r), reason))
    return rows


def _verdicts(results: list[StageResult]) -> str:
    """The claims' verdicts, first on the page: a compact table whose every row shows without
    scrolling inside it (the claims section below has the details); '' without claims."""
    claims = next((r for r in results if r.name == "claims" and r.output is not None), None)
    if claims is None or not claims.output.json.get("claims"):
        return ""
    body = "".join(
        f'<tr data-claim="{_e(cid)}"><td>{_e(cid)}</td>'
        f'<td><span class="verdict {_e(verdict.replace(" ", "-"))}">{_e(stated)}</span></td>'
        f'<td class="num">{_e(effect)}</td><td>{_e(side)}</td>'
        f'<td class="reason" title="{_e(reason)}">{_e(reason)}</td></tr>'
        for cid, verdict, stated, effect, side, reason in verdict_rows(claims.output.json["claims"])
    )
    head = "".join(
        f"<th>{c}</th>" for c in ("claim", "verdict", "effect [95 % interval]", "claimed", "why")
    )
    return (
        '<section class="card verdicts" id="verdicts"><h2>Verdicts</h2>'
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        '<p class="note">The rule: docs/claims.md. Each claim\'s protocol, paper and samples: '
        '<a href="#stage-claims">the claims section</a>.</p></section>'
    )


def render_page(
    *,
    title: str,
    subtitle: str,
    summary: list[str],
    results: list[StageResult],
    footer: dict[str, str],
) -> str:
    """The whole page as a string (UTF-8, no external references)."""
    nav = "".join(
        f'<li><a href="#stage-{_e(r.name)}">{_e(r.title)}</a> '
        f'<span class="badge {r.status}">{_e(r.status)}</span></li>'
        for r in results
    )
    items = (
        "".join(f"<li>{_sentence(s)}</li>" for s in summary)
        or "<li>No stage produced numbers.</li>"
    )
    foot = " · ".join(f"{_e(k)}: <code>{_e(v)}</code>" for k, v in footer.items())
    sections = "\n".join(_section(r) for r in results)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title>
<style>{CSS}</style>
</head>
<body>
<main>
<h1>{_e(title)}</h1>
<p class="sub">{_e(subtitle)}</p>
{_verdicts(results)}
<section class="card summary" id="summary"><h2>Summary</h2><ul>{items}</ul></section>
<nav class="card" id="contents"><h2>Sections</h2><ol>{nav}</ol></nav>
{sections}
</main>
<footer id="footer">{foot}</footer>
</body>
</html>
"""
