"""The stage abstraction: one named step of the report that calls a library and collects its output.

A :class:`Stage` knows its name, a title and a paragraph for the page, how expensive it is (for the
ETA), its parameters, the exact ``sinklab ...`` command that reproduces it, and a callable
``run(ctx) -> StageOutput``. :func:`run_stage` times it and turns any exception into a *failed*
:class:`StageResult` carrying the error, so one broken stage never stops the others. Stages never
compute metrics themselves: they call ``sinklab.probe``, ``sinklab.stream.evaluate`` and
``sinklab.ablate`` and keep the JSON those return (plus figures and a few table rows that point
back into that JSON).
Its sizes live in :mod:`sinklab.report.config`, its tables and figures in
:mod:`sinklab.report.cells`.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sinklab.corpus import FirstToken, Text, first_token, text_tokens, token_stream
from sinklab.errors import SinklabError
from sinklab.models.loading import LoadedModel
from sinklab.outputs import place_error
from sinklab.progress import Progress, quiet
from sinklab.report.cells import FigureSpec, TableSpec
from sinklab.report.config import ReportConfig


@dataclass
class StageOutput:
    """What a stage's callable returns: the library's JSON, figures and tables over that JSON."""

    json: dict[str, Any]
    figures: list[FigureSpec] = field(default_factory=list)
    tables: list[TableSpec] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # caveats shown under the section title


@dataclass
class StageContext:
    """Everything a stage may use: the one loaded model, the text, sizes, a figure folder."""

    loaded: LoadedModel
    text: Text
    text_spec: str  # what the user passed as --text (for reproduce commands)
    model_spec: str  # what the user passed as --model
    config: ReportConfig
    figures_dir: Path
    progress: Progress = quiet  # this stage's work: (done, total, note)
    shared: dict[str, Any] = field(default_factory=dict)  # results earlier stages leave for later
    model_options: tuple[str, ...] = ()  # how the model was loaded: --dtype, --device, ...
    prepend: str | None = None  # --prepend as given (None: the tokenizer's own first token)
    fitted: list[str] = field(default_factory=list)  # sizes this stage cut to the text, to say

    @property
    def model_args(self) -> list[str]:
        """``--model`` and the loading options, as a reproduce command passes them."""
        return ["--model", self.model_spec, *self.model_options]

    @property
    def first(self) -> FirstToken:
        """What every sequence of the report starts with (:func:`sinklab.corpus.first_token`)."""
        if "first" not in self.shared:
            self.shared["first"] = first_token(self.loaded.tokenizer, self.prepend)
        return self.shared["first"]

    def first_record(self, ids: torch.Tensor) -> dict[str, Any]:
        """``meta.first_token`` of a stage that read ``ids``."""
        return self.first.record(self.loaded.tokenizer, ids)

    def ids(self, n_tokens: int) -> torch.Tensor:
        """The first ``n_tokens`` token ids of the text, after the run's first token(s)
        (cached; one tokenization per length)."""
        key = f"ids:{n_tokens}"
        if key not in self.shared:
            self.shared[key] = token_stream(self.text, self.loaded.tokenizer, n_tokens, self.first)
        return self.shared[key]

    def cap_tokens(self, n_tokens: int, windows: int = 1, size: str = "", floor: int = 0) -> int:
        """``n_tokens`` limited to the model's max positions (tiny models have short ones) and
        to what the text holds in ``windows`` windows of that length (each window starts with
        the run's first token(s): :func:`sinklab.corpus.token_windows`). A user's text shorter
        than a size asks is read whole rather than refused; ``size`` (the config field that
        asked) names the cut in a note under the stage's title (:attr:`fitted`). A text too
        short for the stage's smallest input (``floor`` tokens) is one line naming the text."""
        limit = self.loaded.info.max_positions
        n = min(n_tokens, limit) if limit else n_tokens
        k = len(self.first.added)
        if n <= k:
            return n
        need = (n - k) * windows
        key = f"text_tokens:{need}"
        if key not in self.shared:  # one count per length asked
            self.shared[key] = text_tokens(self.text, self.loaded.tokenizer, need)
        held = self.shared[key]
        if held >= need:
            return n
        fit = k + held // windows
        if fit < floor:
            each = f" in each of {windows} windows" if windows > 1 else ""
            raise SinklabError(
                f"{self.text.name} holds {held:,} tokens, fewer than the {floor:,}{each} this "
                "stage reads at least; pass a longer text"
            )
        if size:
            each = f" in each of {windows} windows" if windows > 1 else ""
            note = (
                f"{self.text.name} holds {held:,} tokens, so {size} {n:,} was cut to {fit:,} "
                f"tokens{each} (pass a longer text for the full size)."
            )
            if note not in self.fitted:
                self.fitted.append(note)
        return fit


@dataclass(frozen=True)
class Stage:
    """One section of the report."""

    name: str  # short id: "probe", "stream", "first-token", ...
    title: str
    about: str  # one paragraph: what it measures and how to read it
    cost: Callable[[ReportConfig], float]  # estimated seconds on SmolLM2 (2 cores), for the ETA
    params: Callable[[StageContext], dict[str, Any]]
    command: Callable[[StageContext], list[str]]
    run: Callable[[StageContext], StageOutput]


@dataclass
class StageResult:
    """A stage after it ran: its output, or the error that stopped it."""

    name: str
    title: str
    about: str
    status: str  # "ok" | "failed"
    seconds: float
    params: dict[str, Any]
    command: list[str]
    output: StageOutput | None = None
    error: str | None = None  # one line: "ExceptionType: message"
    traceback: str | None = None
    cpu_seconds: float | None = None  # process CPU time (all threads) spent in the stage

    def to_json(self, figure_root: Path) -> dict[str, Any]:
        """The stage's entry in ``results.json`` (figure paths relative to the report folder)."""
        out = self.output
        return {
            "title": self.title,
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "cpu_seconds": None if self.cpu_seconds is None else round(self.cpu_seconds, 3),
            "params": self.params,
            "command": self.command,
            "error": self.error,
            "traceback": self.traceback,
            "figures": [
                {"path": str(f.path.relative_to(figure_root)), "caption": f.caption}
                for f in (out.figures if out else [])
            ],
            "json": out.json if out else None,
        }


def describe_error(exc: BaseException) -> str:
    """One line naming the exception; a missing library module gets a plainer sentence."""
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith("sinklab"):
        return (
            f"ModuleNotFoundError: the library module {exc.name} is not available in this "
            "installation, so this stage cannot run"
        )
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def run_stage(stage: Stage, ctx: StageContext) -> StageResult:
    """Run one stage; any ``Exception`` becomes a failed result, except a full disk, a quota, a
    read-only file system or a file-size limit (:func:`sinklab.outputs.place_error`), which
    stops the report like KeyboardInterrupt does."""
    start, cpu = time.perf_counter(), time.process_time()
    params: dict[str, Any] = {}
    command: list[str] = []
    output: StageOutput | None = None
    error: str | None = None
    trace: str | None = None
    try:
        params = stage.params(ctx)
        command = stage.command(ctx)
        output = stage.run(ctx)
        output.notes[:0] = ctx.fitted  # the sizes cut to the text, first
    except Exception as exc:
        if place_error(exc, ctx.figures_dir) is not None:
            raise  # the disk failed the whole report, not this stage: nothing moves into place
        error = describe_error(exc)
        trace = "".join(traceback.format_exception(exc, limit=-8))
    return StageResult(
        stage.name,
        stage.title,
        stage.about,
        "ok" if error is None else "failed",
        time.perf_counter() - start,
        params,
        command,
        output=output,
        error=error,
        traceback=trace,
        cpu_seconds=time.process_time() - cpu,
    )


def reproduce_dir(ctx: StageContext, name: str) -> str:
    """Where a reproduce command writes: ``DIR-reproduce/NAME``, beside the report (never inside
    it, since the next report replaces ``DIR`` whole; in a several-models report beside the
    top folder: ``DIR-reproduce/MODEL/NAME``)."""
    root, out = ctx.shared.get("reproduce_root"), ctx.shared.get("out")
    if root is None and out is not None:
        root = out.parent / f"{out.name}-reproduce"
    return str(root / name) if root is not None else name
