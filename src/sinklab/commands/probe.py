"""``sinklab probe``: every layer's and head's sink metrics, ``DIR/probe.json`` and figures."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from sinklab.commands.common import (
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    ModelOpt,
    OutDirOpt,
    OutputFormat,
    PrependOpt,
    TextOpt,
    TrustOpt,
    check_positions,
    emit,
    emit_json,
    load,
    parse_float_list,
    parse_int_list,
    progress,
)
from sinklab.probe.protocols import OWN
from sinklab.probe.spec import DEFAULT_EPS

DEFAULT_TOKENS = 1024


def probe(
    model: ModelOpt = None,
    text: TextOpt = None,
    tokens: Annotated[
        int | None,
        typer.Option(
            "--tokens",
            "-n",
            help="Tokens to probe (a protocol's: tokens per sample).",
            show_default=f"{DEFAULT_TOKENS}; gu, barbero: 64",
        ),
    ] = None,
    protocol: Annotated[
        str,
        typer.Option(
            "--protocol",
            help="q0: sinklab's own probe; gu (Gu et al. 2025, eps 0.3) or barbero (eps 0.8): "
            "the published sink rate over --samples windows (docs/metrics.md#protocols).",
        ),
    ] = "q0",
    samples: Annotated[
        int, typer.Option("--samples", help="gu, barbero: windows of the text, one sample each.")
    ] = 100,
    lengths: Annotated[
        str | None,
        typer.Option("--lengths", help="Also probe these prefix lengths, e.g. 128,512,2048."),
    ] = None,
    q0: Annotated[int, typer.Option("--q0", help="First query counted in the means.")] = 0,
    eps: Annotated[
        str | None,
        typer.Option("--eps", help="Sink-head thresholds in (0, 1).", show_default="0.3,0.8"),
    ] = None,
    metrics: Annotated[
        str,
        typer.Option(
            "--metrics",
            help="all: every metric; fast: only those a few columns of weights give (no "
            "entropy, received attention or sink positions), about the cost of a forward.",
        ),
    ] = "all",
    prepend: PrependOpt = None,
    out: OutDirOpt = Path("sinklab-probe"),
    fmt: FormatOpt = OutputFormat.text,
    no_figures: Annotated[bool, typer.Option("--no-figures", help="Write JSON only.")] = False,
    trust_remote_code: TrustOpt = False,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
) -> None:
    """Measure the sink metrics of every layer and head in one forward.

    Sink mass, diagonal / previous-token mass, entropy, value norms and hidden-state similarity:
    each layer's few weights come from the fused kernel's log-sum-exp (no T x T block; memory
    linear in T, up to the model's positions). Writes OUT/probe.json and figures.

    Example: sinklab probe --tokens 1024 --q0 16 --lengths 128,512,2048 --out runs/probe
    """
    from sinklab.corpus import first_token, load_text, token_stream
    from sinklab.outputs import check_out
    from sinklab.probe import ProbeConfig
    from sinklab.probe.plots import probe_figures
    from sinklab.probe.run import ProbeRun
    from sinklab.probe.summary import summary_sentences
    from sinklab.seam import check_supported

    if protocol != OWN:
        _probe_protocol(
            model, text, protocol, samples, tokens, (q0, eps, lengths), prepend, out, fmt,
            no_figures, (dtype, device, trust_remote_code),
        )  # fmt: skip
        return
    tokens = DEFAULT_TOKENS if tokens is None else tokens
    # cheap checks first, before the model loads
    eps_list = parse_float_list(eps or ",".join(map(str, DEFAULT_EPS)), "--eps", "0.3,0.8") or ()
    ns = parse_int_list(lengths, "--lengths")
    config = ProbeConfig(q0=q0, eps=eps_list, metrics=metrics)
    run = ProbeRun(config, tokens, tuple(ns) if ns else None, prepend)
    out = check_out(out, "probe")
    txt = load_text(text)
    loaded = load(model, dtype, device, trust_remote_code)
    check_positions(loaded.info, run.need, run.need_option)
    first = first_token(loaded.tokenizer, prepend)
    ids = token_stream(txt, loaded.tokenizer, run.need, first)
    check_supported(loaded.model)  # before the progress bar: a clean one-line error
    start = time.perf_counter()
    with progress(enabled=fmt is OutputFormat.text) as bars:
        _, data = run.run(loaded.model, ids, bars.bar("probe"))
    seconds, record = time.perf_counter() - start, first.record(loaded.tokenizer, ids)
    provenance = (loaded.info, txt, run.params(), seconds, record)
    _finish(data, provenance, out, fmt, None if no_figures else probe_figures, summary_sentences)


def _probe_protocol(
    model: str | None,
    text: str | None,
    name: str,
    samples: int,
    tokens: int | None,
    own_options: tuple[int, str | None, str | None],
    prepend: str | None,
    out: Path,
    fmt: OutputFormat,
    no_figures: bool,
    loading: tuple[str, str, bool],
) -> None:
    """``--protocol gu|barbero``: the published sink rate over ``samples`` windows of the text,
    each started the way the model's tokenizer starts a sequence (``--prepend`` overrides it)."""
    from sinklab.corpus import first_token, load_text
    from sinklab.errors import SinklabError
    from sinklab.outputs import check_out
    from sinklab.probe.plots import protocol_figures
    from sinklab.probe.protocols import (
        get_protocol,
        protocol_sentences,
        run_protocol,
        sample_windows,
    )

    p = get_protocol(name)
    q0, eps, lengths = own_options
    for given, option in ((q0 != 0, "--q0"), (eps is not None, "--eps"), (lengths, "--lengths")):
        if given:
            raise SinklabError(
                f"{option} belongs to sinklab's own probe; --protocol {name} fixes its own "
                f"(all queries, eps {p.eps}); drop {option} or use --protocol {OWN}"
            )
    tokens = p.tokens if tokens is None else tokens
    if tokens < 2 or samples < 1:
        raise SinklabError(f"--tokens must be >= 2 and --samples >= 1, got {tokens}, {samples}")
    out = check_out(out, "probe")
    txt = load_text(text)
    loaded = load(model, *loading)
    check_positions(loaded.info, tokens, "--tokens")
    first_spec = first_token(loaded.tokenizer, prepend)
    ids = sample_windows(txt, loaded.tokenizer, tokens, samples, prepend)
    start = time.perf_counter()
    with progress(enabled=fmt is OutputFormat.text) as bars:
        result = run_protocol(loaded.model, ids, p, progress=bars.bar(f"protocol {name}"))
    data = result.to_json()
    params = {"protocol": name, "samples": samples, "tokens": tokens, "prepend": prepend}
    first = first_spec.record(loaded.tokenizer, ids)
    data["first_token"] = {"id": first["id"], "text": first["text"]}
    provenance = (loaded.info, txt, params, time.perf_counter() - start, first)
    figures = None if no_figures else protocol_figures
    _finish(data, provenance, out, fmt, figures, protocol_sentences)


def _finish(
    data: dict[str, Any],
    provenance: tuple[Any, ...],
    out: Path,
    fmt: OutputFormat,
    figures: Callable[[dict[str, Any], Path], Any] | None,
    sentences: Callable[[dict[str, Any]], list[str]],
) -> None:
    """Either probe's tail: the provenance block (``attach_meta``'s model, text, params,
    seconds, first token), ``probe.json`` and the figures, then the JSON or the sentences."""
    from sinklab.meta import attach_meta
    from sinklab.outputs import write_results

    attach_meta(data, *provenance)
    written = write_results(
        out,
        "probe",
        {"probe.json": data},
        None if figures is None else lambda folder: figures(data, folder),
    )
    if fmt is OutputFormat.json:
        emit_json(data)
        return
    emit(*sentences(data), "wrote " + ", ".join(map(str, written)))


def register(app: typer.Typer) -> None:
    app.command("probe")(probe)
