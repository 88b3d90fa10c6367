"""The report's stages, in page order: each calls one library function and keeps its JSON.

probe (one length) -> probe-lengths (the length trend) -> stream (streaming perplexity per policy)
-> first-token, mask-sink, density, sensitivity, geometry (``sinklab.ablate`` experiments).
Library modules are imported inside each stage, so a missing or broken library fails only its
own section. Costs are rough seconds on SmolLM2 with 2 cores, used only for the ETA.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sinklab.errors import SinklabError
from sinklab.meta import attach_meta
from sinklab.probe.metrics import top_heads
from sinklab.progress import Progress
from sinklab.report.cells import Cell, FigureSpec, TableSpec
from sinklab.report.config import ReportConfig
from sinklab.report.stages import Stage, StageContext, StageOutput, reproduce_dir

# --------------------------------------------------------------------------- probe


def _probe_params(ctx: StageContext) -> dict[str, Any]:
    c = ctx.config
    tokens = ctx.cap_tokens(c.probe_tokens, size="probe_tokens", floor=c.q0 + 2)  # a query past q0
    return {"tokens": tokens, "q0": c.q0}


def _probe_cli(ctx: StageContext, name: str, tokens: int, lengths: list[int] | None) -> list[str]:
    """``sinklab probe`` as stage ``name`` runs it (``--lengths``: the length trend)."""
    from sinklab.probe.run import ProbeRun

    run = ProbeRun(_probe_config(ctx), tokens, tuple(lengths) if lengths else None)
    return run.argv(ctx.model_args, ctx.text_spec, reproduce_dir(ctx, name))


def _probe_command(ctx: StageContext) -> list[str]:
    return _probe_cli(ctx, "probe", _probe_params(ctx)["tokens"], None)


def _probe_config(ctx: StageContext) -> Any:
    from sinklab.probe import ProbeConfig

    return ProbeConfig(q0=ctx.config.q0, eps=ctx.config.thresholds)


def _layer_progress(ctx: StageContext) -> Progress:
    """The stage's progress, noted by layer (``layer 3/30``)."""

    def progress(done: float, total: float, note: str = "") -> None:
        ctx.progress(done, total, f"layer {done:.0f}/{total:.0f}")

    return progress


def _run_probe(ctx: StageContext) -> StageOutput:
    from sinklab.probe.run import ProbeRun

    run = ProbeRun(_probe_config(ctx), _probe_params(ctx)["tokens"])  # as `sinklab probe` runs
    start = time.perf_counter()
    ids = ctx.ids(run.tokens)
    result, data = run.run(ctx.loaded.model, ids, _layer_progress(ctx))
    seconds = time.perf_counter() - start
    attach_meta(data, ctx.loaded.info, ctx.text, run.params(), seconds, ctx.first_record(ids))
    ctx.shared["probe"] = result
    return StageOutput(data, _probe_figures(ctx, data), _probe_tables(data))


def _probe_figures(ctx: StageContext, data: dict[str, Any], lengths_only: bool = False) -> list:
    """The probe's own figures (what ``sinklab probe`` draws), captioned for the page."""
    from sinklab.probe.plots import CAPTIONS, probe_figures

    paths = probe_figures(data, ctx.figures_dir, lengths_only=lengths_only)
    return [FigureSpec(p, CAPTIONS[p.stem]) for p in paths]


def _probe_tables(data: dict[str, Any]) -> list[TableSpec]:
    rates = TableSpec(
        "Sink rate: share of all (layer, head) pairs whose sink mass exceeds eps",
        ("eps", "sink rate"),
        tuple((Cell(k), Cell(None, ("sink_rate", k))) for k in sorted(data["sink_rate"])),
    )
    ranked = top_heads(data["sink_mass"], 10)
    top = TableSpec(
        "Top sink heads (largest sink mass)",
        ("layer", "head", "sink mass", "diagonal mass", "value-norm ratio", "sink output share"),
        tuple(
            (
                Cell(lay),
                Cell(h),
                Cell(None, ("sink_mass", lay, h)),
                Cell(None, ("diagonal_mass", lay, h)),
                Cell(None, ("value_norm_ratio", lay, h)),
                Cell(None, ("sink_output_share", lay, h)),
            )
            for lay, h, _ in ranked
        ),
    )
    positions = TableSpec(
        "Sink positions: keys receiving far more attention than uniform",
        ("rank", "key position", "mean received attention"),
        tuple(
            (
                Cell(i + 1),
                Cell(None, ("sink_positions", i, "position")),
                Cell(None, ("sink_positions", i, "mass")),
            )
            for i in range(len(data["sink_positions"]))
        ),
    )
    per_layer = TableSpec(
        "Per layer (head counts by kind: the largest of sink / diagonal / previous-token mass)",
        (
            "layer",
            "mean sink mass",
            "max sink mass",
            "sink heads",
            "diagonal heads",
            "prev-token heads",
            "mixed heads",
            "first-token cosine",
            "token similarity",
            "first-token norm / median",
        ),
        tuple(
            (
                Cell(layer),
                Cell(None, ("sink_mass", layer), "mean"),
                Cell(None, ("sink_mass", layer), "max"),
                Cell(None, ("head_kind", layer), "count:sink"),
                Cell(None, ("head_kind", layer), "count:diagonal"),
                Cell(None, ("head_kind", layer), "count:previous-token"),
                Cell(None, ("head_kind", layer), "count:mixed"),
                Cell(None, ("first_token_cosine", layer)),
                Cell(None, ("token_similarity", layer)),
                Cell(None, ("first_token_norm_ratio", layer)),
            )
            for layer in range(len(data["sink_mass"]))
        ),
    )
    return [rates, top, positions, per_layer]


def _probe_lengths_params(ctx: StageContext) -> dict[str, Any]:
    c = ctx.config
    lengths = sorted(
        {ctx.cap_tokens(n, size="probe_lengths", floor=c.q0 + 2) for n in c.probe_lengths}
    )
    return {"lengths": lengths, "q0": c.q0}


def _probe_lengths_command(ctx: StageContext) -> list[str]:
    lengths = _probe_lengths_params(ctx)["lengths"]
    return _probe_cli(ctx, "probe-lengths", max(lengths), lengths)


def _run_probe_lengths(ctx: StageContext) -> StageOutput:
    from sinklab.probe import probe_lengths
    from sinklab.probe.run import ProbeRun

    p = _probe_lengths_params(ctx)
    config = _probe_config(ctx)
    known = ctx.shared.get("probe")
    start = time.perf_counter()
    trend = probe_lengths(
        ctx.loaded.model,
        ctx.ids(max(p["lengths"])),
        p["lengths"],
        config,
        _layer_progress(ctx),
        known=known,
    )
    data = {"meta": None, "by_length": trend.to_json()}
    run = ProbeRun(config, max(p["lengths"]), tuple(p["lengths"]))  # what its command runs
    seconds, record = time.perf_counter() - start, ctx.first_record(ctx.ids(max(p["lengths"])))
    attach_meta(data, ctx.loaded.info, ctx.text, run.params(), seconds, record)
    rows = data["by_length"]
    keys = sorted(rows[0]["sink_rate"])
    table = TableSpec(
        "By length",
        ("tokens", *(f"sink rate (eps {k})" for k in keys), "mean sink mass"),
        tuple(
            (
                Cell(None, ("by_length", i, "tokens")),
                *(Cell(None, ("by_length", i, "sink_rate", k)) for k in keys),
                Cell(None, ("by_length", i, "mean_sink_mass")),
            )
            for i in range(len(rows))
        ),
    )
    return StageOutput(data, _probe_figures(ctx, data, lengths_only=True), [table])


# --------------------------------------------------------------------------- registry


def _cost_probe(c: ReportConfig) -> float:
    return 4.0 * (c.probe_tokens / 1024) ** 1.3 + 6


def _cost_lengths(c: ReportConfig) -> float:
    return sum(4.0 * (n / 1024) ** 1.3 + 2 for n in c.probe_lengths)


def all_stages() -> list[Stage]:
    """Every stage, in page order."""
    from sinklab.report.catalog_ablate import ablation_stages
    from sinklab.report.catalog_claims import claims_stage
    from sinklab.report.catalog_stream import stream_stage

    return [
        claims_stage(),
        Stage(
            "probe",
            "Probe: where attention goes",
            "Every layer's and head's sink mass (mean attention on key 0) and head kind, and per "
            "layer the first-token cosine and token similarity of the layer's output (residual "
            "stream; probe.json also holds them at the residual stream entering each layer, the "
            "attention input and the keys: docs/metrics.md#sites), from one forward pass with "
            "attention captured in chunks.",
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
