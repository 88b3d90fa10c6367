"""The figure writer every area uses: :func:`save` (a PNG and the plotted numbers beside it as
``NAME.json``), and the plain shapes (:func:`heatmap`, :func:`curves`, :func:`bars`).

Each shape takes data and a path, writes the PNG plus its numbers and returns the path. Nothing is
computed here beyond what is plotted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from sinklab.meta import write_json_atomic

DPI = 110


def run_names(meta: Mapping[str, Any]) -> list[str]:
    """The model's and the text's names in a result's ``meta`` (exactly
    :data:`sinklab.meta.META_KEYS`, from :func:`sinklab.meta.attach_meta`), for a figure's title.
    One that is None (a synthetic run has no model or text) is left out; several texts are
    joined with '+'."""
    names = []
    for key in ("model", "text"):
        value = meta[key]
        items = value if isinstance(value, list) else [] if value is None else [value]
        if items:
            names.append("+".join(str(item["name"]) for item in items))
    return names


def save(fig: Any, path: Path, numbers: Any, *, dpi: int = DPI, tight: bool = True) -> Path:
    """Write ``fig`` to ``path`` (PNG) and ``numbers`` beside it (``NAME.json``); close ``fig``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if tight:
            fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    write_json_atomic(path.with_suffix(".json"), numbers)
    return path


def heatmap(
    matrix: Sequence[Sequence[float]],
    path: Path,
    *,
    title: str,
    xlabel: str = "head",
    ylabel: str = "layer",
    cbar: str = "",
    vmin: float | None = 0.0,
    vmax: float | None = 1.0,
    numbers: Mapping[str, Any] | None = None,
) -> Path:
    """A layer x head (rows x columns) heatmap, layer 0 at the top; ``numbers`` (default
    ``{"matrix": matrix}``) are saved beside it."""
    rows, cols = len(matrix), len(matrix[0]) if matrix else 0
    fig, ax = plt.subplots(figsize=(min(9.0, 2.5 + 0.45 * cols), min(8.0, 1.8 + 0.22 * rows)))
    im = ax.imshow(matrix, aspect="auto", cmap="magma", vmin=vmin, vmax=vmax)
    ax.set_title(title, fontsize=9)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    fig.colorbar(im, ax=ax, label=cbar)
    return save(fig, path, dict(numbers) if numbers is not None else {"matrix": matrix})


def curves(
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    path: Path,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logy: bool = False,
    hline: float | None = None,
    vline: float | None = None,
) -> Path:
    """One line per series over a shared x axis (series may be shorter than x)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for name, ys in series.items():
        xs = list(x)[: len(ys)]
        ax.plot(xs, ys, marker="o" if len(xs) <= 40 else None, ms=3, label=name)
    if hline is not None:
        ax.axhline(hline, color="0.6", lw=0.8, ls="--")
    if vline is not None:
        ax.axvline(vline, color="0.6", lw=0.8, ls="--")
    if logy:
        ax.set_yscale("log")
    if all(float(v).is_integer() for v in x):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return save(fig, path, {"x": list(x), "series": {k: list(v) for k, v in series.items()}})


def bars(
    labels: Sequence[str],
    values: Sequence[float],
    path: Path,
    *,
    title: str,
    ylabel: str,
    logy: bool = False,
) -> Path:
    """One bar per condition, the value printed above it."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar(range(len(values)), values, color="#2952a3")
    ax.set_xticks(range(len(values)), labels, rotation=20, ha="right", fontsize=8)
    for i, v in enumerate(values):
        ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    return save(fig, path, {"labels": list(labels), "values": list(values)})
