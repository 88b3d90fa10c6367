"""Start a server: take the address first (a port in use fails before the model loads), then
the sessions on disk, then uvicorn on that socket with the engine thread beside it."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from typing import Any

from sinklab.errors import SinklabError
from sinklab.serve.config import ServeConfig


def log_line(message: str) -> None:
    """The server's log: one line per event on stderr."""
    print(f"sinklab serve: {message}", file=sys.stderr, flush=True)


def bind(config: ServeConfig) -> socket.socket:
    """A listening socket on ``config.host:config.port`` (port 0: any free one)."""
    try:
        infos = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as err:
        raise SinklabError(
            f"cannot listen on {config.host}:{config.port} ({err.strerror or err}); pass another "
            "--port (0: any free one) or --host"
        ) from None
    sock.set_inheritable(True)
    return sock


def run(config: ServeConfig, sock: socket.socket, loaded: Any, log: Callable[[str], None]) -> None:
    """Serve until SIGINT/SIGTERM."""
    import uvicorn

    from sinklab.serve.app import build_app
    from sinklab.serve.conn import MAX_HEADER_BYTES, GuardedH11, guard
    from sinklab.serve.engine import Engine
    from sinklab.serve.metrics import Metrics
    from sinklab.serve.sessions import SessionStore

    store = None
    if config.sessions_dir is not None:
        identity = {"model": config.model_id, "n_sink": config.n_sink, "window": config.window}
        store = SessionStore(config.sessions_dir, identity, log)
    metrics = Metrics()
    engine = Engine(loaded.model, loaded.tokenizer, config, store, metrics, log)
    n = engine.load()
    if store is not None:
        log(f"{n} sessions restored from {config.sessions_dir}")
    engine.start()
    app = guard(build_app(engine, config, metrics, log), log)
    GuardedH11.header_timeout_s = config.header_timeout_s
    GuardedH11.max_per_client = config.max_connections_per_client
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    uv = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
        limit_concurrency=1024,
        http=GuardedH11,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_keep_alive=config.idle_timeout_s,
    )
    keys = f"{len(config.api_keys)} API keys" if config.api_keys else "no API key (loopback only)"
    log(f"listening on http://{shown}:{port}/v1 ({config.model_id}, {keys})")
    try:
        uvicorn.Server(uv).run(sockets=[sock])
    finally:
        engine.stop()
