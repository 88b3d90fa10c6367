"""Probe figures, the only ones: ``sinklab probe`` and the report's probe sections both call
:func:`probe_figures` (so a section's "reproduce" command draws the same files). Each figure is a
PNG with its plotted numbers as JSON beside it (same stem)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sinklab import figures
from sinklab.probe.metrics import layer_means

HEATMAP, CURVES, TREND, BY_LAYER = "sink_mass_heatmap", "layer_curves", "length_trend", "by_layer"
CAPTIONS = {
    HEATMAP: "Sink mass m(l, h): mean attention on key 0 over queries t >= q0 (attention weights "
    "of every layer and head).",
    CURVES: "Per layer: mean sink mass over heads, first-token cosine and token similarity "
    "(oversmoothing), both measured on the layer's output (residual stream); the claim that the "
    "first-token cosine is <= 0 in middle layers is tested at the attention input "
    "(docs/science.md#geometry).",
    TREND: "Sink rate and mean sink mass as the context grows.",
    BY_LAYER: "Mean sink mass per layer, one line per context length.",
}


def sink_heatmap_figure(sink_mass: list[list[float]], title: str) -> Any:
    """Layer x head heatmap of sink mass (fraction of attention on key 0, 0..1)."""
    return figures.heatmap_figure(
        sink_mass,
        title=title,
        cbar="sink mass (fraction of attention on key 0)",
        numbers={"title": title, "sink_mass": sink_mass, "axes": ["layer", "head"]},
    )


def layer_curves_figure(curves: dict[str, list[float]], title: str) -> Any:
    """Per-layer curves: mean sink mass over heads, first-token cosine, token similarity."""
    fig, ax = figures.subplots(figsize=(7, 4))
    for name, ys in curves.items():
        ax.plot(range(len(ys)), ys, marker="o", markersize=3, label=name)
    ax.axhline(0.0, color="grey", linewidth=0.6)
    ax.set_xlabel("layer")
    ax.set_ylabel("value (mass: fraction of attention; cosine: -1..1)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return figures.with_numbers(fig, {"title": title, "x": "layer", **curves})


def length_trend_figure(trend: list[dict[str, Any]], title: str) -> Any:
    """Sink rate and mean sink mass against context length (tokens, log scale)."""
    lengths = [e["tokens"] for e in trend]
    fig, ax = figures.subplots(figsize=(7, 4))
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
    return figures.with_numbers(fig, {"title": title, "by_length": trend})


def probe_figure_set(data: dict[str, Any], lengths_only: bool = False) -> dict[str, Any]:
    """Every figure of a probe result's JSON (``probe.json``'s content), by file stem: the heatmap
    and the per-layer curves, and with ``by_length`` the length trend and the per-layer mass by
    length. ``lengths_only``: just the length figures (the report's length section)."""
    p = data["meta"]["params"]
    tokens = p.get("tokens") or max(p.get("lengths") or [0])
    tag = " | ".join([*figures.run_names(data["meta"]), f"{tokens} tokens", f"q0={p['q0']}"])
    out: dict[str, Any] = {}
    if not lengths_only:
        out[HEATMAP] = sink_heatmap_figure(data["sink_mass"], f"sink mass\n{tag}")
        curves = {
            "sink mass (mean over heads)": layer_means(data["sink_mass"]),
            "first-token cosine": data["first_token_cosine"],
            "token similarity": data["token_similarity"],
        }
        for site in (data.get("geometry") or {}).get("sites", []):  # sinklab.probe.geometry's sites
            ys = [e["first_token_cosine"][site] for e in data["geometry"]["layers"]]
            if None not in ys:
                curves[f"first-token cosine, {site.replace('_', ' ')} (entering the layer)"] = ys
        out[CURVES] = layer_curves_figure(curves, f"per layer\n{tag}")
    if "by_length" in data:
        rows = data["by_length"]
        eps = ",".join(f"{e:g}" for e in p["eps"])
        out[TREND] = length_trend_figure(rows, f"sinks vs length (eps={eps})\n{tag}")
        out[BY_LAYER] = figures.curves_figure(
            list(range(len(rows[0]["sink_mass_by_layer"]))),
            {f"T={r['tokens']}": r["sink_mass_by_layer"] for r in rows},
            title=f"mean sink mass per layer, by context length\n{tag}",
            xlabel="layer",
            ylabel="mean sink mass over heads",
        )
    return out


def probe_figures(data: dict[str, Any], folder: Path, lengths_only: bool = False) -> list[Path]:
    """:func:`probe_figure_set` written into ``folder`` (``NAME.png`` + ``NAME.json`` each)."""
    sets = probe_figure_set(data, lengths_only)
    return [figures.save(fig, Path(folder) / f"{name}.png") for name, fig in sets.items()]


def protocol_figures(data: dict[str, Any], folder: Path) -> list[Path]:
    """A protocol run's figure: the sink rate per layer (% of samples x heads with alpha_0 > eps)
    and the mean alpha_0 per layer."""
    by_layer = data["by_layer_pct"]
    alpha = [sum(row) / len(row) for row in data["alpha0"]]
    title = (
        f"{data['protocol']} protocol: {data['sink_rate_pct']:.1f} % sink (eps {data['eps']:g}, "
        f"{data['samples']} x {data['tokens']} tokens)"
    )
    fig, ax = figures.subplots(figsize=(7, 4))
    ax.bar(range(len(by_layer)), by_layer, color="#4c72b0", label="sink rate, %")
    ax.plot(range(len(alpha)), [100 * a for a in alpha], "o-", color="#dd8452", ms=3,
            label="mean alpha_0 over heads and samples, %")  # fmt: skip
    ax.axhline(100 * data["eps"], color="grey", lw=0.8, ls="--", label=f"eps {data['eps']:g}")
    ax.set_xlabel("layer")
    ax.set_ylabel("%")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    path = folder / "protocol_by_layer.png"
    numbers = {"title": title, "x": "layer", "sink_rate_pct": by_layer, "mean_alpha0": alpha}
    return [figures.save(fig, path, numbers)]
