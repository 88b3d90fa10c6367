"""The ablation stages: one per ``sinklab.ablate`` experiment record (title, what it tests,
caption: :mod:`sinklab.ablate.registry`), its JSON, figure and finding."""

from __future__ import annotations

import time
from typing import Any

from sinklab import figures
from sinklab.meta import attach_meta
from sinklab.report.cells import Cell, FigureSpec, JsonPath, TableSpec
from sinklab.report.config import ReportConfig
from sinklab.report.stages import Stage, StageContext, StageOutput, reproduce_dir

MAX_ROWS = 40

# the text experiments (geometry, density, sensitivity) read this many texts (the first plays of
# the default corpus, else windows of the text), the claims stage the same ones (its samples)
GEOMETRY_TEXTS = 3
# the shortest input every ablation stage runs on (AblationConfig's default grid and checks)
ABLATE_FLOOR = 16


def _ablation_run(ctx: StageContext, name: str) -> Any:
    """The stage's run: the report's sizes, as ``sinklab ablate`` runs them."""
    from sinklab.ablate import AblationConfig
    from sinklab.ablate.run import AblationRun

    c = ctx.config
    rows = GEOMETRY_TEXTS if _record(name).texts else 1
    tokens = ctx.cap_tokens(c.ablate_tokens, rows, "ablate_tokens", ABLATE_FLOOR)
    kw: dict[str, Any] = {"eps": c.thresholds} if "eps" in _record(name).options else {}
    if name == "sensitivity":
        kw["grid"] = min(c.sensitivity_grid, tokens)
    config = AblationConfig(q0=min(c.q0, tokens - 1), seed=c.seed, **kw)
    return AblationRun(name, config, tokens, rows)


def _params(name: str):
    def params(ctx: StageContext) -> dict[str, Any]:
        run = _ablation_run(ctx, name)
        p: dict[str, Any] = {"tokens": run.tokens, "q0": run.config.q0, "seed": run.config.seed}
        if "eps" in _record(name).options:
            p["eps"] = run.config.eps
        if name == "sensitivity":
            p["grid"] = run.config.grid
        if _record(name).texts:
            p["texts"] = run.texts
        return p

    return params


def _command(name: str):
    def command(ctx: StageContext) -> list[str]:
        run = _ablation_run(ctx, name)
        return run.argv(ctx.model_args, ctx.text_spec, reproduce_dir(ctx, name))

    return command


def _run(name: str):
    def run(ctx: StageContext) -> StageOutput:
        ablation = _ablation_run(ctx, name)
        ids = ablation.ids(ctx.text_spec, ctx.text, ctx.loaded.tokenizer, ctx.first)
        start = time.perf_counter()
        result = ablation.run(
            ctx.loaded.model,
            ctx.loaded.tokenizer,
            ids,
            ctx.progress,
        )
        seconds = time.perf_counter() - start
        record = ctx.first_record(ids)
        attach_meta(result, ctx.loaded.info, ctx.text, result.params(), seconds, record)
        data = result.to_json()
        png = ctx.figures_dir / f"{name}.png"
        result.figure(png)
        _, tables = generic_view(data, ctx.figures_dir, name, curves=False)
        tables = [*site_tables(data), *tables]
        return StageOutput(data, [FigureSpec(png, _record(name).caption)], tables)

    return run


SITE_NAMES = {"residual": "residual", "attention_input": "attention input", "key": "keys"}


def site_tables(data: dict[str, Any]) -> list[TableSpec]:
    """Per-site tables: geometry's per-layer numbers at each site, density's similarity after
    the modified layers per condition and site. Every cell points at its number in the JSON."""
    out: list[TableSpec] = []
    if isinstance(data.get("layers"), list) and data.get("sites"):
        sites = data["sites"]
        metrics = ("first_token_cosine", "token_similarity")
        cols = [f"{m.replace('_', ' ')}, {SITE_NAMES.get(s, s)}" for m in metrics for s in sites]
        rows = tuple(
            (Cell(e["layer"]), *(Cell(None, ("layers", i, m, s)) for m in metrics for s in sites))
            for i, e in enumerate(data["layers"])
        )
        out.append(TableSpec("per layer and site (mean over texts)", ("layer", *cols), rows))
    if data.get("protocol") and data.get("sites"):
        sites, param = data["sites"], data["parameter"]
        rows = tuple(
            (
                Cell(k),
                Cell(None, ("conditions", k, param)),
                Cell(None, ("conditions", k, "ppl")),
                *(Cell(None, ("conditions", k, "after_group_similarity", s)) for s in sites),
            )
            for k in data["conditions"]
        )
        cols = tuple(
            f"similarity after layer {max(data['modified_layers'])}, {SITE_NAMES.get(s, s)}"
            for s in sites
        )
        caption = f"protocol {data['protocol']}: per condition"
        out.append(TableSpec(caption, ("condition", param, "perplexity", *cols), rows))
    return out


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _is_series(x: Any) -> bool:
    return isinstance(x, list) and len(x) > 1 and all(_is_num(v) for v in x)


def generic_view(
    data: dict[str, Any], figures_dir: Any, title: str, curves: bool = True
) -> tuple[list[FigureSpec], list[TableSpec]]:
    """Tables and curves for any ``{condition: {field: number | [numbers]}}`` in a JSON.

    A mapping whose values are mappings becomes a table (one row per condition, one column per
    scalar field) and, for list fields, one figure per field with one curve per condition.
    Nothing is computed: each cell points at its number in the JSON.
    """
    figs: list[FigureSpec] = []
    tables: list[TableSpec] = []
    n_layers = data.get("meta", {}).get("model", {}).get("n_layers")
    flat = [k for k, v in data.items() if _is_series(v) and len(v) == n_layers]
    if flat:  # top-level per-layer lists (e.g. geometry's mean_first_token_cosine)
        n = max(len(data[k]) for k in flat)
        tables.append(
            TableSpec(
                "per layer",
                ("layer", *(k.replace("_", " ") for k in flat)),
                tuple(
                    (Cell(i), *(Cell(None, (k, i)) if i < len(data[k]) else Cell("") for k in flat))
                    for i in range(n)
                ),
            )
        )
    for key, block in data.items():
        if key in ("meta", "finding") or not isinstance(block, dict) or not block:
            continue
        rows = {c: v for c, v in block.items() if isinstance(v, dict)}
        if not rows:
            continue
        scalars = sorted({f for v in rows.values() for f, x in v.items() if _is_num(x)})
        if scalars:
            tables.append(
                TableSpec(
                    f"{key}: per condition",
                    ("condition", *(f.replace("_", " ") for f in scalars)),
                    tuple(
                        (Cell(c), *(_cell((key, c, f), v, f) for f in scalars))
                        for c, v in list(rows.items())[:MAX_ROWS]
                    ),
                )
            )
        series = sorted({f for v in rows.values() for f, x in v.items() if _is_series(x)})
        series = series if curves else []
        for f in series:
            lines = {c: v[f] for c, v in rows.items() if _is_series(v.get(f))}
            longest = max(len(y) for y in lines.values())
            path = figures.curves(
                list(range(longest)),
                lines,
                figures_dir / f"{key}_{f}.png",
                title=f"{title}: {f.replace('_', ' ')}",
                xlabel="layer" if "layer" in f or longest < 64 else "index",
                ylabel=f.replace("_", " "),
            )
            figs.append(FigureSpec(path, f"{f.replace('_', ' ')} per condition ({key})."))
    return figs, tables


def _cell(path: JsonPath, row: dict[str, Any], field: str) -> Cell:
    return Cell(None, path) if _is_num(row.get(field)) else Cell("")


def _cost(name: str):
    def cost(c: ReportConfig) -> float:
        base = {"sensitivity": 10.0 * c.sensitivity_grid, "density": 20.0, "geometry": 6.0}
        per_text = base.get(name, 10.0) * (c.ablate_tokens / 256)
        # geometry's figure already counts its texts; density and sensitivity now read them too
        return per_text * (GEOMETRY_TEXTS if name in ("density", "sensitivity") else 1)

    return cost


def _record(name: str) -> Any:
    from sinklab.ablate.registry import get_experiment

    return get_experiment(name)


def ablation_stages() -> list[Stage]:
    from sinklab.ablate.registry import RECORDS

    return [
        Stage(
            r.name, r.title, r.tests, _cost(r.name), _params(r.name), _command(r.name), _run(r.name)
        )
        for r in RECORDS
    ]
