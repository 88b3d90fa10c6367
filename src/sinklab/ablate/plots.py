"""One figure per experiment (matplotlib Agg): data in, PNG out, the plotted numbers beside it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from sinklab.meta import write_json_atomic


def _title(data: dict[str, Any]) -> str:
    meta = data.get("meta", {})
    model = meta.get("model", {}).get("name", "model")
    text = meta.get("text", {}).get("name", "text")
    p = meta.get("params", {})
    return (
        f"{data.get('experiment')}: {model}, {text}, T={p.get('tokens')}, "
        f"q0={p.get('q0')}, eps={p.get('eps')}, seed={p.get('seed')}"
    )


def _save(fig: Figure, plotted: dict[str, Any], data: dict[str, Any], path: Path) -> Figure:
    fig.suptitle(_title(data), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    write_json_atomic(path.with_suffix(".json"), {"title": _title(data), **plotted})
    plt.close(fig)
    return fig


def _bar_ppl(ax: Any, names: list[str], ppl: list[float]) -> None:
    ax.bar(names, ppl, color="tab:blue")
    ax.set_yscale("log")
    ax.set_ylabel("perplexity (same targets)")
    ax.tick_params(axis="x", rotation=30, labelsize=7)


def _ppl_and_layer_curves(
    data: dict[str, Any], path: Path, metric: str, xlabel: str, ylabel: str, key: str
) -> Figure:
    """Perplexity bars per condition beside a per-layer curve of ``metric`` per condition."""
    cond = data["conditions"]
    names = list(cond)
    ppl = [cond[n]["perplexity"] for n in names]
    curves = {n: cond[n][metric] for n in names}
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    _bar_ppl(a, names, ppl)
    a.set_xlabel(xlabel)
    for n, values in curves.items():
        b.plot(range(len(values)), values, marker=".", label=n)
    b.set_xlabel("layer")
    b.set_ylabel(ylabel)
    b.legend(fontsize=7)
    return _save(fig, {key: names, "perplexity": ppl, metric: curves}, data, path)


def plot_first_token(data: dict[str, Any], path: Path) -> Figure:
    return _ppl_and_layer_curves(
        data, path, "sink_mass_by_layer", "first token", "sink mass (mean over heads)", "modes"
    )


def plot_mask_sink(data: dict[str, Any], path: Path) -> Figure:
    return _ppl_and_layer_curves(
        data,
        path,
        "token_similarity",
        "sink masked in",
        "token similarity (mean pairwise cosine)",
        "conditions",
    )


def plot_density(data: dict[str, Any], path: Path) -> Figure:
    cond = {k: v for k, v in data["conditions"].items() if v["lam"] is not None}
    lams = [v["lam"] for v in cond.values()]
    groups = [k for k in next(iter(cond.values())) if k.startswith("similarity (")]
    curves = {g: [v[g] for v in cond.values()] for g in groups}
    ppl = [v["perplexity"] for v in cond.values()]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for g, ys in curves.items():
        a.plot(lams, ys, marker="o", label=g.removeprefix("similarity (").rstrip(")"))
    a.set_xlabel("lam (0 = diagonal, 1 = uniform causal)")
    a.set_ylabel("token similarity")
    a.legend(fontsize=7)
    b.plot(lams, ppl, marker="o")
    b.set_yscale("log")
    b.set_xlabel("lam")
    b.set_ylabel("perplexity")
    return _save(fig, {"lam": lams, "similarity": curves, "perplexity": ppl}, data, path)


def plot_sensitivity(data: dict[str, Any], path: Path) -> Figure:
    import numpy as np

    pos = data["positions"]
    mats = {k: np.asarray(v, dtype=float) for k, v in data["matrices"].items()}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    vmax = max(float(np.log10(m[m > 0]).max()) for m in mats.values())
    vmin = min(float(np.log10(m[m > 0]).min()) for m in mats.values())
    for ax, (name, m) in zip(axes[:2], mats.items(), strict=True):
        with np.errstate(divide="ignore"):
            im = ax.imshow(np.log10(m), vmin=vmin, vmax=vmax, cmap="viridis")
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("input position i")
        ax.set_ylabel("query position t")
        ticks = range(0, len(pos), max(1, len(pos) // 8))
        ax.set_xticks(list(ticks), [pos[i] for i in ticks], fontsize=6)
        ax.set_yticks(list(ticks), [pos[i] for i in ticks], fontsize=6)
    fig.colorbar(im, ax=axes[:2], label="log10 ||d h_L[t] / d x_i||_F")
    curves = {}
    for name, c in data["conditions"].items():
        d = {int(k): v for k, v in c["by_distance"].items()}
        curves[name] = d
        axes[2].plot(list(d), list(d.values()), marker=".", label=name)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("distance t - i (tokens)")
    axes[2].set_ylabel("mean Jacobian norm")
    axes[2].legend(fontsize=7)
    fig.suptitle(_title(data), fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plotted = {"positions": pos, "matrices": data["matrices"], "by_distance": curves}
    write_json_atomic(path.with_suffix(".json"), {"title": _title(data), **plotted})
    plt.close(fig)
    return fig


def plot_geometry(data: dict[str, Any], path: Path) -> Figure:
    cond = data["conditions"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    cos = {n: c["first_token_cosine"] for n, c in cond.items()}
    for n, ys in cos.items():
        a.plot(range(len(ys)), ys, alpha=0.5, label=n)
    mean_cos = data["mean_first_token_cosine"]
    a.plot(range(len(mean_cos)), mean_cos, color="k", lw=2, label="mean")
    a.axhline(0.0, color="grey", lw=0.8, ls="--")
    a.set_xlabel("layer")
    a.set_ylabel("first-token cosine")
    a.legend(fontsize=7)
    first = next(iter(cond.values()))["head_kind_census"]
    kinds = list(first)
    n = len(cond)
    census = {
        k: [
            sum(c["head_kind_census"][k][li] for c in cond.values()) / n
            for li in range(len(first[k]))
        ]
        for k in kinds
    }
    bottom = [0.0] * len(first[kinds[0]])
    for k in kinds:
        b.bar(range(len(bottom)), census[k], bottom=bottom, label=k)
        bottom = [x + y for x, y in zip(bottom, census[k], strict=True)]
    b.set_xlabel("layer")
    b.set_ylabel("heads (mean over texts)")
    b.legend(fontsize=7)
    plotted = {"first_token_cosine": cos, "mean_first_token_cosine": mean_cos, "census": census}
    return _save(fig, plotted, data, path)


PLOTS: dict[str, Callable[[dict[str, Any], Path], Figure]] = {
    "first-token": plot_first_token,
    "mask-sink": plot_mask_sink,
    "density": plot_density,
    "sensitivity": plot_sensitivity,
    "geometry": plot_geometry,
}
