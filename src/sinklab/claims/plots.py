"""The claims figure: one row per claim, its effect and 95 % interval relative to its threshold,
signed so that right of 0 is the claimed direction; the plotted numbers are saved beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLOURS = {"supported": "#2a7f3f", "not supported": "#b03a2e", "inconclusive": "#7f7f7f"}


def plot_points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row: ``x = s * (effect - threshold)`` and the interval likewise, ``s = +1`` for claims
    "above", ``-1`` for "below" (None where not measured)."""
    points = []
    for r in rows:
        s = 1.0 if r["direction"] == "above" else -1.0
        iv = r.get("interval")
        x = None if r.get("effect") is None else s * (r["effect"] - r["threshold"])
        lo_hi = None if iv is None else sorted(s * (v - r["threshold"]) for v in iv)
        points.append({"id": r["id"], "verdict": r["verdict"], "x": x, "interval": lo_hi})
    return points


def claims_figure(rows: list[dict[str, Any]], *, title: str = "") -> Any:
    """The claims figure (a matplotlib Figure carrying its plotted numbers)."""
    from sinklab.figures import subplots, with_numbers

    points = plot_points(rows)
    n = len(points)
    fig, ax = subplots(figsize=(8.5, 0.45 * n + 1.6))
    for i, p in enumerate(points):
        y = n - 1 - i
        colour = COLOURS[p["verdict"]]
        if p["x"] is None:
            ax.text(0, y, "not measured", ha="center", va="center", fontsize=8, color=colour)
            continue
        lo, hi = p["interval"] or (p["x"], p["x"])
        ax.plot([lo, hi], [y, y], color=colour, lw=2.5, solid_capstyle="butt")
        ax.plot([p["x"]], [y], "o", color=colour, ms=5)
    ax.axvline(0.0, color="black", lw=0.8)
    ax.set_yticks(range(n), [f"{p['id']} ({p['verdict']})" for p in reversed(points)])
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_xlabel("effect - threshold, signed: > 0 is the claimed direction (mean, 95 % CI)")
    ax.set_title(title or "Claims: effect and bootstrap 95 % interval", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return with_numbers(fig, {"title": title, "points": points})


def plot_claims(rows: list[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """Draw the claims figure to ``path`` (PNG), its numbers to ``path.with_suffix(".json")``."""
    from sinklab.figures import save

    return save(claims_figure(rows, title=title), Path(path))
