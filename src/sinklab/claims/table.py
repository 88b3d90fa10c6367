"""The claims table in words for a terminal: ``sinklab claims`` prints it. The report's first
section (:mod:`sinklab.report.catalog_claims`) shows more columns (statement, paper, reason) with
each number linked to its place in the JSON, and takes its "claimed" cell from here."""

from __future__ import annotations

from typing import Any

COLUMNS = ("claim", "site", "effect", "95% interval", "claimed", "n", "verdict")


def claimed(row: dict[str, Any]) -> str:
    """The claimed side of the threshold, e.g. ``> 0.3``."""
    return f"{'>' if row['direction'] == 'above' else '<'} {row['threshold']:.3g}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def text_rows(data: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row of :data:`COLUMNS` per claim of a claims result's JSON."""
    rows = []
    for r in data["claims"]:
        iv = r["interval"]
        rows.append(
            (
                r["id"],
                r["site"],
                _num(r["effect"]),
                "-" if iv is None else f"[{_num(iv[0])}, {_num(iv[1])}]",
                claimed(r),
                f"{r['n_valid']}/{r['n_samples']}",
                r.get("verdict_stated", r["verdict"]),
            )
        )
    return rows


def reasons(data: dict[str, Any]) -> list[str]:
    """Why each inconclusive claim is inconclusive, one sentence each."""
    return [f"{r['id']}: {r['reason']}" for r in data["claims"] if r["verdict"] == "inconclusive"]
