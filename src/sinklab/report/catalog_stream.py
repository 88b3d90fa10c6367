"""The streaming stage: perplexity per cache policy (``sinklab.streaming``), figure, table."""

from __future__ import annotations

from typing import Any

from sinklab.report import figures
from sinklab.report.stages import (
    Cell,
    FigureSpec,
    ReportConfig,
    Stage,
    StageContext,
    StageOutput,
    TableSpec,
    reproduce_dir,
)

POLICIES = ("dense", "window", "sink", "recompute")


def _params(ctx: StageContext) -> dict[str, Any]:
    c = ctx.config
    return {
        "tokens": ctx.cap_tokens(c.stream_tokens),
        "policies": list(POLICIES),
        "n_sink": c.n_sink,
        "window": c.window,
        "recompute_every": c.recompute_every,
    }


def _command(ctx: StageContext) -> list[str]:
    p = _params(ctx)
    return [
        "sinklab",
        "stream",
        "--model",
        ctx.model_spec,
        "--text",
        ctx.text_spec,
        "--tokens",
        str(p["tokens"]),
        "--policy",
        "all",
        "--n-sink",
        str(p["n_sink"]),
        "--window",
        str(p["window"]),
        "--recompute-every",
        str(p["recompute_every"]),
        "--out",
        reproduce_dir(ctx, "stream"),
    ]


def _run(ctx: StageContext) -> StageOutput:
    from sinklab.streaming import StreamConfig, stream_perplexity

    p = _params(ctx)
    ids = ctx.ids(p["tokens"])
    result = stream_perplexity(
        ctx.loaded.model,
        ids,
        StreamConfig(
            policies=tuple(POLICIES),
            n_sink=p["n_sink"],
            window=p["window"],
            recompute_every=p["recompute_every"],
        ),
    )
    data = result.to_json()
    return StageOutput(data, [], [])


def _cost(c: ReportConfig) -> float:
    per_token = 0.07 * 3 + 1.0 / c.recompute_every
    return c.stream_tokens * per_token


def stream_stage() -> Stage:
    return Stage(
        "stream",
        "Streaming: perplexity with a bounded cache",
        "StreamingLLM's protocol: the text is fed one token at a time and each next token is "
        "scored. dense keeps every key; window keeps only the most recent; sink keeps the first "
        "n_sink tokens plus the window; recompute re-runs the window from scratch (the oracle).",
        _cost,
        _params,
        _command,
        _run,
    )


__all__ = ["Cell", "FigureSpec", "TableSpec", "figures", "stream_stage"]
