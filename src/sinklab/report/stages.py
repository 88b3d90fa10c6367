"""The stage abstraction: one named step of the report that calls a library and collects its output.

A :class:`Stage` knows its name, a title and a paragraph for the page, how expensive it is (for the
ETA), its parameters, the exact ``sinklab ...`` command that reproduces it, and a callable
``run(ctx) -> StageOutput``. :func:`run_stage` times it and turns any exception into a *failed*
:class:`StageResult` carrying the error, so one broken stage never stops the others. Stages never
compute metrics themselves: they call ``sinklab.probe``, ``sinklab.stream.evaluate`` and
``sinklab.ablate`` and keep the JSON those return (plus figures and a few table rows that point
back into that JSON).

Shape glossary for tables: a :class:`Cell` shows one value; ``path`` is where the value lives in
the stage's JSON (a tuple of keys / list indices) and ``agg`` how the shown value is derived from
the list found there (``None``: shown as is). The page writes both into ``data-`` attributes so a
test (or a reader) can check every printed number against ``results.json``.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from sinklab.corpus import FirstToken, Text, first_token, token_stream
from sinklab.errors import SinklabError
from sinklab.models.loading import LoadedModel
from sinklab.outputs import place_error
from sinklab.parsing import parse_int_list
from sinklab.probe.metrics import nan_mean
from sinklab.probe.spec import DEFAULT_EPS
from sinklab.progress import Progress, quiet

JsonPath = tuple[str | int, ...]
AGGREGATES = ("mean", "max", "argmax", "count:VALUE")


MAX_TOKENS = 1 << 20  # the largest length, window or sink count a report accepts (--set)
MAX_GRID = 32  # the largest sensitivity grid side (grid^2 Jacobian rows)


@dataclass(frozen=True)
class ReportConfig:
    """Sizes of every stage. :meth:`preset` gives the two sizes the CLI offers."""

    quick: bool = False
    probe_tokens: int = 1024  # the probe's main length
    probe_lengths: tuple[int, ...] = (128, 512, 1024, 2048)  # the length trend
    q0: int = 16  # first query counted in sink mass (docs/metrics.md#q0-eps)
    eps: float = 0.3  # sink-head threshold
    stream_tokens: int = 20000  # streaming perplexity length (eviction starts at n_sink + window)
    n_sink: int = 4
    window: int = 508  # recent tokens kept by the window and sink policies
    recompute_every: int = 500  # the recompute oracle scores every K-th position
    ablate_tokens: int = 256  # length of the ablation experiments' input
    sensitivity_grid: int = 6  # (t, i) grid side for the Jacobian experiment
    seed: int = 0
    lab_steps: int | None = None  # steps of the claims' lab runs (None: the lab size's)
    stages: tuple[str, ...] | None = None  # None = every stage

    def __post_init__(self) -> None:
        positive = {
            "probe_tokens": self.probe_tokens,
            "stream_tokens": self.stream_tokens,
            "n_sink": self.n_sink,
            "window": self.window,
            "recompute_every": self.recompute_every,
            "ablate_tokens": self.ablate_tokens,
            "sensitivity_grid": self.sensitivity_grid,
        }
        for name, value in positive.items():
            if value < 1:
                raise SinklabError(f"report {name} must be at least 1, got {value}")
            top = MAX_GRID if name == "sensitivity_grid" else MAX_TOKENS
            if value > top:
                raise SinklabError(
                    f"report {name} must be at most {top:,} (a run that fits this machine), "
                    f"got {value:,}; pass a smaller --set {name}"
                )
        if not self.probe_lengths or min(self.probe_lengths) < 2:
            raise SinklabError(
                f"report probe_lengths must be non-empty lengths >= 2, got {self.probe_lengths}"
            )
        if max(self.probe_lengths) > MAX_TOKENS:
            raise SinklabError(
                f"report probe_lengths must be at most {MAX_TOKENS:,} tokens, got "
                f"{max(self.probe_lengths):,}; pass smaller --set probe_lengths"
            )
        if self.lab_steps is not None and self.lab_steps < 10:
            raise SinklabError(f"report lab_steps must be at least 10, got {self.lab_steps}")
        if not 0 < self.eps < 1:
            raise SinklabError(f"report eps must be in (0, 1), got {self.eps}")
        if not 0 <= self.q0 < min(self.probe_tokens, self.ablate_tokens):
            raise SinklabError(
                f"report q0 must be in [0, {min(self.probe_tokens, self.ablate_tokens)}), "
                f"got {self.q0}"
            )

    def check_stream(self, stages: Sequence[str], max_positions: int | None = None) -> None:
        """Refuse a streaming stage whose sinks and window are not below its length: nothing
        would ever be evicted (every policy would be dense), or, where the length was clamped to
        the model, the cache would run past the model's positions. Called before the model
        loads and again once the sizes are fitted to it (``max_positions``: the model's), so the
        report never runs to find out."""
        if "stream" not in stages or self.n_sink + self.window < self.stream_tokens:
            return
        clamped = " (the model's positions)" if self.stream_tokens == max_positions else ""
        raise SinklabError(
            f"report n_sink + window = {self.n_sink + self.window:,} is not below stream_tokens "
            f"= {self.stream_tokens:,}{clamped}, so the stream stage would evict nothing; pass a "
            f"smaller --set window (at most {max(1, self.stream_tokens - self.n_sink - 1):,}) or a "
            "larger --set stream_tokens"
        )

    @property
    def thresholds(self) -> tuple[float, ...]:
        """The page's ``eps`` first, then the stricter defaults beside it (0.3 -> 0.3, 0.8;
        0.6 -> 0.6, 0.8; 0.9 -> 0.9): every stage that probes uses these."""
        return (self.eps, *(e for e in DEFAULT_EPS if e > self.eps))

    def fit(self, max_positions: int | None, model: str) -> tuple[ReportConfig, list[str]]:
        """The sizes that run on a model with ``max_positions`` positions (every length past it
        clamped to it), and one sentence per clamp, to say so (the config records what ran)."""
        if not max_positions:
            return self, []
        notes, changes = [], {}
        for name in ("probe_tokens", "stream_tokens", "ablate_tokens"):
            value = getattr(self, name)
            if value > max_positions:
                changes[name] = max_positions
                notes.append(f"{name} {value} is past the {max_positions} positions of {model}")
        past = [n for n in self.probe_lengths if n > max_positions]
        if past:
            changes["probe_lengths"] = tuple(
                sorted({min(n, max_positions) for n in self.probe_lengths})
            )
            notes.append(
                f"probe_lengths {', '.join(map(str, past))} "
                f"{'is' if len(past) == 1 else 'are'} past the {max_positions} positions of {model}"
            )
        if not changes:
            return self, []
        fitted = replace(self, **changes)
        ran = ", ".join(f"{k}={getattr(fitted, k)}" for k in changes)
        return fitted, [f"Sizes: {'; '.join(notes)}, so the report ran {ran}."]

    @classmethod
    def preset(cls, quick: bool, **overrides: Any) -> ReportConfig:
        """Defaults for a 2-core CPU and SmolLM2: full < 15 min, quick < 3 min."""
        if quick:
            base: dict[str, Any] = dict(
                quick=True,
                probe_tokens=512,
                probe_lengths=(128, 256, 512),
                stream_tokens=4000,
                window=252,
                recompute_every=200,
                ablate_tokens=128,
                sensitivity_grid=4,
            )
        else:
            base = {}
        return cls(**{**base, **overrides})


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["window=252", "probe_lengths=128,512"]`` -> typed ReportConfig overrides (one-line
    SinklabError for an unknown key or a bad value)."""
    types = {f.name: f.type for f in fields(ReportConfig) if f.name not in ("quick", "stages")}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in types:
            raise SinklabError(
                f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(types)}"
            )
        if key in out:
            raise SinklabError(
                f"--set {key} is given twice; pass each KEY once (the last would silently win)"
            )
        if "tuple" in str(types[key]):
            out[key] = tuple(parse_int_list(value, f"--set {key}") or ())
            continue
        try:
            out[key] = float(value) if "float" in str(types[key]) else int(value)
        except ValueError:
            raise SinklabError(f"--set {item!r}: {value!r} is not a valid {key}") from None
    return out


@dataclass(frozen=True)
class Cell:
    """One table cell: a label (``path`` None) or a value found at ``path`` in the stage JSON."""

    value: Any
    path: JsonPath | None = None
    agg: str | None = None  # one of AGGREGATES, applied to the list at ``path``


@dataclass(frozen=True)
class TableSpec:
    caption: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]


@dataclass(frozen=True)
class FigureSpec:
    path: Path  # a PNG written by the stage
    caption: str


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

    def cap_tokens(self, n_tokens: int) -> int:
        """``n_tokens`` limited to the model's max positions (tiny models have short ones)."""
        limit = self.loaded.info.max_positions
        return min(n_tokens, limit) if limit else n_tokens


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


def lookup(data: Any, path: JsonPath) -> Any:
    """The value at ``path`` in nested dicts/lists (KeyError/IndexError when absent)."""
    for key in path:
        data = data[key]
    return data


def aggregate(values: Any, agg: str | None) -> Any:
    """Apply a table cell's aggregate to the list it points at (None: the value itself)."""
    if agg is None:
        return values
    if agg.startswith("count:"):
        return sum(v == agg.removeprefix("count:") for v in _flatten(values))
    flat = [float(v) for v in _flatten(values)]
    if agg == "mean":
        return nan_mean(flat)
    finite = [v for v in flat if v == v]  # NaN-safe, like the mean
    if agg == "max":
        return max(finite) if finite else float("nan")
    if agg == "argmax":
        return max(range(len(flat)), key=flat.__getitem__)
    raise ValueError(f"unknown aggregate {agg!r}; one of {AGGREGATES}")


def _flatten(values: Any) -> list[Any]:
    if isinstance(values, list | tuple):
        return [x for v in values for x in _flatten(v)]
    return [values]
