"""``sinklab ablate``: run one causal experiment, write ``DIR/ablate.json`` and its figure."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from sinklab.commands.common import (
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    ModelOpt,
    OutDirOpt,
    OutputFormat,
    PrependOpt,
    SeedOpt,
    TextOpt,
    TrustOpt,
    check_positions,
    emit,
    emit_json,
    given,
    load,
    parse_float_list,
    parse_int_list,
    progress,
    split_list,
)
from sinklab.errors import SinklabError


def _refuse_inapplicable(ctx: typer.Context, experiment: str) -> None:
    """An option that only other experiments read (their records' ``options``) is refused."""
    from sinklab.ablate.registry import RECORDS

    readers: dict[str, list[str]] = {}
    for record in RECORDS:
        for option in record.options:
            readers.setdefault(option, []).append(record.name)
    for name, experiments in readers.items():
        if given(ctx, name) and experiment not in experiments:
            raise SinklabError(
                f"--{name} has no effect on -e {experiment} (only on "
                f"{' / '.join(experiments)}); drop it"
            )


def _ints(value: str | None, name: str) -> tuple[int, ...] | None:
    """'0,2' or a range '4-8' (inclusive) or both: '0,4-8'."""
    if value is not None and any(p.strip().startswith("-") for p in value.split(",")):
        raise SinklabError(
            f"{name} {value!r} has a negative number; positions and indices count from 0, "
            "e.g. 0,1 or a range 4-8"
        )
    if value is not None and "-" in value:
        out: list[int] = []
        for part in split_list(value, name, "0,4-8"):
            lo, sep, hi = part.partition("-")
            if not sep:
                out += parse_int_list(part, name) or []
                continue
            a, b = parse_int_list(lo, name), parse_int_list(hi, name)
            if not a or not b or a[0] > b[0]:
                raise SinklabError(f"{name}: range {part!r} must be A-B with A <= B, e.g. 4-8")
            out += range(a[0], b[0] + 1)
        return tuple(out)
    parsed = parse_int_list(value, name)
    return None if parsed is None else tuple(parsed)


def _experiment_help() -> str:
    from sinklab.ablate.registry import RECORDS

    return "; ".join(f"{r.name}: {r.help}" for r in RECORDS)


def ablate(
    ctx: typer.Context,
    experiment: Annotated[
        str,
        typer.Option(
            "--experiment",
            "-e",
            help=_experiment_help(),
        ),
    ],
    model: ModelOpt = None,
    text: TextOpt = None,
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Input length T.")] = 256,
    out: OutDirOpt = Path("sinklab-ablate"),
    fmt: FormatOpt = OutputFormat.text,
    positions: Annotated[
        str, typer.Option(help="Sink key positions to mask, e.g. 0 or 0,1.")
    ] = "0",
    layers: Annotated[
        str | None,
        typer.Option(
            help="Layers to intervene on, e.g. 0,2 or 10-19 (default all; density: the middle "
            "third)."
        ),
    ] = None,
    heads: Annotated[str | None, typer.Option(help="Heads to intervene on (default all).")] = None,
    protocol: Annotated[
        str,
        typer.Option(
            help="density: mix (model + uniform), temperature (softmax(s / tau)) or replace "
            "(identity/uniform; confounded, see docs/experiments.md)."
        ),
    ] = "mix",
    lams: Annotated[
        str | None, typer.Option(help="density mix / replace: lam values in [0, 1].")
    ] = None,
    temperatures: Annotated[
        str | None, typer.Option(help="density temperature: tau values > 0, e.g. 0.5,1,2.")
    ] = None,
    grid: Annotated[int, typer.Option(help="sensitivity: grid x grid positions, 2..256.")] = 16,
    probes: Annotated[
        int,
        typer.Option(help="sensitivity: Hutchinson probes per query, 0..256; 0 = exact (slow)."),
    ] = 8,
    texts: Annotated[
        int, typer.Option(help="geometry, density, sensitivity: number of texts, 1..64.")
    ] = 4,
    q0: Annotated[int, typer.Option(help="First query counted in sink mass.")] = 0,
    eps: Annotated[
        str | None,
        typer.Option(help="Sink-head thresholds in (0, 1), e.g. 0.3,0.8 (the first decides)."),
    ] = None,
    seed: SeedOpt = 0,
    trust_remote_code: TrustOpt = False,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    prepend: PrependOpt = None,
) -> None:
    """Test a paper's causal claim on a model: numbers in DIR/ablate.json, a figure beside it
    (the experiments and their rules: docs/experiments.md).

    Examples:

      sinklab ablate -e first-token --tokens 256
      sinklab ablate -e density --lams 0,0.5,1 --out runs/density
      sinklab ablate -e density --protocol temperature --temperatures 0.5,1,2 --layers 10-19
    """
    from rich.markup import escape

    from sinklab.ablate import AblationConfig, check_experiment
    from sinklab.ablate.run import AblationRun
    from sinklab.corpus import first_token, load_text
    from sinklab.meta import attach_meta
    from sinklab.models.arch import model_shape
    from sinklab.outputs import check_out, write_results

    # parse: nothing loads before the arguments are known to be sane
    check_experiment(experiment)
    _refuse_inapplicable(ctx, experiment)
    kw: dict = {"lams": parse_float_list(lams, "--lams", "0,0.5,1")} if lams is not None else {}
    if eps is not None:
        kw["eps"] = parse_float_list(eps, "--eps", "0.3,0.8")
    if temperatures is not None:
        kw["temperatures"] = parse_float_list(temperatures, "--temperatures", "0.5,1,2")
    config = AblationConfig(
        q0=q0,
        positions=_ints(positions, "--positions") or (0,),
        layers=_ints(layers, "--layers"),
        heads=_ints(heads, "--heads"),
        grid=grid,
        probes=probes,
        protocol=protocol,
        seed=seed,
        **kw,
    )
    run = AblationRun(experiment, config, tokens, texts)
    out = check_out(out, "ablate")
    txt = load_text(text)
    loaded = load(model, dtype, device, trust_remote_code)
    config.check_model(*model_shape(loaded.model))  # layer / head ranges, before any work
    check_positions(loaded.info, tokens, "--tokens")
    first = first_token(loaded.tokenizer, prepend)
    ids = run.ids(text, txt, loaded.tokenizer, first)  # (B, T)
    # run
    start = time.perf_counter()
    with progress(fmt is OutputFormat.text) as bars:
        result = run.run(loaded.model, loaded.tokenizer, ids, bars.bar(experiment))
    seconds = time.perf_counter() - start
    record = first.record(loaded.tokenizer, ids)
    data = attach_meta(result, loaded.info, txt, result.params(), seconds, record).to_json()

    # write: the figure, its numbers as {experiment}.json beside it
    def figure(folder: Path) -> list[Path]:
        result.figure(folder / f"{experiment}.png")
        return [folder / f"{experiment}.png"]

    path, figure_path = write_results(out, "ablate", {"ablate.json": data}, figure)
    # print
    if fmt is OutputFormat.json:
        emit_json(data)
        return
    emit(f"[bold]{experiment}[/bold]: {escape(result.finding)}", markup=True)
    emit(f"wrote {path} and {figure_path}")


def register(app: typer.Typer) -> None:
    app.command("ablate")(ablate)
