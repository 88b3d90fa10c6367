"""The report's stages, in page order: each calls one library function and keeps its JSON.

probe (one length) -> probe-lengths (the length trend) -> stream (streaming perplexity per policy)
-> first-token, mask-sink, density, sensitivity, geometry (``sinklab.ablate`` experiments).
Library modules are imported inside each stage, so a missing or broken library fails only its
own section. Costs are rough seconds on SmolLM2 with 2 cores, used only for the ETA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sinklab.errors import SinklabError
from sinklab.report import figures
from sinklab.report.stages import (
    Cell,
    FigureSpec,
    ReportConfig,
    Stage,
    StageContext,
    StageOutput,
    TableSpec,
)


def _base_command(ctx: StageContext, sub: str) -> list[str]:
    return ["sinklab", sub, "--model", ctx.model_spec, "--text", ctx.text_spec]


def _out(ctx: StageContext, name: str) -> str:
    return str(ctx.shared["out"] / "reproduce" / name) if "out" in ctx.shared else name


def _library_figures(ctx: StageContext, paths: Sequence[Any], captions: dict[str, str]) -> list:
    """FigureSpecs for PNGs a library wrote (caption from ``captions`` by file stem)."""
    specs = []
    for p in paths:
        p = ctx.figures_dir / p if not hasattr(p, "is_file") else p
        if p.suffix == ".png" and p.is_file():
            specs.append(FigureSpec(p, captions.get(p.stem, p.stem.replace("_", " "))))
    return specs


# --------------------------------------------------------------------------- probe


def _probe_params(ctx: StageContext) -> dict[str, Any]:
    c = ctx.config
    return {"tokens": ctx.cap_tokens(c.probe_tokens), "q0": c.q0, "eps": c.eps}


def _probe_command(ctx: StageContext) -> list[str]:
    p = _probe_params(ctx)
    return [
        *_base_command(ctx, "probe"),
        "--tokens",
        str(p["tokens"]),
        "--q0",
        str(p["q0"]),
        "--eps",
        str(p["eps"]),
        "--out",
        _out(ctx, "probe"),
    ]


def _run_probe(ctx: StageContext) -> StageOutput:
    from sinklab.probe import ProbeConfig, probe

    p = _probe_params(ctx)
    ids = ctx.ids(p["tokens"])
    n_layers = ctx.loaded.info.n_layers

    def on_layer(layer: int, *_: Any) -> None:
        ctx.progress((layer + 1) / n_layers, f"layer {layer + 1}/{n_layers}")

    result = probe(ctx.loaded.model, ids, ProbeConfig(q0=p["q0"], eps=p["eps"]), callback=on_layer)
    data = result.to_json()
    ctx.shared["probe"] = result
    return StageOutput(data, _probe_figures(ctx, data), _probe_tables(data))


def _probe_figures(ctx: StageContext, data: dict[str, Any]) -> list[FigureSpec]:
    d = ctx.figures_dir
    name, q0, t = ctx.loaded.info.name, ctx.config.q0, _probe_params(ctx)["tokens"]
    heat = figures.heatmap(
        data["sink_mass"],
        d / "sink_mass.png",
        title=f"Sink mass per head ({name}, T={t}, q0={q0})",
        cbar="sink mass (attention on key 0)",
    )
    layers = list(range(len(data["sink_mass"])))
    mean_mass = [sum(row) / len(row) for row in data["sink_mass"]]
    curves = figures.curves(
        layers,
        {
            "mean sink mass": mean_mass,
            "first-token cosine": data["first_token_cosine"],
            "token similarity": data["token_similarity"],
        },
        d / "per_layer.png",
        title=f"Per layer ({name}, T={t})",
        xlabel="layer",
        ylabel="value",
        hline=0.0,
    )
    return [
        FigureSpec(heat, f"Sink mass m(l, h): mean attention on key 0, queries t >= {q0}."),
        FigureSpec(curves, "Per-layer curves: mean sink mass, first-token cosine, similarity."),
    ]


def _probe_tables(data: dict[str, Any]) -> list[TableSpec]:
    rates = TableSpec(
        "Sink rate: share of (layer, head) pairs whose sink mass exceeds eps",
        ("eps", "sink rate"),
        tuple((Cell(k), Cell(None, ("sink_rate", k))) for k in sorted(data["sink_rate"])),
    )
    per_layer = TableSpec(
        "Per layer",
        (
            "layer",
            "mean sink mass",
            "max sink mass",
            "first-token cosine",
            "token similarity",
            "first-token norm / median",
        ),
        tuple(
            (
                Cell(layer),
                Cell(None, ("sink_mass", layer), "mean"),
                Cell(None, ("sink_mass", layer), "max"),
                Cell(None, ("first_token_cosine", layer)),
                Cell(None, ("token_similarity", layer)),
                Cell(None, ("first_token_norm_ratio", layer)),
            )
            for layer in range(len(data["sink_mass"]))
        ),
    )
    return [rates, per_layer]


def _probe_lengths_params(ctx: StageContext) -> dict[str, Any]:
    c = ctx.config
    lengths = sorted({ctx.cap_tokens(n) for n in c.probe_lengths})
    return {"lengths": lengths, "q0": c.q0, "eps": c.eps}


def _probe_lengths_command(ctx: StageContext) -> list[str]:
    p = _probe_lengths_params(ctx)
    return [
        *_base_command(ctx, "probe"),
        "--tokens",
        str(max(p["lengths"])),
        "--lengths",
        ",".join(map(str, p["lengths"])),
        "--q0",
        str(p["q0"]),
        "--eps",
        str(p["eps"]),
        "--out",
        _out(ctx, "probe-lengths"),
    ]


def _run_probe_lengths(ctx: StageContext) -> StageOutput:
    from sinklab.probe import ProbeConfig, probe_lengths

    p = _probe_lengths_params(ctx)
    ids = ctx.ids(max(p["lengths"]))
    config = ProbeConfig(q0=p["q0"], eps=p["eps"])
    result = probe_lengths(ctx.loaded.model, ids, p["lengths"], config)
    data = result if isinstance(result, dict) else result.to_json()
    return StageOutput(data)


# --------------------------------------------------------------------------- registry


def _cost_probe(c: ReportConfig) -> float:
    return 4.0 * (c.probe_tokens / 1024) ** 1.3 + 6


def _cost_lengths(c: ReportConfig) -> float:
    return sum(4.0 * (n / 1024) ** 1.3 + 2 for n in c.probe_lengths)


def all_stages() -> list[Stage]:
    """Every stage, in page order."""
    from sinklab.report.catalog_ablate import ablation_stages
    from sinklab.report.catalog_stream import stream_stage

    return [
        Stage(
            "probe",
            "Probe: where attention goes",
            "Every layer's and head's sink mass (mean attention on key 0), the head kinds and the "
            "residual-stream geometry, from one forward pass with attention captured in chunks.",
            _cost_probe,
            _probe_params,
            _probe_command,
            _run_probe,
        ),
        Stage(
            "probe-lengths",
            "Length trend: sinks against context length",
            "The probe repeated on growing prefixes of the same text: do sinks grow with context?",
            _cost_lengths,
            _probe_lengths_params,
            _probe_lengths_command,
            _run_probe_lengths,
        ),
        stream_stage(),
        *ablation_stages(),
    ]


def select_stages(names: Sequence[str] | None) -> list[Stage]:
    """The stages named (in page order), or all; an unknown name is a one-line error."""
    stages = all_stages()
    if names is None:
        return stages
    wanted = [n.strip() for n in names if n.strip()]
    known = [s.name for s in stages]
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise SinklabError(
            f"unknown report stage(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from: {', '.join(known)}"
        )
    return [s for s in stages if s.name in wanted]
