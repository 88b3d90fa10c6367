"""``sinklab generate``: stream generated text to stdout with a bounded sink cache."""

from __future__ import annotations

import sys
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
    SeedOpt,
    TrustOpt,
    WindowOpt,
    emit_json,
    load,
    progress,
    stderr,
)
from sinklab.errors import SinklabError


def generate(
    prompt: Annotated[str | None, typer.Option("--prompt", help="Prompt text.")] = None,
    prompt_file: Annotated[
        Path | None, typer.Option("--prompt-file", help="Read the prompt from a UTF-8 file.")
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", help="Tokens to generate (memory stays flat).")
    ] = 200,
    n_sink: NSinkOpt = 4,
    window: WindowOpt = 508,
    temperature: Annotated[
        float, typer.Option("--temperature", help="0 = greedy; > 0 samples.")
    ] = 0.0,
    seed: SeedOpt = 0,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Keep generating past end-of-sequence.")
    ] = False,
    model: ModelOpt = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Also write OUT/generate.json.")
    ] = None,
    trust_remote_code: TrustOpt = False,
    dtype: DtypeOpt = "float32",
    quantize: QuantizeOpt = "none",
    device: DeviceOpt = "cpu",
    prepend: PrependOpt = None,
    fmt: FormatOpt = OutputFormat.text,
) -> None:
    """Generate with a StreamingLLM sink cache: the cache never holds more than n_sink + window
    positions, so --max-new-tokens 20000 runs in flat memory. Text goes to stdout, progress and
    a summary to stderr; --format json prints the result (its text included) as JSON instead.

    Example: sinklab generate --prompt "ROMEO:" --max-new-tokens 20000 --ignore-eos
    """
    from sinklab.corpus import encode, first_token, read_text_file
    from sinklab.meta import attach_meta
    from sinklab.outputs import check_out, write_results
    from sinklab.stream.generation import GenerateConfig
    from sinklab.stream.generation import generate as run

    # cheap checks first: sizes and the prompt fail before the model loads
    config = GenerateConfig(
        max_new_tokens, n_sink, window, temperature, seed, stop_at_eos=not ignore_eos
    )
    if (prompt is None) == (prompt_file is None):
        raise SinklabError("pass exactly one of --prompt TEXT or --prompt-file FILE")
    text = read_text_file(prompt_file) if prompt_file is not None else prompt
    if not text or not text.strip():
        raise SinklabError("the prompt is empty; pass some text to continue")
    if out is not None:
        out = check_out(out, "generate")
    loaded = load(model, dtype, device, trust_remote_code, quantize)
    import torch

    first = first_token(loaded.tokenizer, prepend)
    ids = torch.tensor(encode(text, loaded.tokenizer, first))

    as_json = fmt is OutputFormat.json

    def on_text(piece: str) -> None:
        if not as_json:  # json: the text comes in the result
            sys.stdout.write(piece)
            sys.stdout.flush()

    # the text is its own progress on a terminal; a bar on stderr when stdout goes to a file
    with progress(enabled=not as_json and not sys.stdout.isatty()) as bars:
        tick = bars.bar("generating", max_new_tokens, unit="tok")
        result = run(loaded.model, loaded.tokenizer, ids, config, on_text, tick)
    if not as_json:
        sys.stdout.write("\n")
    if out is not None or as_json:
        record = first.record(loaded.tokenizer, ids)
        attach_meta(result, loaded.info, None, config, result.seconds, record)
    if out is not None:
        write_results(out, "generate", {"generate.json": result.to_json()})
    if as_json:
        emit_json(result.to_json())
        return
    stderr.print(
        f"{len(result.new_tokens)} tokens, {result.tokens_per_s:.1f} tok/s, cache at most "
        f"{result.max_cache_len} positions, peak RSS {result.peak_rss_mb:.0f} MB"
        + (f"; wrote {out / 'generate.json'}" if out is not None else "")
    )


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
