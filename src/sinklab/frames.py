"""Results as tables for a notebook: pandas DataFrames built from what a result declares.

pandas is imported only when a frame is asked for. Each result's ``to_frame()`` calls one of
these: the probe by its metric declarations (:data:`sinklab.probe.spec.METRICS`: one row per
layer and head, one column per metric measured per head or per layer), a stream by policy, the
claims by claim.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def _pandas() -> Any:
    import pandas

    return pandas


def layer_head_frame(
    per_head: Mapping[str, Sequence[Sequence[float]]],
    per_layer: Mapping[str, Sequence[float]],
) -> Any:
    """One row per (layer, head): columns ``layer``, ``head``, then each per-head metric (its
    [layer][head] value) and each per-layer metric (its [layer] value, the same on every head of
    the layer)."""
    first = next(iter(per_head.values()))
    rows = []
    for layer, heads in enumerate(first):
        for head in range(len(heads)):
            row: dict[str, Any] = {"layer": layer, "head": head}
            row.update({k: v[layer][head] for k, v in per_head.items()})
            row.update({k: v[layer] for k, v in per_layer.items()})
            rows.append(row)
    return _pandas().DataFrame(rows, columns=["layer", "head", *per_head, *per_layer])


def records_frame(rows: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> Any:
    """A frame of ``rows`` (dicts) with exactly ``columns``, in order."""
    return _pandas().DataFrame([{c: r.get(c) for c in columns} for r in rows], columns=columns)
