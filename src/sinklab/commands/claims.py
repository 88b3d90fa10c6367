"""``sinklab claims``: each claim of docs/claims.md measured on a model (or the lab), verdicts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from sinklab.claims.limits import MAX_CLAIMS_SIZES
from sinklab.commands.common import (
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    ModelOpt,
    OutputFormat,
    PrependOpt,
    SeedOpt,
    TrustOpt,
    emit,
    emit_json,
    load,
    parse_int_list,
    plain_table,
    print_table,
    progress,
    split_list,
)

COMMAND = "claims"


def _names(value: str | None, name: str, example: str) -> tuple[str, ...] | None:
    return None if value is None else tuple(split_list(value, name, example))


def claims(
    model: ModelOpt = None,
    texts: Annotated[
        str | None,
        typer.Option(
            "--texts",
            help="Comma-separated texts, one sample each (e.g. shakespeare:hamlet,my.txt).",
            show_default="shakespeare:hamlet,shakespeare:macbeth,shakespeare:othello",
        ),
    ] = None,
    windows: Annotated[
        int,
        typer.Option(
            help="Consecutive windows per text (samples = texts x windows), at most "
            f"{MAX_CLAIMS_SIZES['windows']}."
        ),
    ] = 1,
    only: Annotated[
        str | None, typer.Option("--claims", help="Comma-separated claim ids (default all).")
    ] = None,
    lab: Annotated[
        Path | None,
        typer.Option(
            help="Folder of your own lab runs (train.json files); without it the lab claims "
            "train their runs (3 seeds each, cached: see --lab-cache)."
        ),
    ] = None,
    lab_size: Annotated[
        str, typer.Option(help="Sizes of the lab runs trained: full or quick (docs/claims.md).")
    ] = "full",
    lab_steps: Annotated[
        int | None, typer.Option(help="Steps of each trained lab run (default: the size's).")
    ] = None,
    lab_cache: Annotated[
        bool, typer.Option("--lab-cache", help="Show the lab run cache (folder, runs) and exit.")
    ] = False,
    clear_lab_cache: Annotated[
        bool, typer.Option("--clear-lab-cache", help="Empty the lab run cache and exit.")
    ] = False,
    tokens: Annotated[
        int,
        typer.Option(
            help=f"Tokens for probe, geometry, density (8..{MAX_CLAIMS_SIZES['probe_tokens']})."
        ),
    ] = 256,
    stream_tokens: Annotated[
        int,
        typer.Option(
            help=f"Tokens streamed per text window (8..{MAX_CLAIMS_SIZES['stream_tokens']}); the "
            "stream claim reads windows of this length (docs/claims.md#stream-claim-sizes)."
        ),
    ] = 1280,
    window: Annotated[int, typer.Option(help="Streaming: recent tokens kept.")] = 60,
    n_sink: Annotated[int, typer.Option(help="Streaming: sink tokens kept.")] = 4,
    grid: Annotated[
        int,
        typer.Option(
            help=f"Sensitivity: grid x grid (t, i) positions (1..{MAX_CLAIMS_SIZES['grid']})."
        ),
    ] = 4,
    probes: Annotated[
        int,
        typer.Option(
            help=f"Sensitivity: Hutchinson probes per query, 0..{MAX_CLAIMS_SIZES['probes']} "
            "(0 = exact Frobenius norms, slow)."
        ),
    ] = 8,
    q0: Annotated[int, typer.Option(help="First query counted in sink mass.")] = 16,
    eps: Annotated[
        float, typer.Option(help="Sink-head threshold: a head is a sink head above it.")
    ] = 0.3,
    sensitivity_tokens: Annotated[
        int,
        typer.Option(
            help=f"Sensitivity: tokens per text, 8..{MAX_CLAIMS_SIZES['sensitivity_tokens']} "
            "(Jacobians are costly)."
        ),
    ] = 128,
    cost_lengths: Annotated[
        str, typer.Option(help="Cost claim: context lengths T.")
    ] = "16,32,64,128,256",
    cost_seeds: Annotated[
        int, typer.Option(help=f"Cost claim: fitting seeds (1..{MAX_CLAIMS_SIZES['cost_seeds']}).")
    ] = 3,
    cost_steps: Annotated[
        int,
        typer.Option(
            help=f"Cost claim: Adam steps per radius (1..{MAX_CLAIMS_SIZES['cost_steps']})."
        ),
    ] = 100,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Folder for claims.json and the figure.")
    ] = None,
    fmt: FormatOpt = OutputFormat.text,
    seed: SeedOpt = 0,
    trust_remote_code: TrustOpt = False,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    prepend: PrependOpt = None,
) -> None:
    """Test every claim of docs/claims.md by its one rule: effect, 95 % interval, verdict.

    Examples:

      sinklab claims
      sinklab claims --texts shakespeare:lear,shakespeare:tempest,my.txt
      sinklab claims --claims first-token-sinks,sink-cheaper --lab runs/ --out claims-out
    """
    from sinklab.claims.across import model_names
    from sinklab.claims.core import DEFAULT_TEXTS, ClaimsConfig
    from sinklab.claims.run import ClaimsRun
    from sinklab.errors import SinklabError

    if lab_cache or clear_lab_cache:
        _cache_command(clear_lab_cache, fmt)
        return
    config = ClaimsConfig(
        texts=_names(texts, "--texts", "shakespeare:hamlet,my.txt") or DEFAULT_TEXTS,
        windows=windows,
        claims=_names(only, "--claims", "first-token-sinks,sink-cheaper"),
        probe_tokens=tokens,
        stream_tokens=stream_tokens,
        window=window,
        n_sink=n_sink,
        grid=grid,
        probes=probes,
        q0=q0,
        eps=eps,
        sensitivity_tokens=sensitivity_tokens,
        cost_lengths=tuple(parse_int_list(cost_lengths, "--cost-lengths") or ()),
        cost_seeds=cost_seeds,
        cost_steps=cost_steps,
        lab=str(lab) if lab is not None else None,
        lab_size=lab_size,
        lab_steps=lab_steps,
        seed=seed,
        prepend=prepend,
    )
    several = model_names(model)
    if several is not None and not config.needs_model:
        raise SinklabError(
            "--model names several models but the chosen claims read none; pass one model"
        )
    if out is not None:
        from sinklab.outputs import check_out

        out = check_out(out, COMMAND)  # refuse a folder of the user's before any work
    if several is not None:
        _claims_across(several, config, out, fmt, (dtype, device, trust_remote_code))
        return
    texts_read = config.read_texts()  # a bad text fails before the model loads
    loaded = load(model, dtype, device, trust_remote_code) if config.needs_model else None
    with progress(fmt is OutputFormat.text) as bars:
        result = ClaimsRun(config).run(loaded, bars.bar("claims"), texts_read)
    data = result.to_json()
    if out is not None:
        from sinklab.claims.plots import plot_claims
        from sinklab.outputs import write_results

        name = loaded.info.name if loaded else "lab / cost only"

        def figure(folder: Path) -> list[Path]:
            path = folder / "claims_effects.png"
            plot_claims(data["claims"], path, title=f"Claims: {name}")
            return [path]

        write_results(out, COMMAND, {"claims.json": data}, figure)
    if fmt is OutputFormat.json:
        emit_json(data)
        return
    _print_table(data)
    if out is not None:
        emit(f"wrote {out}/claims.json and claims_effects.png")


def _claims_across(
    names: list[str],
    config: Any,
    out: Path | None,
    fmt: OutputFormat,
    loading: tuple[str, str, bool],
) -> None:
    """``--model a,b,c``: each model's claims in turn (one model in memory at a time), joined
    into one claim x model table (:mod:`sinklab.claims.across`) and figure."""
    import gc

    from sinklab.claims.across import across_table, differences, plot_across
    from sinklab.claims.run import ClaimsRun
    from sinklab.meta import attach_meta

    texts_read = config.read_texts()  # a bad text fails before the first model loads
    runs: list[tuple[str, dict]] = []
    start = time.perf_counter()
    with progress(fmt is OutputFormat.text) as bars:
        for name in names:
            loaded = load(name, *loading)
            result = ClaimsRun(config).run(loaded, bars.bar(f"claims {name}"), texts_read)
            runs.append((name, result.to_json()))
            del loaded, result
            gc.collect()  # the next model loads into the memory this one held
    table = across_table(runs)
    data = attach_meta(
        {"models": names, "table": table, "runs": [{"model": n, **d} for n, d in runs]},
        None,
        texts_read,
        config,
        time.perf_counter() - start,
    )
    data["meta"]["model"] = [d["meta"]["model"] for _, d in runs]
    data["meta"]["first_token"] = [d["meta"]["first_token"] for _, d in runs]  # each its own
    if out is not None:
        from sinklab.outputs import write_results

        def figure(folder: Path) -> list[Path]:
            return [plot_across(table, names, folder / "claims_models.png")]

        write_results(out, COMMAND, {"claims.json": data}, figure)
    if fmt is OutputFormat.json:
        emit_json(data)
        return
    _print_across(table, names, [d["meta"]["seconds"] for _, d in runs])
    emit(*differences(table, names))
    if out is not None:
        emit(f"wrote {out}/claims.json and claims_models.png")


def _print_across(
    table: list[dict], names: list[str], seconds: list[float], console: Any = None
) -> None:
    from sinklab.claims.across import text_rows

    timing = ", ".join(f"{n} {s:.0f} s" for n, s in zip(names, seconds, strict=True))
    view = plain_table(f"Claims across models (rule: docs/claims.md; {timing})")
    for col in ("claim", "claimed", *names):
        view.add_column(col, no_wrap=col in ("claim", "claimed"))
    for row in text_rows(table, names):
        view.add_row(*row)
    print_table(view, console)


def _cache_command(clear: bool, fmt: OutputFormat) -> None:
    """``--lab-cache``: the cache folder and its runs; ``--clear-lab-cache``: empty it."""
    from sinklab.lab.cache import cache_listing, clear_cache, lab_cache_dir

    folder = lab_cache_dir()
    if clear:
        n = clear_cache()
        if fmt is OutputFormat.json:
            emit_json({"cache": str(folder), "removed": n})
        else:
            emit(f"removed {n} cached lab run(s) from {folder}")
        return
    rows = cache_listing()
    if fmt is OutputFormat.json:
        emit_json({"cache": str(folder), "runs": rows})
        return
    emit(
        f"lab run cache: {folder} ({len(rows)} run(s); sinklab claims --clear-lab-cache empties it)"
    )
    for r in rows:
        state = {True: "converged", False: "not converged", None: "-"}[r.get("converged")]
        emit(f"  {r['key']}  {r.get('run', 'unreadable')}  {state if r['readable'] else ''}")


def _print_table(data: dict, console: Any = None) -> None:
    """The claims table on stdout (:func:`~sinklab.commands.common.print_table`: 80 columns
    hold it, nothing is cut short). The site goes under the claim's id, in its cell: a column
    of its own leaves no room for the numbers."""
    from sinklab.claims.table import COLUMNS, reasons, text_rows

    table = plain_table("Claims (rule: docs/claims.md)")
    claim, site, *numbers = COLUMNS
    table.add_column(f"{claim} ({site})", min_width=max(len(r["id"]) for r in data["claims"]))
    for col in numbers:
        table.add_column(col, no_wrap=True)  # numbers and verdicts never break
    for ident, where, *cells in text_rows(data):
        table.add_row(f"{ident}\n({where})", *cells)
    console = print_table(table, console)
    for line in reasons(data):
        console.print(line, soft_wrap=True)
    lab = data.get("run", {}).get("lab")
    if lab:
        console.print(
            f"lab runs: {lab['trained']} trained, {lab['reused']} reused from {lab['cache']} "
            f"({lab['seconds']:.0f} s)"
        )


def register(app: typer.Typer) -> None:
    app.command(COMMAND)(claims)
