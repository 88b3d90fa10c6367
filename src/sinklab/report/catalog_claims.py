"""The report's first section: the claims table of ``sinklab claims`` (docs/claims.md), one row
per claim with its effect, 95 % interval and computed verdict, and the claims figure."""

from __future__ import annotations

from typing import Any

from sinklab.report.cells import Cell, FigureSpec, TableSpec
from sinklab.report.config import ReportConfig
from sinklab.report.stages import Stage, StageContext, StageOutput, reproduce_dir

ABOUT = (
    "Each claim of the attention-sink papers sinklab implements, measured on this model over "
    "three texts (or text windows), with the mean effect, its bootstrap 95 % interval and the "
    "verdict of the one rule in docs/claims.md: supported when the whole interval lies on the "
    "claimed side of the threshold, not supported when none of it does, inconclusive otherwise "
    "(or with fewer than 3 samples, or when the claim was not measured). Lab claims train their "
    "runs here (3 seeds per configuration, kept in the user cache and reused by the next report) "
    "and are judged only when every compared run converged and grew what the claim is about; "
    "each says its fidelity to the paper (docs/claims.md#lab-validity)."
)


def _claims_run(ctx: StageContext) -> Any:
    """The stage's run: ``sinklab claims`` at the report's sizes. Its samples are the text
    experiments' own (the first plays of the default corpus, or windows of the user's text, all
    of ``probe_tokens`` tokens) and sensitivity's grid and probes are the sensitivity stage's, so
    a finding that quotes a claim's verdict and this table read the same numbers
    (docs/claims.md). The stream claim, which no experiment quotes, streams its own longer
    windows (``sinklab claims``' default length, at most the stream stage's, and what a user's
    text holds; docs/claims.md#stream-claim-sizes)."""
    from sinklab.ablate import AblationConfig
    from sinklab.claims.core import ClaimsConfig
    from sinklab.claims.run import ClaimsRun
    from sinklab.corpus import DEFAULT_TEXT, play_names
    from sinklab.report.catalog_ablate import ABLATE_FLOOR, GEOMETRY_TEXTS

    c = ctx.config
    default = ctx.text_spec in (DEFAULT_TEXT, "", None)
    windows = 1 if default else GEOMETRY_TEXTS
    tokens = ctx.cap_tokens(c.ablate_tokens, windows, "ablate_tokens", ABLATE_FLOOR)  # ablate's
    plays = tuple(f"{DEFAULT_TEXT}:{n}" for n in play_names()[:GEOMETRY_TEXTS])
    asked = min(ClaimsConfig.stream_tokens, c.stream_tokens)
    return ClaimsRun(
        ClaimsConfig(
            texts=plays if default else tuple(ctx.text_spec.split(",")),
            windows=windows,
            probe_tokens=tokens,
            sensitivity_tokens=tokens,
            stream_tokens=ctx.cap_tokens(asked, windows, "the stream claim's length", floor=8),
            window=min(c.window, 28 if c.quick else 60),
            n_sink=c.n_sink,
            grid=min(c.sensitivity_grid, tokens),  # the sensitivity stage's
            probes=AblationConfig().probes,  # the sensitivity stage's
            q0=min(c.q0, tokens - 1),
            eps=c.eps,
            # sink-cheaper (issue 30 item 5): quick T 16-128 at 100 Adam steps per radius (29 CPU
            # s for 3 seeds, AMD EPYC), full T 16-256 (docs/claims.md#sink-cheaper-sizes)
            cost_seeds=3,
            cost_lengths=(16, 32, 64, 128) if c.quick else (16, 32, 64, 128, 256),
            cost_steps=100,
            lab_size="quick" if c.quick else "full",
            lab_steps=c.lab_steps,
            seed=c.seed,
            prepend=ctx.prepend,
        )
    )


def _params(ctx: StageContext) -> dict[str, Any]:
    """The section's sizes: the run's options, as its reproduce command writes them."""
    return {k: v for k, v in _claims_run(ctx).options().items() if k != "prepend"}


def _command(ctx: StageContext) -> list[str]:
    return _claims_run(ctx).argv(ctx.model_args, reproduce_dir(ctx, "claims"))


def _run(ctx: StageContext) -> StageOutput:
    from sinklab.claims.plots import plot_claims

    loaded = ctx.loaded
    result = _claims_run(ctx).run(loaded, ctx.progress)
    data = result.to_json()
    png = ctx.figures_dir / "claims_effects.png"
    plot_claims(data["claims"], png, title=f"Claims: {loaded.info.name}")
    caption = (
        "Each claim's mean effect and 95 % interval minus its threshold, signed so that right of "
        "0 is the claimed direction; colour = verdict."
    )
    return StageOutput(data, [FigureSpec(png, caption)], [claims_table(data)])


def claims_table(data: dict[str, Any]) -> TableSpec:
    """One row per claim; every number points at its place in the stage's JSON."""
    from sinklab.claims.table import claimed

    rows = []
    for i, r in enumerate(data["claims"]):
        iv = r["interval"]
        rows.append(
            (
                Cell(r["id"]),
                Cell(r["statement"]),
                Cell(r["paper"]),
                Cell(r["protocol"] + (f" ({r['fidelity']})" if r.get("fidelity") else "")),
                Cell(r["site"]),
                Cell(None, ("claims", i, "effect")) if r["effect"] is not None else Cell("–"),
                Cell(None, ("claims", i, "interval", 0)) if iv else Cell("–"),
                Cell(None, ("claims", i, "interval", 1)) if iv else Cell("–"),
                Cell(claimed(r)),
                Cell(None, ("claims", i, "n_valid")),
                Cell(None, ("claims", i, "verdict_stated" if "verdict_stated" in r else "verdict")),
                Cell(r["reason"]),
            )
        )
    return TableSpec(
        "Claims: effect (mean over samples), 95 % bootstrap interval, verdict by the rule of "
        "docs/claims.md",
        (
            "claim",
            "statement",
            "paper",
            "protocol",
            "site",
            "effect",
            "95% low",
            "95% high",
            "claimed",
            "n",
            "verdict",
            "reason",
        ),
        tuple(rows),
    )


def _cost(c: ReportConfig) -> float:
    return 120.0 if c.quick else 400.0  # the lab runs included (none when cached)


def claims_stage() -> Stage:
    return Stage(
        "claims",
        "Claims: the papers' claims tested on this model",
        ABOUT,
        _cost,
        _params,
        _command,
        _run,
    )
