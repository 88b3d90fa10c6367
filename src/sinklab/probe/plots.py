"""Probe figures (matplotlib Agg): each takes data and a path, saves the PNG and the plotted
numbers as JSON beside it (same stem), and returns the figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from sinklab.meta import write_json_atomic


def _save(fig: Figure, path: Path, data: dict[str, Any]) -> Figure:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    write_json_atomic(path.with_suffix(".json"), data)
    plt.close(fig)
    return fig


def plot_sink_heatmap(sink_mass: list[list[float]], path: Path, title: str) -> Figure:
    """Layer x head heatmap of sink mass (fraction of attention on key 0, 0..1)."""
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * len(sink_mass[0]), 1.0 + 0.22 * len(sink_mass)))
    im = ax.imshow(sink_mass, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, origin="upper")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="sink mass (fraction of attention on key 0)")
    return _save(fig, path, {"title": title, "sink_mass": sink_mass, "axes": ["layer", "head"]})


def plot_layer_curves(curves: dict[str, list[float]], path: Path, title: str) -> Figure:
    """Per-layer curves: mean sink mass over heads, first-token cosine, token similarity."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in curves.items():
        ax.plot(range(len(ys)), ys, marker="o", markersize=3, label=name)
    ax.axhline(0.0, color="grey", linewidth=0.6)
    ax.set_xlabel("layer")
    ax.set_ylabel("value (mass: fraction of attention; cosine: -1..1)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path, {"title": title, "x": "layer", **curves})


def plot_length_trend(trend: list[dict[str, Any]], path: Path, title: str) -> Figure:
    """Sink rate and mean sink mass against context length (tokens, log scale)."""
    lengths = [e["tokens"] for e in trend]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in trend[0]["sink_rate"]:
        ax.plot(
            lengths, [e["sink_rate"][key] for e in trend], marker="o", label=f"sink rate eps={key}"
        )
    ax.plot(lengths, [e["mean_sink_mass"] for e in trend], marker="s", label="mean sink mass")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("fraction (of heads, or of attention)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path, {"title": title, "by_length": trend})
