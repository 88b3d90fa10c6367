"""``sinklab chat``: a multi-turn conversation with a bounded sink cache (StreamingLLM's demo)."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
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


class ChatInterrupt(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during ``sinklab chat``: mid-reply it stops the reply, at the prompt it
    ends the chat. SIGTERM keeps the command line's own handling (exit 130)."""


@contextlib.contextmanager
def _ctrl_c() -> Iterator[None]:
    """SIGINT raises :class:`ChatInterrupt` for the length of the chat (the previous handler is
    put back after it); outside the main thread signals stay as they are."""

    def handler(signum: int, frame: object) -> None:
        raise ChatInterrupt

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _line_editing() -> None:
    """Arrows, history and Ctrl-A/E on the terminal: ``input()`` edits lines through GNU readline
    once it is imported (without it an arrow key prints ``^[[D``). Where Python has no readline
    (some builds), lines are read as typed."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401


def _typed(prompt: str) -> str | None:
    """One line typed on the terminal (None at Ctrl-D). The prompt goes where readline can
    redraw it: stdout when it is the terminal too, else stderr."""
    try:
        if sys.stdout.isatty():
            return input(prompt)
        sys.stderr.write(prompt)
        sys.stderr.flush()
        return input()
    except EOFError:
        return None


def _lines(interactive: bool):
    """User lines: typed on a terminal (with line editing), read one per line from a pipe or
    file, each at most :data:`MAX_LINE_BYTES` and UTF-8 text (else a one-line error: the input
    is not a chat)."""
    buffer = _stdin().buffer
    if interactive:
        _line_editing()
    while True:
        if interactive:
            line = _typed("you> ")
            if line is None:
                return
            if len(line.encode("utf-8", "surrogateescape")) > MAX_LINE_BYTES or "\x00" in line:
                print(
                    f"sinklab: error: a message of at most {MAX_LINE_BYTES // 1024} KiB of text",
                    file=sys.stderr,
                )
                continue
            yield line
            continue
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


def _mark(session: Any) -> Callable[[], None]:
    """What :func:`_turn` needs to take an interrupted reply back: -> a function that puts the
    session as it was before the turn. A local session's cache is saved (its kept positions,
    bounded by n_sink + window) with the sampler's state; where a cache cannot be saved (a
    hybrid sliding-window model) the conversation is read again from its messages at the next
    turn. A --server session is the server's: nothing to take back here."""
    from sinklab.stream.cache import SinkCache
    from sinklab.stream.chat import ChatSession

    if not isinstance(session, ChatSession):
        return lambda: None
    cache, gen = session.cache, session.gen.get_state()
    try:
        state = cache.state() if cache.rows and cache.kept_length() else None
    except SinklabError:
        state = None
    before = (session.read_text, session.reply_at, list(session.pending))

    def rollback() -> None:
        session.gen.set_state(gen)
        if state is not None:
            session.cache = SinkCache.from_state(session.model, [state], cache.max_position)
            session.read_text, session.reply_at, session.pending = before
        else:  # empty before the turn, or not savable: read the conversation again next turn
            session.cache.reset()
            session.read_text, session.reply_at, session.pending = "", None, []

    return rollback


def _turn(session: Any, text: str, on_text: Callable[[str], None]) -> bool:
    """One turn; Ctrl-C mid-reply stops the reply and commits none of it (the conversation
    goes on as if the message was never sent). -> whether the reply was whole."""
    rollback = _mark(session)
    try:
        session.turn(text, on_text)
    except ChatInterrupt:
        rollback()
        sys.stdout.write("\n")
        print("sinklab: (reply interrupted; not kept)", file=sys.stderr, flush=True)
        return False
    return True


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
    """Chat with the model (its chat template) in flat memory.

    The cache never holds more than n_sink + window positions however long the conversation,
    each turn's text is fitted into it before it is read, and positions stay below the model's
    maximum. Replies stream to stdout. Reads stdin line by line when it is not a terminal, so a
    script can drive it; /stats, /reset, /quit.

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

    with _ctrl_c(), contextlib.suppress(ChatInterrupt):  # Ctrl-C at the prompt: the end
        _converse(session, server is not None, interactive, on_text)
    if interactive:
        sys.stdout.write("\n")


def _converse(
    session: Any, remote: bool, interactive: bool, on_text: Callable[[str], None]
) -> None:
    """The conversation: each line a message or a /command, until the input ends or /quit."""
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
                print(_format_remote(stats) if remote else _format_stats(stats), flush=True)
            elif command == "/reset":
                session.reset()
                print("(conversation reset)", flush=True)
            else:
                print(f"sinklab: unknown command {command}; {HELP}", file=sys.stderr)
            continue
        try:
            if not _turn(session, text, on_text):
                continue
        except SinklabError as exc:  # a bad turn: say so in one line, keep the conversation
            print(f"sinklab: error: {exc}", file=sys.stderr)
        sys.stdout.write("\n")
        sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
