"""``sinklab serve``: StreamingLLM as an OpenAI-compatible service (see sinklab.serve)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sinklab.commands.common import DeviceOpt, DtypeOpt, ModelOpt, QuantizeOpt, TrustOpt, load
from sinklab.commands.stream import NSinkOpt, WindowOpt


def serve(
    model: ModelOpt = None,
    n_sink: NSinkOpt = 4,
    window: WindowOpt = 508,
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on; not loopback needs --api-key.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port (0: any free one).")] = 8000,
    api_key: Annotated[
        list[str] | None,
        typer.Option("--api-key", help="A key clients must send (repeat: one tenant per key)."),
    ] = None,
    sessions: Annotated[
        Path | None,
        typer.Option("--sessions", help="Folder where sessions are saved after each turn."),
    ] = None,
    max_sessions: Annotated[int, typer.Option("--max-sessions", help="Most sessions held.")] = 64,
    max_batch: Annotated[
        int, typer.Option("--max-batch", help="Most sessions decoded in one step.")
    ] = 16,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Most tokens a request may ask for.")
    ] = 2048,
    request_timeout: Annotated[
        float, typer.Option("--request-timeout", help="Seconds a turn may take.")
    ] = 300.0,
    session_ttl: Annotated[
        float,
        typer.Option("--session-ttl", help="Seconds an idle session is kept (memory and disk)."),
    ] = 3600.0,
    prefill_chunk: Annotated[
        int,
        typer.Option(
            "--prefill-chunk",
            help="Most tokens of a turn read per engine step (between the others' tokens).",
        ),
    ] = 128,
    max_sessions_per_key: Annotated[
        int, typer.Option("--max-sessions-per-key", help="Most sessions one key holds.")
    ] = 64,
    max_requests_per_key: Annotated[
        int,
        typer.Option(
            "--max-requests-per-key",
            help="Most requests of one key in flight at once (any route; 429 beyond).",
        ),
    ] = 16,
    max_saved_sessions: Annotated[
        int,
        typer.Option("--max-saved-sessions", help="Most sessions kept on disk out of memory."),
    ] = 256,
    metrics_key: Annotated[
        str | None,
        typer.Option("--metrics-key", help="A key that sees per-key series in /metrics."),
    ] = None,
    header_timeout: Annotated[
        float,
        typer.Option("--header-timeout", help="Seconds a request's headers, then body, may take."),
    ] = 10.0,
    idle_timeout: Annotated[
        float, typer.Option("--idle-timeout", help="Seconds an idle kept-alive connection stays.")
    ] = 5.0,
    max_connections: Annotated[
        int,
        typer.Option("--max-connections-per-client", help="Open connections per client address."),
    ] = 64,
    trust_remote_code: TrustOpt = False,
    dtype: DtypeOpt = "float32",
    quantize: QuantizeOpt = "none",
    device: DeviceOpt = "cpu",
) -> None:
    """Serve the model with OpenAI's chat-completions API, each conversation a session in a
    sink cache of n_sink + window positions however long it runs. Sessions are saved after each
    turn under --sessions (a folder sinklab creates and marks as its own) and continue after a
    restart; an idle session is removed after --session-ttl, and the least recently used idle
    one leaves memory when a new one needs its slot. Binds 127.0.0.1 unless told otherwise
    (another address needs --api-key).

    Example: sinklab serve --window 252 --sessions ~/.sinklab-sessions
    """
    from sinklab.errors import SinklabError
    from sinklab.serve.config import ServeConfig
    from sinklab.serve.runner import bind, log_line, run

    if device == "auto":
        raise SinklabError("sinklab serve runs on one device; pass --device cpu or cuda")
    config = ServeConfig(
        model_id=model or "smollm2-135m",
        n_sink=n_sink,
        window=window,
        host=host,
        port=port,
        api_keys=tuple(api_key or ()),
        sessions_dir=sessions.expanduser() if sessions is not None else None,
        max_sessions=max_sessions,
        max_batch=max_batch,
        max_tokens_limit=max_tokens,
        request_timeout_s=request_timeout,
        session_ttl_s=session_ttl,
        prompt_chunk=prefill_chunk,
        max_sessions_per_key=max_sessions_per_key,
        max_requests_per_key=max_requests_per_key,
        max_saved_sessions=max_saved_sessions,
        metrics_key=metrics_key,
        header_timeout_s=header_timeout,
        idle_timeout_s=idle_timeout,
        max_connections_per_client=max_connections,
    )
    folder = config.sessions_dir
    if folder is not None and folder.exists() and not folder.is_dir():
        raise SinklabError(f"--sessions {str(sessions)!r} is a file; pass a folder")
    if folder is not None:
        from sinklab.serve.sessions import SessionStore

        SessionStore(folder, {}, log_line).claim()  # sinklab's own folder, or refused now
    sock = bind(config)
    try:
        loaded = load(model, dtype, device, trust_remote_code, quantize)
        run(config, sock, loaded, log_line)
    finally:
        sock.close()


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
