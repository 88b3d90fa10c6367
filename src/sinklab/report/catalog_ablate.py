"""The ablation stages: one per ``sinklab.ablate`` experiment, its JSON, figure and finding."""

from __future__ import annotations

from typing import Any

from sinklab.report.stages import ReportConfig, Stage, StageContext, StageOutput

EXPERIMENTS: dict[str, tuple[str, str]] = {
    "first-token": (
        "Ablation: the first token",
        "Perplexity and sink strength with the first token kept, dropped or replaced.",
    ),
    "mask-sink": (
        "Ablation: masking the sink",
        "Attention to the sink zeroed and renormalised in all, the first, middle or last third "
        "of the layers: perplexity and token similarity.",
    ),
    "density": (
        "Ablation: attention density",
        "Weights replaced by (1 - lam) identity + lam uniform-causal: does denser attention raise "
        "token similarity (oversmoothing)?",
    ),
    "sensitivity": (
        "Ablation: sensitivity (Jacobian norms)",
        "||d h_L[t] / d x_i|| over a grid of (t, i), with and without the sink masked.",
    ),
    "geometry": (
        "Ablation: geometry and head kinds",
        "First-token cosine per layer on several texts, and the census of head kinds per layer.",
    ),
}


def _params(name: str):
    def params(ctx: StageContext) -> dict[str, Any]:
        c = ctx.config
        p: dict[str, Any] = {"tokens": ctx.cap_tokens(c.ablate_tokens), "seed": c.seed}
        if name == "sensitivity":
            p["grid"] = c.sensitivity_grid
        return p

    return params


def _command(name: str):
    def command(ctx: StageContext) -> list[str]:
        p = _params(name)(ctx)
        out = ctx.shared.get("out")
        cmd = [
            "sinklab",
            "ablate",
            "--experiment",
            name,
            "--model",
            ctx.model_spec,
            "--text",
            ctx.text_spec,
            "--tokens",
            str(p["tokens"]),
        ]
        if "grid" in p:
            cmd += ["--grid", str(p["grid"])]
        return [*cmd, "--out", str(out / "reproduce" / name) if out else name]

    return command


def _run(name: str):
    def run(ctx: StageContext) -> StageOutput:
        from sinklab.ablate import run_experiment

        p = _params(name)(ctx)
        ids = ctx.ids(p["tokens"])
        result = run_experiment(name, ctx.loaded.model, ctx.loaded.tokenizer, ids, None)
        return StageOutput(result.to_json())

    return run


def _cost(name: str):
    def cost(c: ReportConfig) -> float:
        base = {"sensitivity": 6.0 * c.sensitivity_grid, "density": 20.0, "geometry": 15.0}
        return base.get(name, 10.0) * (c.ablate_tokens / 256)

    return cost


def ablation_stages() -> list[Stage]:
    return [
        Stage(name, title, about, _cost(name), _params(name), _command(name), _run(name))
        for name, (title, about) in EXPERIMENTS.items()
    ]
