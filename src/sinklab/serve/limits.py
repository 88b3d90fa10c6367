"""Per-key limits that hold before a request is read (README, "Serving": keys and limits).

:class:`PerKey` counts the HTTP requests of each API key in flight at once, any route, from the
moment their headers are in until their answer is out (a body being trickled in counts, a stream
being sent counts), and answers 429 beyond ``--max-requests-per-key`` without reading the
request's body. So one key cannot take every connection the server will answer, however it
spreads its requests; the turns of a key are capped again where sessions are taken
(:meth:`~sinklab.serve.registry.Registry.acquire`), since a turn whose client left may still be
finishing. A request without a known key is not counted here: it is answered 401 by the route.
Not counted either: the probes an operator's monitor sends (``/health``, ``/metrics``, ``GET
/v1/models``), so a busy key never makes the server look down, and every request of a server
without keys (one open tenant: its limits are the batch and the queue, ``--max-batch`` and
``--max-queue``, and ``--max-connections-per-client``).
"""

from __future__ import annotations

import hmac
import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from sinklab.serve.config import ServeConfig


def tenant_for(config: ServeConfig, authorization: str) -> str | None:
    """The tenant of an ``Authorization: Bearer KEY`` header, None for no known key ('' when
    the server has no keys: one open tenant)."""
    if not config.api_keys:
        return ""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key:
        return None
    sent = key.strip().encode("utf-8", "replace")
    for known, tenant in config.tenants.items():
        if hmac.compare_digest(known.encode(), sent):
            return tenant
    return None


UNCOUNTED = ("/health", "/metrics")


def _models(scope: dict) -> bool:
    path = scope.get("path", "")
    return scope.get("method") == "GET" and (path == "/v1/models" or path.startswith("/v1/models/"))


class PerKey:
    """A plain ASGI middleware (it must not wrap ``receive``: the routes watch for a client
    gone): at most ``config.max_requests_per_key`` requests of one key in flight."""

    def __init__(self, app: Any, config: ServeConfig) -> None:
        self.app, self.config = app, config
        self.open: Counter[str] = Counter()
        self._lock = threading.Lock()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
        tenant = tenant_for(self.config, header.decode("latin-1"))
        if not tenant or scope.get("path", "") in UNCOUNTED or _models(scope):
            await self.app(scope, receive, send)
            return
        cap = self.config.max_requests_per_key
        with self._lock:
            over = self.open[tenant] >= cap
            if not over:
                self.open[tenant] += 1
        if over:
            await _too_many(send, cap)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            with self._lock:
                self.open[tenant] -= 1
                if self.open[tenant] <= 0:
                    del self.open[tenant]


async def _too_many(send: Callable, cap: int) -> None:
    body = json.dumps(
        {
            "error": {
                "message": f"this key has {cap} requests in flight, its most "
                f"(--max-requests-per-key {cap}); retry shortly",
                "type": "rate_limit_error",
                "param": None,
                "code": "too_many_requests",
            }
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),  # its body is not read: the connection closes after
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": body})
