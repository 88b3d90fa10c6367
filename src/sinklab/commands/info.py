"""``sinklab info``: the model's architecture facts and the text's size in tokens."""

from __future__ import annotations

import typer

from sinklab.commands.common import (
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    ModelOpt,
    OutputFormat,
    TextOpt,
    TrustOpt,
    emit_json,
    load,
    plain_table,
    stderr,
    stdout,
)
from sinklab.corpus import count_tokens, load_text


def info(
    model: ModelOpt = None,
    text: TextOpt = None,
    fmt: FormatOpt = OutputFormat.text,
    trust_remote_code: TrustOpt = False,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
) -> None:
    """Show the model's architecture facts and the text's size in tokens.

    Example: sinklab info --model ./my-llama --text notes.txt --format json
    """
    txt = load_text(text)  # cheap checks first: a bad path fails before the model loads
    loaded = load(model, dtype, device, trust_remote_code)
    with stderr.status("counting tokens"):
        n_tokens = count_tokens(txt, loaded.tokenizer)
    data = {"model": loaded.info.to_json(), "text": {**txt.to_json(), "tokens": n_tokens}}
    if fmt is OutputFormat.json:
        emit_json(data)
        return
    table = plain_table(f"sinklab info: {loaded.info.name}", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # a long path or hash folds over lines, never cut
    for key, value in data["model"].items():
        table.add_row(key, str(value))
    for key, value in data["text"].items():
        table.add_row(f"text.{key}", str(value))
    stdout.print(table)  # a width's worth: a path folds rather than widening the table


def register(app: typer.Typer) -> None:
    app.command("info")(info)
