"""Tables and figures of a report page, over a stage's JSON.

Shape glossary for tables: a :class:`Cell` shows one value; ``path`` is where the value lives in
the stage's JSON (a tuple of keys / list indices) and ``agg`` how the shown value is derived from
the list found there (``None``: shown as is). The page writes both into ``data-`` attributes so a
test (or a reader) can check every printed number against ``results.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sinklab.probe.metrics import nan_mean

JsonPath = tuple[str | int, ...]
AGGREGATES = ("mean", "max", "argmax", "count:VALUE")


@dataclass(frozen=True)
class Cell:
    """One table cell: a label (``path`` None) or a value found at ``path`` in the stage JSON."""

    value: Any
    path: JsonPath | None = None
    agg: str | None = None  # one of AGGREGATES, applied to the list at ``path``


@dataclass(frozen=True)
class TableSpec:
    caption: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]


@dataclass(frozen=True)
class FigureSpec:
    path: Path  # a PNG written by the stage
    caption: str


def lookup(data: Any, path: JsonPath) -> Any:
    """The value at ``path`` in nested dicts/lists (KeyError/IndexError when absent)."""
    for key in path:
        data = data[key]
    return data


def aggregate(values: Any, agg: str | None) -> Any:
    """Apply a table cell's aggregate to the list it points at (None: the value itself)."""
    if agg is None:
        return values
    if agg.startswith("count:"):
        return sum(v == agg.removeprefix("count:") for v in _flatten(values))
    flat = [float(v) for v in _flatten(values)]
    if agg == "mean":
        return nan_mean(flat)
    finite = [v for v in flat if v == v]  # NaN-safe, like the mean
    if agg == "max":
        return max(finite) if finite else float("nan")
    if agg == "argmax":
        return max(range(len(flat)), key=flat.__getitem__)
    raise ValueError(f"unknown aggregate {agg!r}; one of {AGGREGATES}")


def _flatten(values: Any) -> list[Any]:
    if isinstance(values, list | tuple):
        return [x for v in values for x in _flatten(v)]
    return [values]
