"""``sinklab chat``: a multi-turn conversation with a bounded sink cache (StreamingLLM's demo)."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from sinklab.commands.common import (
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    PrependOpt,
    QuantizeOpt,
    SeedOpt,
    TrustOpt,
    load,
    stderr,
)
from sinklab.commands.stream import NSinkOpt, WindowOpt
from sinklab.errors import SinklabError

HELP = "commands: /stats (tokens seen, kept, positions, tok/s), /reset, /quit"


#: Longest line ``chat`` reads (bytes): far more than any message fits in a sink cache, and a
#: stream with no newline (``/dev/zero``) is refused after this much instead of filling memory.
MAX_LINE_BYTES = 1 << 16


def _stdin() -> Any:
    """The binary stdin, or a one-line error when there is none (started with ``<&-``)."""
    stream = sys.stdin
    if stream is None or getattr(stream, "closed", False) or not hasattr(stream, "buffer"):
        raise SinklabError("stdin is closed; run sinklab chat in a terminal or pipe lines into it")
    return stream


def _lines(interactive: bool):
    """User lines: prompted on a terminal, read one per line from a pipe or file, each at most
    :data:`MAX_LINE_BYTES` and UTF-8 text (else a one-line error: the input is not a chat)."""
    buffer = _stdin().buffer
    while True:
        if interactive:
            sys.stderr.write("you> ")
            sys.stderr.flush()
        raw = buffer.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            raise SinklabError(
                f"a line on stdin is longer than {MAX_LINE_BYTES} bytes; send messages of at "
                f"most {MAX_LINE_BYTES // 1024} KiB, one per line"
            )
        if b"\x00" in raw:
            raise SinklabError("stdin holds NUL bytes, not text; pipe UTF-8 text lines into chat")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SinklabError(
                f"a line on stdin is not UTF-8 (bad byte at offset {exc.start}); pipe UTF-8 text"
            ) from None
        yield line.rstrip("\r\n")


def _format_stats(s: dict) -> str:
    rate = "-" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.1f}"
    return (
        f"turns {s['turns']}, tokens seen {s['tokens_seen']}, kept {s['kept']} "
        f"(at most {s['max_kept']}; bound {s['capacity']}), next position {s['next_position']} "
        f"(largest given {s['max_position_given']}, bound {s['position_bound']}), "
        f"last reply {s['last_reply_tokens']} tokens at {rate} tok/s"
    )


def _format_remote(s: dict) -> str:
    return f"turns {s['turns']}, tokens seen {s['tokens_seen']}, kept {s['kept']} (on the server)"


def chat(
    model: ModelOpt = None,
    n_sink: NSinkOpt = 4,
    window: WindowOpt = 508,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", help="Most tokens per reply.")
    ] = 256,
    temperature: Annotated[
        float, typer.Option("--temperature", help="0 = greedy; > 0 samples.")
    ] = 0.0,
    seed: SeedOpt = 0,
    system: Annotated[
        str | None, typer.Option("--system", help="A system message (default: the template's).")
    ] = None,
    trust_remote_code: TrustOpt = False,
    dtype: DtypeOpt = "float32",
    quantize: QuantizeOpt = "none",
    device: DeviceOpt = "cpu",
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            help="Talk to a running 'sinklab serve' at this URL (its model and cache apply).",
        ),
    ] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", help="The key the --server asks for.")
    ] = None,
    prepend: PrependOpt = None,
) -> None:
    """Chat with the model (its chat template) in flat memory: the cache never holds more than
    n_sink + window positions however long the conversation, each turn's text is fitted into it
    before it is read, and positions stay below the model's maximum. Replies stream to stdout.
    Reads stdin line by line when it is not a terminal, so a script can drive it; /stats,
    /reset, /quit.

    Example: printf 'Hi!\\nName three plays by Shakespeare.\\n/stats\\n' | sinklab chat
    """
    from sinklab.stream.chat import ChatConfig, ChatSession

    config = ChatConfig(  # checks first
        n_sink, window, max_new_tokens, temperature, seed, system, prepend=prepend
    )
    interactive = _stdin().isatty()  # no stdin at all: one line before the model loads
    if server is not None:
        from sinklab.serve.client import RemoteChat

        if system is not None:
            raise SinklabError("--system is not sent to a --server; leave it out")
        session = RemoteChat(server, api_key, max_new_tokens, temperature)
        name = f"{session.model} at {server}"
    else:
        loaded = load(model, dtype, device, trust_remote_code, quantize)
        session = ChatSession(loaded.model, loaded.tokenizer, config)
        name = f"{loaded.info.name}, {n_sink} sinks + {window} window"
    if interactive:
        stderr.print(f"sinklab chat: {name}; {HELP}")

    def on_text(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    for line in _lines(interactive):
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command = text.split()[0]
            if command in ("/quit", "/exit"):
                break
            if command == "/stats":
                stats = session.stats()
                remote = server is not None
                print(_format_remote(stats) if remote else _format_stats(stats), flush=True)
            elif command == "/reset":
                session.reset()
                print("(conversation reset)", flush=True)
            else:
                print(f"sinklab: unknown command {command}; {HELP}", file=sys.stderr)
            continue
        try:
            session.turn(text, on_text)
        except SinklabError as exc:  # a bad turn: say so in one line, keep the conversation
            print(f"sinklab: error: {exc}", file=sys.stderr)
        sys.stdout.write("\n")
        sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
