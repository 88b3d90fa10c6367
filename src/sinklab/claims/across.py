"""Claims across models: one table, claim x model (effect [95 % interval], verdict), and a figure
that puts the models side by side.

``sinklab claims --model a,b,c`` runs each model's claims on its own (one model in memory at a
time) and joins their results here. The rule and the claims are the single-model ones
(docs/claims.md); a claim may hold on one family and not another, and the table shows exactly
that: one column per model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sinklab.claims.plots import COLOURS, plot_points
from sinklab.claims.table import claimed
from sinklab.errors import SinklabError


def model_names(value: str | None) -> list[str] | None:
    """``--model a,b,c`` as a list of several names; None for one model (or the default).
    A repeated or empty name is a one-line error."""
    if value is None or "," not in value:
        return None
    names = [v.strip() for v in value.split(",")]
    if any(not n for n in names):
        raise SinklabError(
            f"--model {value!r} has an empty name; pass e.g. smollm2-135m,gemma3-270m"
        )
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SinklabError(f"--model names {', '.join(repeated)} more than once; name each once")
    return names


def _cell(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "effect": row["effect"],
        "interval": row["interval"],
        "verdict": row["verdict"],
        "verdict_stated": row.get("verdict_stated") or row["verdict"],  # a proxy's names it
        "n_valid": row["n_valid"],
        "n_samples": row["n_samples"],
        "reason": row["reason"],
    }


def across_table(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per claim, in the first run's order, from ``[(model name, one claims result's
    JSON)]``: ``id``, ``statement``, ``site``, ``claimed``, ``direction``, ``threshold``,
    ``models`` ({name: cell}) and ``agree`` (every model got the same verdict)."""
    if not runs:
        raise SinklabError("no model results to put in one table")
    rows: list[dict[str, Any]] = []
    for first in runs[0][1]["claims"]:
        cells = {}
        for name, data in runs:
            match = next((r for r in data["claims"] if r["id"] == first["id"]), None)
            cells[name] = None if match is None else _cell(match)
        verdicts = {c["verdict"] for c in cells.values() if c is not None}
        rows.append(
            {
                "id": first["id"],
                "statement": first["statement"],
                "site": first["site"],
                "claimed": claimed(first),
                "direction": first["direction"],
                "threshold": first["threshold"],
                "models": cells,
                "agree": len(verdicts) == 1,
            }
        )
    return rows


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def cell_text(cell: dict[str, Any] | None) -> str:
    """``0.41 [0.33, 0.47] supported`` (effect, interval, verdict), or ``-`` when not run."""
    if cell is None:
        return "-"
    iv = cell["interval"]
    span = "" if iv is None else f" [{_num(iv[0])}, {_num(iv[1])}]"
    return f"{_num(cell['effect'])}{span} {cell.get('verdict_stated') or cell['verdict']}"


def text_rows(table: list[dict[str, Any]], models: Sequence[str]) -> list[tuple[str, ...]]:
    """One row per claim: id, claimed, then one cell per model."""
    return [(r["id"], r["claimed"], *(cell_text(r["models"][m]) for m in models)) for r in table]


def differences(table: list[dict[str, Any]], models: Sequence[str]) -> list[str]:
    """One sentence per claim whose verdict differs between models."""
    out = []
    for r in table:
        if r["agree"]:
            continue
        parts = [
            f"{m}: {r['models'][m].get('verdict_stated') or r['models'][m]['verdict']}"
            for m in models
            if r["models"][m]
        ]
        out.append(f"{r['id']} differs between models ({'; '.join(parts)})")
    return out


def plot_across(
    table: list[dict[str, Any]], models: Sequence[str], path: Path, *, title: str = ""
) -> Path:
    """Each claim a band of rows, one per model: effect - threshold signed so that right of 0 is
    the claimed direction, with its 95 % interval; colour = verdict, marker = model. The plotted
    numbers go beside the PNG."""
    from sinklab.figures import save, subplots

    markers = "osD^vP*X"
    n, k = len(table), len(models)
    fig, ax = subplots(figsize=(9, 0.32 * n * k + 2.0))
    plotted = []
    for i, row in enumerate(table):
        base = (n - 1 - i) * (k + 1)
        for j, name in enumerate(models):
            cell = row["models"][name]
            y = base + (k - 1 - j)
            if cell is None:
                continue
            point = plot_points(
                [
                    {
                        **cell,
                        "direction": row["direction"],
                        "threshold": row["threshold"],
                        "id": row["id"],
                    }
                ]
            )[0]
            plotted.append({**point, "model": name})
            colour = COLOURS[cell["verdict"]]
            if point["x"] is None:
                ax.text(0, y, f"{name}: not measured", ha="center", va="center", fontsize=7)
                continue
            lo, hi = point["interval"] or (point["x"], point["x"])
            ax.plot([lo, hi], [y, y], color=colour, lw=2.2, solid_capstyle="butt")
            ax.plot([point["x"]], [y], markers[j % len(markers)], color=colour, ms=5)
        if i:
            ax.axhline(base + k - 0.0, color="0.85", lw=0.6)
    ax.axvline(0.0, color="black", lw=0.8)
    ticks = [(n - 1 - i) * (k + 1) + (k - 1) / 2 for i in range(n)]
    ax.set_yticks(ticks, [r["id"] for r in table])
    for j, name in enumerate(models):
        ax.plot([], [], markers[j % len(markers)], color="0.3", label=name)
    for verdict, colour in COLOURS.items():
        ax.plot([], [], "-", color=colour, lw=2.2, label=verdict)
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    ax.set_xlabel("effect - threshold, signed: > 0 is the claimed direction (mean, 95 % CI)")
    ax.set_title(title or f"Claims across models: {', '.join(models)}", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return save(fig, Path(path), {"title": title, "models": list(models), "points": plotted})
