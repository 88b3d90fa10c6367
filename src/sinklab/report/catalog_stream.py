"""The streaming stage: perplexity per cache policy (``sinklab.stream.evaluate``), figure, table."""

from __future__ import annotations

import time
from typing import Any

from sinklab.report.cells import Cell, FigureSpec, TableSpec
from sinklab.report.config import ReportConfig
from sinklab.report.stages import Stage, StageContext, StageOutput, reproduce_dir
from sinklab.stream.summary import (
    block_size,
    collapse_sentence,
    method_line,
    plot_block_ppl,
    plot_running_ppl,
)


def _stream_run(ctx: StageContext) -> Any:
    """The stage's run: every policy, the report's sizes, the method chosen per model."""
    from sinklab.stream.evaluate import StreamConfig
    from sinklab.stream.run import StreamRun

    c = ctx.config
    tokens = ctx.cap_tokens(c.stream_tokens, size="stream_tokens")
    limit = ctx.loaded.info.max_positions
    c.check_stream(["stream"], limit, text_holds=tokens, text_name=ctx.text.name)  # the text's
    return StreamRun(
        StreamConfig(
            n_sink=c.n_sink,
            window=c.window,
            n_tokens=tokens,
            recompute_every=c.recompute_every,
            segment=block_size(tokens),
            method="auto",
        )
    )


def _params(ctx: StageContext) -> dict[str, Any]:
    c = _stream_run(ctx).config
    return {
        "tokens": c.n_tokens,
        "policies": list(c.policies),
        "n_sink": c.n_sink,
        "window": c.window,
        "recompute_every": c.recompute_every,
        "method": c.method,
        "segment": c.segment,
    }


def _command(ctx: StageContext) -> list[str]:
    return _stream_run(ctx).argv(ctx.model_args, ctx.text_spec, reproduce_dir(ctx, "stream"))


def _run(ctx: StageContext) -> StageOutput:
    from sinklab.meta import attach_meta

    run = _stream_run(ctx)
    start = time.perf_counter()
    ids = ctx.ids(run.tokens)
    result = run.run(
        ctx.loaded.model,
        ids,
        ctx.progress,
    )
    seconds = time.perf_counter() - start
    attach_meta(result, ctx.loaded.info, ctx.text, run.params(), seconds, ctx.first_record(ids))
    data = result.to_json()
    figs = [_figure(ctx, data), _block_figure(ctx, data)]
    return StageOutput(data, figs, [_table(data)], _notes(data))


def _block_figure(ctx: StageContext, data: dict[str, Any]) -> FigureSpec:
    block = data["meta"]["params"]["segment"]
    max_pos = (data["meta"].get("model") or {}).get("max_positions")
    said = collapse_sentence(data)
    line = f" The dashed line marks the model's {max_pos} trained positions." if max_pos else ""
    return FigureSpec(
        plot_block_ppl(data, ctx.figures_dir),
        f"Perplexity of each block of {block} tokens: where a policy breaks, not the "
        f"running average that hides it.{line}{' ' + said if said else ''}",
    )


def _figure(ctx: StageContext, data: dict[str, Any]) -> FigureSpec:
    path = plot_running_ppl(data, ctx.figures_dir)
    p = _params(ctx)
    return FigureSpec(
        path,
        "Running perplexity as the text streams in, one line per policy (log scale). The dashed "
        "line marks where eviction starts (n_sink + window); recompute is scored on every "
        f"{p['recompute_every']}th target only.",
    )


def _table(data: dict[str, Any]) -> TableSpec:
    pols = list(data["policies"])
    sub = "on_recompute_targets" in data
    cols = ["policy", "perplexity", "tokens scored"]
    cols += ["ppl on recompute targets"] if sub else []
    cols += ["tokens/s", "max cache length", "peak RSS (MB)"]
    rows = []
    for name in pols:
        row = [
            Cell(name),
            Cell(None, ("policies", name, "ppl")),
            Cell(None, ("policies", name, "n_scored")),
        ]
        if sub:
            row.append(Cell(None, ("on_recompute_targets", "ppl", name)))
        row += [
            Cell(None, ("policies", name, "tokens_per_s")),
            Cell(None, ("policies", name, "max_cache_len")),
            Cell(None, ("policies", name, "peak_rss_mb")),
        ]
        rows.append(tuple(row))
    return TableSpec("Per policy (max cache length: blank = no cache)", tuple(cols), tuple(rows))


def _notes(data: dict[str, Any]) -> list[str]:
    sub = data.get("on_recompute_targets")
    notes = [method_line(data) + "."]
    if sub:
        notes.append(
            f"recompute re-runs a forward for every {sub['recompute_every']}th target only "
            f"({sub['n_scored']} targets); compare it with the other policies on those same "
            "targets (column 'ppl on recompute targets')."
        )
    return notes


def _cost(c: ReportConfig) -> float:
    """Seconds on SmolLM2, 2 idle cores, chunked: ~4 ms per token and cached policy (dense
    more: its attention grows with the stream), ~2 ms per window token of each oracle target."""
    tokens = c.stream_tokens
    dense = tokens * 0.004 * (1 + tokens / 20000)
    oracle = tokens / c.recompute_every * (c.n_sink + c.window) * 0.002
    return tokens * 0.004 * 3 + dense + oracle


def stream_stage() -> Stage:
    return Stage(
        "stream",
        "Streaming: perplexity with a bounded cache",
        "StreamingLLM's protocol: the text is fed one token at a time and each next token is "
        "scored (computed in chunks where sinklab.stream.band serves the model, else token by "
        "token: "
        "the same result). dense keeps every key; sink "
        "keeps the first n_sink tokens plus the window most "
        "recent; window keeps the n_sink + window most recent (same memory, no sinks: the "
        "collapse StreamingLLM warns about); sink-auto keeps the sinks the probe finds on the "
        "prefix instead of the first tokens; recompute re-runs a fresh forward over what sink "
        "keeps (the quality oracle).",
        _cost,
        _params,
        _command,
        _run,
    )
