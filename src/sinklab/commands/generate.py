"""``sinklab generate``: stream generated text to stdout with a bounded sink cache."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

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


def prompt_ids(
    tokenizer: Any, text: str, prepend: str | None, raw: bool
) -> tuple[Any, list[int], bool]:
    """The prompt's first token (a :class:`~sinklab.corpus.FirstToken`), its ids, and whether
    they went through the chat template.

    An instruct model (a tokenizer with a chat template) reads the prompt as a user message with
    the template's generation prompt, as ``sinklab chat`` reads a turn: continued as plain text
    it sees a conversation that never started (SmolLM2-Instruct answers "ROMEO:" with "A: The
    answer is:" over and over). ``raw``, or a base model (no template): the text as it is,
    after the first token of ``--prepend``. The template writes the model's own first token, so
    ``--prepend`` there puts a token before it and cannot remove it."""
    from sinklab.corpus import DEFAULT_PREPEND, FirstToken, encode, first_token

    if raw or not getattr(tokenizer, "chat_template", None):
        first = first_token(tokenizer, prepend)
        return first, encode(text, tokenizer, first), False
    if prepend is not None and prepend.lower() == "none":
        raise SinklabError(
            "the chat template writes the model's own first token and --prepend none cannot "
            "remove it; pass --raw to continue the text as it is, or omit --prepend"
        )
    first = (
        first_token(tokenizer, prepend)
        if prepend not in (None, "", DEFAULT_PREPEND)
        else FirstToken(DEFAULT_PREPEND, (), tokenizer_default=True)
    )
    message = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    return first, encode(rendered, tokenizer, first), True


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
    raw: Annotated[
        bool,
        typer.Option(
            "--raw",
            help="Continue the prompt as plain text. Without it an instruct model (one with a "
            "chat template) reads the prompt as a user message and replies; a base model always "
            "continues the text.",
        ),
    ] = False,
) -> None:
    """Generate text with a StreamingLLM sink cache, in flat memory.

    The cache never holds more than n_sink + window positions, so --max-new-tokens 20000 runs
    in flat memory. An instruct model reads the prompt through its chat template (a reply);
    --raw, or a base model, continues the text as it is. Text goes to stdout, progress and a
    summary to stderr; --format json prints the result (its text included) as JSON instead.

    Examples:

      sinklab generate --prompt "Name three plays by Shakespeare."
      sinklab generate --raw --prompt "ROMEO:" --max-new-tokens 20000 --ignore-eos
    """
    from sinklab.corpus import read_text_file
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

    first, prompt_tokens, templated = prompt_ids(loaded.tokenizer, text, prepend, raw)
    ids = torch.tensor(prompt_tokens)

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
    data = {**result.to_json(), "chat_template": templated}
    if out is not None:
        write_results(out, "generate", {"generate.json": data})
    if as_json:
        emit_json(data)
        return
    how = "a reply through the chat template (--raw: plain text)" if templated else "plain text"
    stderr.print(
        f"{how}; {len(result.new_tokens)} tokens, {result.tokens_per_s:.1f} tok/s, cache at most "
        f"{result.max_cache_len} positions, peak RSS {result.peak_rss_mb:.0f} MB"
        + (f"; wrote {out / 'generate.json'}" if out is not None else "")
    )


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
