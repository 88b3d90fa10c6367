"""Figures: the plain shapes every area draws with, and the one writer.

A figure function returns a matplotlib :class:`~matplotlib.figure.Figure` made outside pyplot
(:func:`subplots`): no backend is chosen and no global figure list grows, so a notebook shows
what it gets back and a script never opens a window. The plotted numbers ride on the figure
(:func:`with_numbers`); :func:`save` is the writer: the PNG and those numbers beside it as
``NAME.json``. The shapes come in both forms: :func:`heatmap_figure` (a Figure) and
:func:`heatmap` (written to a path), likewise curves and bars. Nothing is computed here beyond
what is plotted.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from sinklab.meta import write_bytes_atomic, write_json_atomic

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


def subplots(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float]) -> tuple[Figure, Any]:
    """A new :class:`Figure` and its axes (as ``plt.subplots`` returns them), outside pyplot."""
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols)


def with_numbers(fig: Figure, values: Any) -> Figure:
    """``fig`` carrying its plotted numbers (what :func:`save` writes beside the PNG)."""
    fig.sinklab_numbers = values  # type: ignore[attr-defined]
    return fig


def plotted(fig: Figure) -> Any:
    """The numbers :func:`with_numbers` attached to ``fig`` (None: none)."""
    return getattr(fig, "sinklab_numbers", None)


def save(
    fig: Figure, path: Path, numbers: Any = None, *, dpi: int = DPI, tight: bool = True
) -> Path:
    """Write ``fig`` to ``path`` (PNG, or the format its suffix names) and its plotted numbers
    beside it (``NAME.json``): ``numbers``, else those :func:`with_numbers` attached. Both are
    written atomically (the image is rendered in memory first): an interrupted run leaves the
    previous figure, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    image = io.BytesIO()  # the format is the suffix's (.png, .svg, .pdf), PNG without one
    fig.savefig(image, format=path.suffix[1:].lower() or "png", dpi=dpi)
    write_bytes_atomic(path, image.getvalue())
    write_json_atomic(path.with_suffix(".json"), plotted(fig) if numbers is None else numbers)
    return path


def heatmap_figure(
    matrix: Sequence[Sequence[float]],
    *,
    title: str,
    xlabel: str = "head",
    ylabel: str = "layer",
    cbar: str = "",
    vmin: float | None = 0.0,
    vmax: float | None = 1.0,
    numbers: Mapping[str, Any] | None = None,
) -> Figure:
    """A layer x head (rows x columns) heatmap, layer 0 at the top; its numbers: ``numbers``
    (default ``{"matrix": matrix}``)."""
    rows, cols = len(matrix), len(matrix[0]) if matrix else 0
    fig, ax = subplots(figsize=(min(9.0, 2.5 + 0.45 * cols), min(8.0, 1.8 + 0.22 * rows)))
    im = ax.imshow(matrix, aspect="auto", cmap="magma", vmin=vmin, vmax=vmax)
    ax.set_title(title, fontsize=9)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    fig.colorbar(im, ax=ax, label=cbar)
    return with_numbers(fig, dict(numbers) if numbers is not None else {"matrix": matrix})


def heatmap(matrix: Sequence[Sequence[float]], path: Path, **kwargs: Any) -> Path:
    """:func:`heatmap_figure`, written to ``path``."""
    return save(heatmap_figure(matrix, **kwargs), path)


def curves_figure(
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logy: bool = False,
    hline: float | None = None,
    vline: float | None = None,
) -> Figure:
    """One line per series over a shared x axis (series may be shorter than x)."""
    fig, ax = subplots(figsize=(6.4, 3.8))
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
    return with_numbers(fig, {"x": list(x), "series": {k: list(v) for k, v in series.items()}})


def curves(
    x: Sequence[float], series: Mapping[str, Sequence[float]], path: Path, **kwargs: Any
) -> Path:
    """:func:`curves_figure`, written to ``path``."""
    return save(curves_figure(x, series, **kwargs), path)


def bars_figure(
    labels: Sequence[str],
    values: Sequence[float],
    *,
    title: str,
    ylabel: str,
    logy: bool = False,
) -> Figure:
    """One bar per condition, the value printed above it."""
    fig, ax = subplots(figsize=(6.4, 3.6))
    ax.bar(range(len(values)), values, color="#2952a3")
    ax.set_xticks(range(len(values)), labels, rotation=20, ha="right", fontsize=8)
    for i, v in enumerate(values):
        ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    return with_numbers(fig, {"labels": list(labels), "values": list(values)})


def bars(labels: Sequence[str], values: Sequence[float], path: Path, **kwargs: Any) -> Path:
    """:func:`bars_figure`, written to ``path``."""
    return save(bars_figure(labels, values, **kwargs), path)
