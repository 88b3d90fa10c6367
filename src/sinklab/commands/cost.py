"""``sinklab cost``: the parameter-norm cost of a sink against a diagonal pattern, against T."""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from sinklab.commands.common import (
    FormatOpt,
    OutputFormat,
    SeedOpt,
    emit,
    emit_json,
    parse_int_list,
    progress,
)
from sinklab.lab.limits import MAX_BISECTIONS, MAX_DIM, MAX_STEPS


class Task(StrEnum):
    sink = "sink"
    diagonal = "diagonal"
    both = "both"


def cost(
    lengths: Annotated[
        str | None, typer.Option(help="Context lengths T, e.g. 16,32,64,128,256,512.")
    ] = None,
    task: Annotated[Task, typer.Option(help="Pattern(s) to fit.")] = Task.both,
    accuracy: Annotated[float, typer.Option(help="Min attention on the target key.")] = 0.9,
    dim: Annotated[
        int | None, typer.Option(help=f"Embedding dim, 2..{MAX_DIM} (default: T).")
    ] = None,
    steps: Annotated[int, typer.Option(help=f"Adam steps per norm radius, 10..{MAX_STEPS}.")] = 300,
    shared: Annotated[
        float, typer.Option(help="Weight of a direction all tokens share (0: random tokens).")
    ] = 0.0,
    bisections: Annotated[
        int, typer.Option(help=f"Bisection steps on the norm radius, 1..{MAX_BISECTIONS}.")
    ] = 7,
    seed: SeedOpt = 0,
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder.")] = Path("lab-cost"),
    fmt: FormatOpt = OutputFormat.text,
) -> None:
    """Fit one attention layer to a sink and a diagonal pattern at each T with the smallest norm.

    Example: sinklab cost --lengths 16,32,64,128,256 --task both
    """
    from sinklab.lab.cost import DEFAULT_LENGTHS, TASKS, CostConfig, run_cost
    from sinklab.lab.plots import plot_cost
    from sinklab.meta import attach_meta
    from sinklab.outputs import check_out, write_results

    tasks = TASKS if task is Task.both else (task.value,)
    ts = tuple(parse_int_list(lengths, "--lengths") or DEFAULT_LENGTHS)
    config = CostConfig(
        lengths=ts,
        tasks=tasks,
        accuracy=accuracy,
        dim=dim,
        steps=steps,
        bisections=bisections,
        seed=seed,
        shared=shared,
    )
    out = check_out(out, "cost")
    start = time.perf_counter()
    with progress(fmt is OutputFormat.text) as bars:
        result = run_cost(config, bars.bar("fitting", len(ts) * len(tasks)))
    attach_meta(result, None, None, config, time.perf_counter() - start)
    cos = result.rows[0]["mean_cosine"] if result.rows else 0.0

    def figure(folder: Path) -> list[Path]:
        subtitle = f"shared {shared:g} (mean token cosine {cos:.2f}), accuracy {accuracy:g}"
        plot_cost(result.rows, result.fits, folder / "cost_loglog.png", subtitle=subtitle)
        return [folder / "cost_loglog.png"]

    write_results(out, "cost", {"cost.json": result.to_json()}, figure)
    if fmt is OutputFormat.json:
        emit_json(result.to_json())
        return
    emit(*result.summary_lines(), f"wrote {out}/cost.json, cost_loglog.png")


def register(app: typer.Typer) -> None:
    app.command("cost")(cost)
