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
    trust_remote_code: TrustOpt = False,
    dtype: DtypeOpt = "float32",
    quantize: QuantizeOpt = "none",
    device: DeviceOpt = "cpu",
) -> None:
    """Serve the model with OpenAI's chat-completions API, each conversation a session in a
    sink cache of n_sink + window positions however long it runs. Sessions are saved after each
    turn under --sessions and continue after a restart. Binds 127.0.0.1 unless told otherwise
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
    )
    folder = config.sessions_dir
    if folder is not None and folder.exists() and not folder.is_dir():
        raise SinklabError(f"--sessions {str(sessions)!r} is a file; pass a folder")
    sock = bind(config)
    try:
        loaded = load(model, dtype, device, trust_remote_code, quantize)
        run(config, sock, loaded, log_line)
    finally:
        sock.close()


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
