"""Run every stage on one loaded model and write ``DIR/index.html`` + ``DIR/results.json``.

The report is assembled in a temporary folder beside ``DIR`` (same file system) and only moved
into place once complete (:func:`sinklab.outputs.output_dir`: one exchange, the old report
deleted last), so an interrupted or crashed run never leaves a half-written report over a good
one. A stage that raises becomes a failed section with its error; the others still run. A report
is never moved into place when the place failed it (a full disk, a quota, a read-only file system:
one line) or when every stage failed (nothing to show): the previous report stays byte-identical.
``KeyboardInterrupt`` removes the temporary folder and propagates.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sinklab.corpus import Text, first_token, sequence_tokens, token_stream
from sinklab.errors import SinklabError
from sinklab.meta import attach_meta, versions, write_json_atomic
from sinklab.models.loading import LoadedModel
from sinklab.outputs import check_out, output_dir
from sinklab.progress import Progress, quiet
from sinklab.report.config import ReportConfig
from sinklab.report.html import render_page
from sinklab.report.stages import Stage, StageContext, StageResult, run_stage
from sinklab.report.summary import headline

COMMAND = "report"  # the marker name a previous report carries (see sinklab.outputs)


@dataclass
class Report:
    """A finished report: where it is, each stage's result and what ``results.json`` holds."""

    out: Path
    results: list[StageResult]
    data: dict[str, Any]
    seconds: float

    @property
    def index(self) -> Path:
        return self.out / "index.html"


def check_out_dir(out: Path) -> Path:
    """``out`` resolved; refused unless new, empty or a previous sinklab report (user data is
    sacred)."""
    return check_out(out, COMMAND)


def _footer(loaded: LoadedModel, text: Text, n_results: int, seconds: float) -> dict[str, str]:
    v = versions()
    info = loaded.info
    return {
        "model": f"{info.name} ({info.model_type}, {info.n_layers} layers x {info.n_heads} heads, "
        f"{info.n_params / 1e6:.1f}M params, {info.dtype})",
        "weights sha256": (info.weights_sha256 or "n/a")[:16],
        "text": f"{text.name} (sha256 {text.sha256[:16]})",
        "versions": ", ".join(f"{k} {val}" for k, val in v.items()),
        "run time": f"{seconds:.1f} s for {n_results} stages",
        "written": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def check_fitted(
    config: ReportConfig,
    stages: Sequence[Stage],
    loaded: LoadedModel,
    text: Text,
    prepend: str | None = None,
) -> None:
    """Refuse, before any work, sizes that cannot run once fitted to the model and the text:
    a stream stage that would evict nothing (:meth:`ReportConfig.check_stream`, with the tokens
    a user's short text fills of the stream)."""
    names = [s.name for s in stages]
    held = None
    if "stream" in names:
        held = sequence_tokens(text, loaded.tokenizer, config.stream_tokens, prepend)
    config.check_stream(names, loaded.info.max_positions, held, text.name)


def build_report(
    loaded: LoadedModel,
    text: Text,
    *,
    out: Path,
    stages: Sequence[Stage],
    config: ReportConfig,
    model_spec: str,
    text_spec: str,
    progress: Progress = quiet,
    on_stage: Callable[[StageResult], None] | None = None,
    notes: Sequence[str] = (),
    model_options: Sequence[str] = (),
    prepend: str | None = None,
) -> Report:
    """Run ``stages`` in order on ``loaded`` and write the report to ``out`` (atomically).

    ``progress`` (:data:`~sinklab.progress.Progress`) counts estimated seconds, its note
    ``stage i/n: name note``; ``on_stage(result)``
    is called as each stage finishes; ``notes`` (e.g. sizes clamped to the model) lead the
    summary; ``model_options`` (``--dtype``, ``--device``, ``--prepend``, ... as given) go on
    every section's reproduce command; ``prepend``: the first token of every sequence
    (:func:`sinklab.corpus.first_token`; None: the tokenizer's own).
    """
    out = check_out(out, COMMAND)
    check_fitted(config, stages, loaded, text, prepend)  # before any work
    with output_dir(out, COMMAND) as tmp:
        report = build_into(
            tmp,
            loaded,
            text,
            stages=stages,
            config=config,
            model_spec=model_spec,
            text_spec=text_spec,
            final_out=out,
            progress=progress,
            on_stage=on_stage,
            notes=notes,
            model_options=model_options,
            prepend=prepend,
        )
    report.out = out
    return report


def build_into(
    tmp: Path,
    loaded: LoadedModel,
    text: Text,
    *,
    stages: Sequence[Stage],
    config: ReportConfig,
    model_spec: str,
    text_spec: str,
    final_out: Path,
    progress: Progress = quiet,
    on_stage: Callable[[StageResult], None] | None = None,
    notes: Sequence[str] = (),
    model_options: Sequence[str] = (),
    prepend: str | None = None,
    reproduce_root: Path | None = None,
) -> Report:
    """One model's report built in the folder ``tmp`` (which its caller moves to ``final_out``,
    as :func:`build_report` does, or keeps inside a larger output, as a several-models report
    does); the other arguments are :func:`build_report`'s. ``reproduce_root``: where the sections'
    reproduce commands write (default ``OUT-reproduce`` beside ``final_out``; a report inside a
    several-models report passes one beside the top folder, since nothing may be written inside
    an output)."""
    model_options = tuple(model_options)
    start = time.perf_counter()
    costs = [max(0.1, float(s.cost(config))) for s in stages]
    budget = sum(costs)  # estimated seconds
    shared: dict[str, Any] = {}
    results: list[StageResult] = []
    spent = 0.0
    for i, (stage, cost) in enumerate(zip(stages, costs, strict=True)):
        label = f"stage {i + 1}/{len(stages)}: {stage.name}"

        # the stage's own progress (done of total units of its work), in the report's seconds
        def stage_progress(
            done: float, total: float, note: str = "", _base=spent, _cost=cost, _label=label
        ) -> None:
            frac = min(1.0, max(0.0, float(done) / total)) if total > 0 else 0.0
            progress(_base + frac * _cost, budget, f"{_label} {note}".rstrip())

        stage_progress(0, 1)
        figures = tmp / "figures" / stage.name
        figures.mkdir(parents=True, exist_ok=True)
        ctx = StageContext(
            loaded=loaded,
            text=text,
            text_spec=text_spec,
            model_spec=model_spec,
            config=config,
            figures_dir=figures,
            progress=stage_progress,
            shared=shared,
            model_options=model_options,
            prepend=prepend,
        )
        ctx.shared["out"] = final_out
        ctx.shared["reproduce_root"] = reproduce_root
        results.append(run_stage(stage, ctx))
        if on_stage is not None:
            on_stage(results[-1])
        spent += cost
        stage_progress(1, 1, results[-1].status)
    if results and all(r.status != "ok" for r in results):
        first = results[0]
        kept = "the previous report is as it was" if final_out.exists() else "no report written"
        raise SinklabError(
            f"every stage of the report failed ({first.name}: {first.error}); {kept}"
        )
    seconds = time.perf_counter() - start
    summary = [*notes, *headline(results)]
    data = {
        "meta": None,  # attach_meta below
        "summary": summary,
        "stages": {r.name: r.to_json(tmp) for r in results},
    }
    params = {**asdict(config), "stages": [s.name for s in stages]}
    first = shared.get("first") or first_token(loaded.tokenizer, prepend)
    record = first.record(loaded.tokenizer, token_stream(text, loaded.tokenizer, 2, first))
    attach_meta(data, loaded.info, text, params, seconds, record)
    write_json_atomic(tmp / "results.json", data)
    n_ok = sum(r.status == "ok" for r in results)
    title = f"sinklab report: {loaded.info.name}"
    subtitle = (
        f"Attention sinks in {loaded.info.name} on {text.name}"
        f"{' (quick sizes)' if config.quick else ''}: {n_ok} of {len(results)} stages ran."
    )
    page = render_page(
        title=title,
        subtitle=subtitle,
        summary=summary,
        results=results,
        footer=_footer(loaded, text, len(results), seconds),
    )
    (tmp / "index.html").write_text(page, encoding="utf-8")
    return Report(out=tmp, results=results, data=data, seconds=seconds)
