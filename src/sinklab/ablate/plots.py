"""One figure per experiment: data in, a matplotlib Figure out (saved as PNG with the plotted
numbers beside it when a path is given)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from sinklab import figures


def _title(data: dict[str, Any]) -> str:
    p = data["meta"]["params"]
    run = [f"T={p['tokens']}", f"q0={p['q0']}", f"eps={p['eps']}", f"seed={p['seed']}"]
    return f"{data['experiment']}: " + ", ".join([*figures.run_names(data["meta"]), *run])


def _save(fig: Figure, plotted: dict[str, Any], data: dict[str, Any], path: Path | None) -> Figure:
    """Title ``fig``, attach its numbers and write it to ``path`` (None: only return it)."""
    fig.suptitle(_title(data), fontsize=8)
    figures.with_numbers(fig, {"title": _title(data), **plotted})
    if path is not None:
        figures.save(fig, path)
    return fig


def _bar_ppl(ax: Any, names: list[str], ppl: list[float]) -> None:
    ax.bar(names, ppl, color="tab:blue")
    ax.set_yscale("log")
    ax.set_ylabel("perplexity (same targets)")
    ax.tick_params(axis="x", rotation=30, labelsize=7)


def _ppl_and_layer_curves(
    data: dict[str, Any], path: Path | None, metric: str, xlabel: str, ylabel: str, key: str
) -> Figure:
    """Perplexity bars per condition beside a per-layer curve of ``metric`` per condition."""
    cond = data["conditions"]
    names = list(cond)
    ppl = [cond[n]["perplexity"] for n in names]
    curves = {n: cond[n][metric] for n in names}
    fig, (a, b) = figures.subplots(1, 2, figsize=(10, 4))
    _bar_ppl(a, names, ppl)
    a.set_xlabel(xlabel)
    for n, values in curves.items():
        b.plot(range(len(values)), values, marker=".", label=n)
    b.set_xlabel("layer")
    b.set_ylabel(ylabel)
    b.legend(fontsize=7)
    return _save(fig, {key: names, "perplexity": ppl, metric: curves}, data, path)


def plot_first_token(data: dict[str, Any], path: Path | None = None) -> Figure:
    return _ppl_and_layer_curves(
        data, path, "sink_mass_by_layer", "first token", "sink mass (mean over heads)", "modes"
    )


def plot_mask_sink(data: dict[str, Any], path: Path | None = None) -> Figure:
    return _ppl_and_layer_curves(
        data,
        path,
        "token_similarity",
        "sink masked in",
        "token similarity (mean pairwise cosine)",
        "conditions",
    )


SITE_LABELS = {"residual": "residual stream", "attention_input": "attention input", "key": "keys"}


def plot_density(data: dict[str, Any], path: Path | None = None) -> Figure:
    """Similarity after the modified layers vs the density parameter (both sites), perplexity,
    and the per-layer attention-input similarity of every condition."""
    param = data["parameter"]
    cond = {k: v for k, v in data["conditions"].items() if v.get(param) is not None}
    xs = [v[param] for v in cond.values()]
    after = {s: [v["after_group_similarity"][s] for v in cond.values()] for s in data["sites"]}
    ppl = [v["ppl"] for v in cond.values()]
    fig, (a, b, c) = figures.subplots(1, 3, figsize=(14, 4))
    for s, ys in after.items():
        a.plot(xs, ys, marker="o", label=SITE_LABELS[s])
    xlabel = {"lam": "lam (0 = the model, 1 = uniform causal)", "tau": "temperature tau"}[param]
    if data["protocol"] == "replace":
        xlabel = "lam (0 = identity, 1 = uniform causal)"
    a.set_xlabel(xlabel)
    a.set_ylabel("token similarity after the modified layers")
    a.legend(fontsize=7)
    b.plot(xs, ppl, marker="o")
    b.set_yscale("log")
    b.set_xlabel(param)
    b.set_ylabel("perplexity")
    per_layer = {k: v["token_similarity"]["attention_input"] for k, v in data["conditions"].items()}
    for k, ys in per_layer.items():
        c.plot(range(len(ys)), ys, marker=".", label=k)
    group = data["modified_layers"]
    c.axvspan(group[0] - 0.5, group[-1] + 0.5, color="grey", alpha=0.15, label="modified")
    c.set_xlabel("layer (last point: after the final norm)")
    c.set_ylabel("token similarity, attention input")
    c.legend(fontsize=6)
    plotted = {
        "protocol": data["protocol"],
        param: xs,
        "after_group_similarity": after,
        "perplexity": ppl,
        "token_similarity_attention_input": per_layer,
        "modified_layers": group,
    }
    return _save(fig, plotted, data, path)


def plot_sensitivity(data: dict[str, Any], path: Path | None = None) -> Figure:
    import numpy as np

    pos = data["positions"]
    mats = {k: np.asarray(v, dtype=float) for k, v in data["matrices"].items()}
    fig, axes = figures.subplots(1, 3, figsize=(14, 4))
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
    plotted = {"positions": pos, "matrices": data["matrices"], "by_distance": curves}
    figures.save(fig, path, {"title": _title(data), **plotted}, tight=False)  # colorbar over 2 axes
    return fig


def plot_geometry(data: dict[str, Any], path: Path | None = None) -> Figure:
    """First-token cosine and token similarity per layer at the three sites (mean over texts),
    the middle layers of the verdict shaded; head kinds per layer."""
    layers = data["layers"]
    fig, axes = figures.subplots(1, 3, figsize=(15, 4))
    plotted: dict[str, Any] = {"middle_layers": data["middle_layers"]}
    mid = data["middle_layers"]
    for ax, metric in zip(axes[:2], ("first_token_cosine", "token_similarity"), strict=True):
        curves = {}
        for site in data["sites"]:
            ys = [e[metric][site] for e in layers]
            if any(y is None for y in ys):
                continue
            curves[site] = ys
            ax.plot(range(len(ys)), ys, marker=".", label=SITE_LABELS[site])
        ax.axhline(0.0, color="grey", lw=0.8, ls="--")
        ax.axvspan(mid[0] - 0.5, mid[-1] + 0.5, color="grey", alpha=0.15, label="middle third")
        ax.set_xlabel("layer")
        ax.set_ylabel(metric.replace("_", " ") + " (mean over texts)")
        ax.legend(fontsize=7)
        plotted[metric] = curves
    cond = data["conditions"]
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
        axes[2].bar(range(len(bottom)), census[k], bottom=bottom, label=k)
        bottom = [x + y for x, y in zip(bottom, census[k], strict=True)]
    axes[2].set_xlabel("layer")
    axes[2].set_ylabel("heads (mean over texts)")
    axes[2].legend(fontsize=7)
    plotted["census"] = census
    return _save(fig, plotted, data, path)
