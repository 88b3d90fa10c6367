"""Options shared by every command, spelled once (Annotated aliases), and output helpers."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from sinklab.errors import SinklabError
from sinklab.meta import dumps_json
from sinklab.parsing import (  # noqa: F401 (the commands import them from here)
    parse_float_list,
    parse_int_list,
    short,
    split_list,
)
from sinklab.seeds import SEED_MAX, SEED_MIN, check_seed


class OutputFormat(StrEnum):
    text = "text"
    json = "json"


def _spec(option: str, default: str):
    """A --model / --text check: not empty, and a usable name if it is read as a path."""

    def check(value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip():
            raise SinklabError(f"{option} is empty; omit {option} for {default}, or pass one")
        try:
            Path(value).expanduser().exists()
        except (OSError, RuntimeError, ValueError) as err:  # too long, ~nosuchuser, a NUL
            why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            raise SinklabError(
                f"{option} {short(value)} is not a usable file or folder name ({why}); "
                f"pass an existing one, or omit {option} for {default}"
            ) from None
        return value

    return check


ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Model: 'smollm2-135m' (embedded default), another zoo name once installed "
        "('sinklab models'), a local folder, or a Hugging Face id already in the local cache.",
        show_default="smollm2-135m",
        callback=_spec("--model", "the embedded smollm2-135m"),
    ),
]
TextOpt = Annotated[
    str | None,
    typer.Option(
        "--text",
        "-t",
        help="Text: 'shakespeare' (embedded plays, default), 'shakespeare:hamlet', "
        "or a UTF-8 file.",
        show_default="shakespeare",
        callback=_spec("--text", "the embedded plays"),
    ),
]
FormatOpt = Annotated[
    OutputFormat, typer.Option("--format", "-f", help="text for people, json for machines.")
]
OutDirOpt = Annotated[Path, typer.Option("--out", "-o", help="Folder for JSON and figures.")]
TrustOpt = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code", help="Allow a model's own Python code (only if you trust it)."
    ),
]
SeedOpt = Annotated[
    int,
    typer.Option(
        "--seed",
        help=f"Random seed ({SEED_MIN}..{SEED_MAX}, what torch accepts).",
        callback=lambda value: check_seed(value),
    ),
]
DtypeOpt = Annotated[
    str, typer.Option("--dtype", help="Weights and compute: float32, bfloat16 or float16.")
]
QuantizeOpt = Annotated[
    str,
    typer.Option(
        "--quantize",
        help="The fast decode path (docs/benchmarks.md#decode): none; int8 (every linear layer "
        "on 8-bit weights); int4 (4-bit where the weights already are, bfloat16 elsewhere); or "
        "auto (on a CPU with AVX-512 bfloat16: int4 for a 4-bit model, else int8; else none).",
    ),
]
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        help="cpu, cuda, or auto (accelerate's device_map: GPUs, then CPU, then disk).",
    ),
]


def check_prepend(value: str | None) -> str | None:
    """A ``--prepend`` value, checked before any model loads (escapes, emptiness); the token
    itself is resolved against the tokenizer by :func:`sinklab.corpus.first_token`."""
    from sinklab.corpus import DEFAULT_PREPEND, check_token_spec

    if value is None or value == DEFAULT_PREPEND:
        return None
    if not value:
        raise SinklabError(
            "--prepend is empty; pass 'default', 'none', 'bos', 'eos', an id or one token"
        )
    check_token_spec(value)
    return value


PrependOpt = Annotated[
    str | None,
    typer.Option(
        "--prepend",
        help="The first token of every sequence: 'default' (the model's tokenizer's own: <bos> "
        "for Gemma, nothing for Qwen2.5 or SmolLM2), 'none', 'bos', 'eos', an id or one token.",
        show_default="default",
        callback=check_prepend,
    ),
]


# the sink cache (stream, generate)
NSinkOpt = Annotated[int, typer.Option("--n-sink", help="Sink positions kept (StreamingLLM: 4).")]
WindowOpt = Annotated[int, typer.Option("--window", help="Most recent positions kept.")]

#: progress, status and logs (the one output convention: docs in README.md#commands)
stderr = Console(stderr=True)
#: the human-readable result; ``--format json`` writes only :func:`emit_json` there
stdout = Console()


def emit(*lines: str, markup: bool = False) -> None:
    """The human-readable result on stdout, one line each (empty ones skipped), never wrapped
    by sinklab (a pipe gets whole lines; a terminal wraps them itself). ``markup``: rich's
    ``[bold]`` tags in the lines are styles, else printed as written."""
    for line in lines:
        if line:
            stdout.print(line, markup=markup, highlight=False, soft_wrap=True)


def plain_table(title: str | None = None, *, show_header: bool = True) -> Any:
    """The one look of every table the commands print: no box (a box costs three columns per
    column, which 80 columns cannot spare), bold headers, no padding at the edges."""
    from rich.table import Table

    return Table(title=title, box=None, pad_edge=False, show_header=show_header)


def print_table(table: Any, console: Console | None = None) -> Console:
    """Print a rich table on stdout, never cutting a cell short. On a terminal it fits the
    screen. On a pipe or in a file it fits the console's width (``COLUMNS``, else 80) wherever
    its wrappable cells can wrap, and is as wide as it needs only where even its narrowest
    layout (every cell wrapped at its longest word, ``no_wrap`` cells whole) is wider, so no
    verdict, number or name is printed as "inconclusi…". -> the console used."""
    from rich.measure import Measurement

    console = console or Console()
    if not console.is_terminal:
        wide = console.options.update_width(10_000)
        for column in table.columns:  # rich measures a no_wrap cell by its longest word
            if column.no_wrap:
                cells = [column.header, *column.cells]
                whole = max(Measurement.get(console, wide, cell).maximum for cell in cells)
                column.min_width = max(column.min_width or 0, whole)
        need = Measurement.get(console, wide, table).minimum
        console = Console(file=console.file, width=max(console.width, need), force_terminal=False)
    console.print(table)
    return console


def emit_json(data: Any) -> None:
    """``--format json`` on stdout, through the one JSON encoder (non-finite numbers as null)."""
    sys.stdout.write(dumps_json(data, unknown=str) + "\n")


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the option ``name`` (its parameter name) was passed on the command line."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def load(
    model: str | None, dtype: str, device: str, trust_remote_code: bool, quantize: str = "none"
) -> Any:
    """Load ``--model`` for a command (a status line on stderr while it loads). Registers the
    lab's model types first, explicitly: to the commands a saved lab checkpoint is a model like
    any other (:func:`sinklab.lab.register`; library users call it themselves). ``quantize``:
    ``--quantize``, the fast decode path (:func:`sinklab.models.fast.load_fast`)."""
    from sinklab.lab import register
    from sinklab.models.fast import choose, load_fast
    from sinklab.models.loading import load_model

    choose(quantize, device)  # a bad --quantize fails before the model loads
    with stderr.status("loading model"):
        register()
        loaded = load_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        return load_fast(loaded, quantize, device)


POSITION_RULE = "sinklab never runs a model on more positions than it has"


def check_positions(info: Any, n_tokens: int, option: str, why: str = "") -> None:
    """The one rule for a model's position limit (``max_position_embeddings``), for every
    command: a run that attends over ``n_tokens`` tokens at once needs that many positions.
    ``option`` is what the user lowers; ``why`` says which run holds them all (optional)."""
    limit = info.max_positions
    if limit is not None and n_tokens > limit:
        raise SinklabError(
            f"{option} {n_tokens} needs {n_tokens} positions{why} but {info.name} has {limit}, "
            f"and {POSITION_RULE}; pass {option} {limit} or fewer"
        )


class _Count(ProgressColumn):
    """``done/total`` for a count, a percentage for a fraction (the report's stages), nothing
    while the total is unknown."""

    def render(self, task: Task) -> Text:
        if task.total is None:
            return Text("")
        if float(task.total).is_integer() and task.total > 1:
            return Text(f"{task.completed:.0f}/{task.total:.0f}", style="progress.download")
        return Text(f"{task.percentage:>3.0f}%", style="progress.percentage")


class _Rate(ProgressColumn):
    """Work per second of a task that names its unit (``unit`` field), e.g. ``12.3 tok/s``."""

    def render(self, task: Task) -> Text:
        unit, elapsed = task.fields.get("unit"), task.elapsed
        if not unit or not elapsed:
            return Text("")
        return Text(f"{task.completed * task.fields['scale'] / elapsed:.1f} {unit}/s")


class Bars(Progress):
    """The one progress display of every command: rich bars on stderr, each fed as a
    :data:`sinklab.progress.Progress` by :meth:`bar` (hidden when stderr is not a terminal, or
    disabled)."""

    def bar(
        self, name: str, total: float | None = None, *, unit: str = "", scale: float = 1.0
    ) -> Callable[..., None]:
        """A bar ``name`` and its :data:`~sinklab.progress.Progress` ``(done, total=None,
        note="")`` (``total`` None keeps the bar's). The bar's clock starts at its first update
        (bars that run one after another, as the stream's policies, each time their own work);
        ``unit`` shows a rate, ``done * scale`` per second (``scale``: work per step, e.g. the
        recompute oracle scores every K-th)."""
        task = self.add_task(name, total=total, status="", unit=unit, scale=scale, start=False)

        def update(done: float, total: float | None = None, note: str = "") -> None:
            if self.tasks[task].start_time is None:
                self.start_task(task)
            self.update(task, completed=done, total=total, status=note)

        return update


@contextmanager
def progress(enabled: bool = True) -> Iterator[Bars]:
    """The progress display (:class:`Bars`) on stderr, for the length of a ``with`` block.

    Hidden when not a terminal or when disabled (``--format json``). It never redirects stdout
    or stderr: ``generate`` writes its text to stdout while its bar runs."""
    prog = Bars(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        _Count(),
        _Rate(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=stderr,
        transient=False,
        redirect_stdout=False,
        redirect_stderr=False,
        disable=not enabled or not stderr.is_terminal,  # no bar frames in logs and pipes
    )
    with prog:
        yield prog
