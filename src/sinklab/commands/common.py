"""Options shared by every command, spelled once (Annotated aliases), and output helpers."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from sinklab.errors import SinklabError


class OutputFormat(StrEnum):
    text = "text"
    json = "json"


ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Model: 'smollm2-135m' (embedded default), a local folder, or a Hugging Face id "
        "already in the local cache.",
        show_default="smollm2-135m",
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
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed.")]
DtypeOpt = Annotated[
    str, typer.Option("--dtype", help="Weights and compute: float32, bfloat16 or float16.")
]
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        help="cpu, cuda, or auto (accelerate's device_map: GPUs, then CPU, then disk).",
    ),
]
# the sink cache (stream, generate)
NSinkOpt = Annotated[int, typer.Option("--n-sink", help="Sink positions kept (StreamingLLM: 4).")]
WindowOpt = Annotated[int, typer.Option("--window", help="Most recent positions kept.")]

stderr = Console(stderr=True)


def emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")


def parse_int_list(value: str | None, name: str) -> list[int] | None:
    """'128,512,2048' -> [128, 512, 2048]; a clear error for anything else."""
    if value is None:
        return None
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts:
        raise SinklabError(f"{name} is empty; pass comma-separated integers, e.g. 128,512")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise SinklabError(f"{name} must be comma-separated integers, got {value!r}") from None


@contextmanager
def progress(enabled: bool = True) -> Iterator[Progress]:
    """A rich progress display on stderr (hidden when not a terminal or when disabled)."""
    prog = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=stderr,
        transient=False,
        disable=not enabled or not stderr.is_terminal,  # no bar frames in logs and pipes
    )
    with prog:
        yield prog
