"""``sinklab probe``: every layer's and head's sink metrics, ``DIR/probe.json`` and figures."""

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
    TextOpt,
    TrustOpt,
    check_positions,
    emit_json,
    load,
    parse_float_list,
    parse_int_list,
    progress,
)
from sinklab.probe.spec import DEFAULT_EPS

DEFAULT_TOKENS = 1024


def probe(
    model: ModelOpt = None,
    text: TextOpt = None,
    tokens: Annotated[
        int, typer.Option("--tokens", "-n", help="Tokens to probe.")
    ] = DEFAULT_TOKENS,
    lengths: Annotated[
        str | None,
        typer.Option("--lengths", help="Also probe these prefix lengths, e.g. 128,512,2048."),
    ] = None,
    q0: Annotated[int, typer.Option("--q0", help="First query counted in the means.")] = 0,
    eps: Annotated[str, typer.Option("--eps", help="Sink-head thresholds in (0, 1).")] = ",".join(
        map(str, DEFAULT_EPS)
    ),
    metrics: Annotated[
        str,
        typer.Option(
            "--metrics",
            help="all: every metric; fast: only those a few columns of weights give (no "
            "entropy, received attention or sink positions), about the cost of a forward.",
        ),
    ] = "all",
    prepend: Annotated[
        str | None,
        typer.Option("--prepend", help="Put this token first: 'bos', 'eos', an id or one token."),
    ] = None,
    out: OutDirOpt = Path("sinklab-probe"),
    fmt: FormatOpt = OutputFormat.text,
    no_figures: Annotated[bool, typer.Option("--no-figures", help="Write JSON only.")] = False,
    trust_remote_code: TrustOpt = False,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
) -> None:
    """Measure sink mass, diagonal / previous-token mass, entropy, value norms and hidden-state
    similarity for every layer and head, in one forward: each layer's few weights come from the
    fused kernel's log-sum-exp (no T x T block; memory linear in T, up to the model's positions).

    Example: sinklab probe --tokens 1024 --q0 16 --lengths 128,512,2048 --out runs/probe
    """
    from sinklab.corpus import load_text, token_stream
    from sinklab.meta import attach_meta
    from sinklab.outputs import check_out, write_results
    from sinklab.probe import ProbeConfig
    from sinklab.probe.plots import probe_figures
    from sinklab.probe.run import ProbeRun
    from sinklab.probe.summary import summary_sentences
    from sinklab.seam import check_supported

    # cheap checks first, before the model loads
    eps_list = parse_float_list(eps, "--eps", "0.3,0.8") or ()
    ns = parse_int_list(lengths, "--lengths")
    config = ProbeConfig(q0=q0, eps=eps_list, metrics=metrics)
    run = ProbeRun(config, tokens, tuple(ns) if ns else None, prepend)
    out = check_out(out, "probe")
    txt = load_text(text)
    loaded = load(model, dtype, device, trust_remote_code)
    check_positions(loaded.info, run.need, run.need_option)
    ids = token_stream(txt, loaded.tokenizer, run.need, prepend=prepend)
    check_supported(loaded.model)  # before the progress bar: a clean one-line error
    start = time.perf_counter()
    with progress(enabled=fmt is OutputFormat.text) as bars:
        _, data = run.run(loaded.model, ids, bars.callback("probe"))
    attach_meta(data, loaded.info, txt, run.params(), time.perf_counter() - start)
    written = write_results(
        out,
        "probe",
        {"probe.json": data},
        None if no_figures else lambda folder: probe_figures(data, folder),
    )
    if fmt is OutputFormat.json:
        emit_json(data)
        return
    for line in summary_sentences(data):
        typer.echo(line)
    typer.echo("wrote " + ", ".join(map(str, written)))


def register(app: typer.Typer) -> None:
    app.command("probe")(probe)
