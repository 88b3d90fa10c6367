"""``sinklab stream``: streaming perplexity per cache policy, its JSON and two figures."""

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
    NSinkOpt,
    OutputFormat,
    PrependOpt,
    QuantizeOpt,
    TextOpt,
    TrustOpt,
    WindowOpt,
    check_positions,
    emit,
    emit_json,
    load,
    progress,
    split_list,
)
from sinklab.errors import SinklabError
from sinklab.stream.evaluate import POLICIES

PolicyOpt = Annotated[
    str,
    typer.Option(
        "--policy",
        "-p",
        help=f"One of {', '.join(POLICIES)}, a comma-separated list, or 'all'.",
    ),
]


def parse_policies(value: str) -> tuple[str, ...]:
    """'all' | 'sink' | 'window,sink' -> the policies, validated."""
    names = (
        list(POLICIES) if value.strip() == "all" else split_list(value, "--policy", "sink,window")
    )
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise SinklabError(
            f"unknown policy {', '.join(bad) or repr(value)}; choose from "
            f"{', '.join(POLICIES)} or 'all'"
        )
    return tuple(dict.fromkeys(names))


def stream(
    model: ModelOpt = None,
    text: TextOpt = None,
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Tokens to stream.")] = 2000,
    policy: PolicyOpt = "all",
    n_sink: NSinkOpt = 4,
    window: WindowOpt = 508,
    recompute_every: Annotated[
        int,
        typer.Option(
            "--recompute-every",
            help="Score the (slow) recompute oracle on every K-th target only.",
        ),
    ] = 20,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Folder for stream.json + figure.")
    ] = Path("sinklab-stream"),
    trust_remote_code: TrustOpt = False,
    dtype: DtypeOpt = "float32",
    quantize: QuantizeOpt = "none",
    device: DeviceOpt = "cpu",
    method: Annotated[
        str,
        typer.Option(
            "--method",
            help="auto: chunked where it serves the model, else step; chunked: many tokens per "
            "forward, same NLLs as step (hybrid sliding-window models too; refuses models outside "
            "transformers' AttentionInterface); step: "
            "one token per forward (the reference, ~20x slower).",
        ),
    ] = "auto",
    segment: Annotated[
        int | None,
        typer.Option(
            "--segment",
            help="Targets per entry of segment_ppl and per point of block_ppl.png "
            "(default: about 40 blocks, at least 50 tokens).",
        ),
    ] = None,
    prepend: PrependOpt = None,
    fmt: FormatOpt = OutputFormat.text,
) -> None:
    """Streaming perplexity, StreamingLLM's protocol: read one token, score the next, evict.

    Writes OUT/stream.json (meta; the method run and why; per policy ppl, segment_ppl, nll,
    tokens_per_s, peak_rss_mb, max_cache_len; where dense collapses), OUT/running_ppl.png and
    OUT/block_ppl.png (+ .json). ``--method step`` (one token per forward, ~65 ms per token per
    policy on SmolLM2 with 2 cores) and ``chunked`` give the same NLLs; the default ``auto`` runs
    chunked where it serves the model (hybrid sliding-window models too), else step (Falcon,
    BLOOM, MPT: attention outside transformers' AttentionInterface).

    Example: sinklab stream --policy window,sink --tokens 4000 --n-sink 4 --window 508
    """

    from sinklab.corpus import first_token, load_text, token_stream
    from sinklab.meta import attach_meta
    from sinklab.outputs import check_out, write_results
    from sinklab.stream.evaluate import StreamConfig
    from sinklab.stream.run import StreamRun
    from sinklab.stream.summary import block_size, collapse_sentence, method_line, policy_lines

    # parse: sizes, policies and the text fail before the model loads
    run = StreamRun(
        StreamConfig(
            parse_policies(policy),
            n_sink,
            window,
            tokens,
            recompute_every,
            segment=block_size(tokens) if segment is None else segment,
            method=method,
        )
    )
    config = run.config
    out = check_out(out, "stream")
    txt = load_text(text)
    loaded = load(model, dtype, device, trust_remote_code, quantize)
    if "dense" in config.policies:
        check_positions(loaded.info, tokens, "--tokens", " (the dense policy keeps them all)")
    chosen, _ = config.check_model(loaded.model)  # refusals here, before any work
    first = first_token(loaded.tokenizer, prepend)
    ids = token_stream(txt, loaded.tokenizer, tokens, first)
    # run: one bar per policy, its rate in scored targets a second (the oracle: every K-th)
    start = time.perf_counter()
    with progress(fmt is OutputFormat.text) as bars:
        each = {
            p: bars.bar(f"{p} ({chosen})", tokens - 1, unit="tok", scale=1 / config.scored_every(p))
            for p in config.policies
        }
        result = run.run(loaded.model, ids, each=each)
    seconds, record = time.perf_counter() - start, first.record(loaded.tokenizer, ids)
    data = attach_meta(result, loaded.info, txt, run.params(), seconds, record)
    data = data.to_json()
    # write, then print
    written = write_results(
        out, "stream", {"stream.json": data}, lambda folder: run.write_figures(data, folder)
    )
    if fmt is OutputFormat.json:
        emit_json(data)
        return
    emit(method_line(data), *policy_lines(data), collapse_sentence(data))
    emit("wrote " + " and ".join(map(str, written)))


def register(app: typer.Typer) -> None:
    app.command("stream")(stream)
