"""``sinklab report``: probe, stream and ablate on one model, written up as one HTML page."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from sinklab.commands.common import (
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    ModelOpt,
    OutputFormat,
    PrependOpt,
    TextOpt,
    TrustOpt,
    emit,
    emit_json,
    load,
    progress,
    split_list,
    stderr,
)
from sinklab.corpus import DEFAULT_TEXT, load_text
from sinklab.models.loading import DEFAULT_MODEL
from sinklab.progress import Progress

DEFAULT_OUT = Path("sinklab-report")


def report(
    model: ModelOpt = None,
    text: TextOpt = None,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Report folder (index.html + results.json).")
    ] = DEFAULT_OUT,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="Smaller sizes: about 4 minutes on SmolLM2 with 2 cores (less once the lab "
            "runs are cached).",
        ),
    ] = False,
    stages: Annotated[
        str | None,
        typer.Option(
            "--stages",
            help="Comma-separated subset of stages to run (default: all). "
            "See the page's section ids, e.g. probe,stream,first-token.",
        ),
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override one size, KEY=VALUE (repeatable), e.g. --set window=508 "
            "--set probe_lengths=128,1024. Keys: the fields of ReportConfig.",
        ),
    ] = None,
    trust_remote_code: TrustOpt = False,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    prepend: PrependOpt = None,
    fmt: FormatOpt = OutputFormat.text,
) -> None:
    """Run the probe, streaming perplexity and ablations, and write one self-contained page.

    Writes OUT/index.html (figures embedded, no network) and OUT/results.json. The report is
    built in a temporary folder and moved into place at the end: an interrupted run (Ctrl-C)
    leaves the previous report untouched. A stage that fails shows its error; the others run.
    --format json prints results.json (and the page's path, "index") on stdout.

    Example: sinklab report --quick --out my-report
    """
    from sinklab.claims.across import model_names
    from sinklab.report import ReportConfig, build_report, check_out_dir, select_stages
    from sinklab.report.build import check_fitted
    from sinklab.report.config import parse_overrides
    from sinklab.report.stages import StageResult

    chosen = select_stages(
        split_list(stages, "--stages", "probe,stream") if stages is not None else None
    )
    config = ReportConfig.preset(quick, **parse_overrides(overrides or []))
    config.check_stream([s.name for s in chosen])  # cheap checks first: sizes and the folder
    out = check_out_dir(out)  # fail before the model loads
    txt = load_text(text)
    several = model_names(model)
    if several is not None:
        loading = (dtype, device, trust_remote_code)
        _report_across(several, txt, text, out, chosen, config, loading, prepend, fmt)
        return
    loaded = load(model, dtype, device, trust_remote_code)
    config, notes = config.fit(loaded.info.max_positions, loaded.info.name)  # clamp, and say so
    check_fitted(config, chosen, loaded, txt, prepend)  # fitted to the model and the text: ok?
    for note in notes:
        stderr.print(note, highlight=False, soft_wrap=True)
    model_options = _model_options((dtype, device, trust_remote_code), prepend)
    as_text = fmt is OutputFormat.text
    with progress(as_text) as bars:
        tick = bars.bar("report", 1.0)  # a fraction: build_report counts estimated seconds

        def stage_done(r: StageResult) -> None:
            if not as_text:
                return
            mark = "[green]ok[/green]" if r.status == "ok" else f"[red]failed[/red]: {r.error}"
            bars.console.print(f"  {r.name}: {mark} ({r.seconds:.1f} s)", highlight=False)

        result = build_report(
            loaded,
            txt,
            out=out,
            stages=chosen,
            config=config,
            model_spec=model or DEFAULT_MODEL,
            text_spec=text or DEFAULT_TEXT,
            progress=_fraction(tick),
            model_options=model_options,
            prepend=prepend,
            on_stage=stage_done,
            notes=notes,
        )
    if not as_text:
        emit_json({"index": str(result.index), **result.data})
        return
    failed = [r for r in result.results if r.status != "ok"]
    emit(
        *(f"  • {sentence}" for sentence in result.data["summary"]),
        f"report written in {result.seconds:.0f} s "
        f"({len(result.results) - len(failed)}/{len(result.results)} stages ok)",
    )
    emit(str(result.index))  # the last line: the page's path, for scripts and `make demo`


def _report_across(
    names: list[str],
    txt: Any,
    text: str | None,
    out: Path,
    chosen: Any,
    config: Any,
    loading: tuple[str, str, bool],
    prepend: str | None = None,
    fmt: OutputFormat = OutputFormat.text,
) -> None:
    """``--model a,b,c``: one full report per model in ``out/<model>/``, one model in memory at
    a time, and an index page with the claims across models (:mod:`sinklab.report.across`).
    ``prepend``: as in one model's report, each model's tokenizer deciding its own default."""
    from sinklab.report.across import build_across
    from sinklab.report.build import build_into, check_fitted

    model_options = _model_options(loading, prepend)

    def load_one(name: str) -> tuple[Any, list[str], Any]:
        loaded = load(name, *loading)
        fitted, notes = config.fit(loaded.info.max_positions, loaded.info.name)
        if name == names[0]:  # before any work; a later model's own stage says it instead,
            check_fitted(fitted, chosen, loaded, txt, prepend)  # so no finished report is lost
        for note in notes:
            stderr.print(note, highlight=False, soft_wrap=True)
        return loaded, notes, fitted

    with progress(fmt is OutputFormat.text) as bars:

        def build(folder: Path, loaded: Any, notes: list[str], fitted: Any, name: str) -> Any:
            return build_into(
                folder,
                loaded,
                txt,
                stages=chosen,
                config=fitted,
                model_spec=name,
                text_spec=text or DEFAULT_TEXT,
                final_out=out / folder.name,
                progress=_fraction(bars.bar(f"report {name}", 1.0)),
                notes=notes,
                model_options=model_options,
                prepend=prepend,
                # beside the whole folder
                reproduce_root=out.parent / f"{out.name}-reproduce" / folder.name,
            )

        index, reports = build_across(names, load_one, out=out, build=build)
    if fmt is OutputFormat.json:
        written = json.loads((out / "results.json").read_text(encoding="utf-8"))  # just written
        emit_json({"index": str(index), **written})
        return
    for name, rep in reports:
        ok = sum(r.status == "ok" for r in rep.results)
        emit(f"{name}: {ok}/{len(rep.results)} stages ok in {rep.seconds:.0f} s")
    emit(str(index))


def _model_options(loading: tuple[str, str, bool], prepend: str | None) -> tuple[str, ...]:
    """How the model was loaded (the options given), for every section's reproduce command."""
    dtype, device, trust = loading
    return (
        *(("--dtype", dtype) if dtype != "float32" else ()),
        *(("--device", device) if device != "cpu" else ()),
        *(("--trust-remote-code",) if trust else ()),
        *(("--prepend", prepend) if prepend is not None else ()),
    )


def _fraction(tick: Progress) -> Progress:
    """The report's progress (estimated seconds) on a bar of total 1: shown as a percentage."""
    return lambda done, total, note="": tick(done / total if total else 0.0, 1.0, note)


def register(app: typer.Typer) -> None:
    app.command("report")(report)
