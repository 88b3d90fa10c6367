"""The connection side of ``sinklab serve``: what no client can do to the others (README,
"Serving": limits).

:class:`GuardedH11` is uvicorn's h11 protocol with: a deadline for a request's headers
(``header_timeout_s``: a client that trickles them is answered 408 and closed), a cap on open
connections per client address (503 beyond it), JSON answers where uvicorn answers plain text
(431 for headers over the limit, 400 for a broken request), and a *lingering close*: a connection
closed while the client is still sending (a 413 for a body over the limit) first drains what
comes in for a moment, so the client reads the answer instead of a connection reset.
:func:`guard` wraps the ASGI app so that a client gone mid-request, or a failure already answered
with a 500, is one log line, never uvicorn's traceback.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_S = 2.0  # how long a closing connection drains what the client still sends
MAX_HEADER_BYTES = 16 * 1024


def _answer(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None,
                   "code": code}}
    ).encode()  # fmt: skip
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Lingering:
    """A transport whose ``close()`` ends the writing side, drains for :data:`LINGER_S` (or until
    the client closes), then closes: closing with unread data would reset the connection."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._t, self._loop, self.lingering = transport, loop, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)

    def close(self) -> None:
        if self.lingering or self._t.is_closing():
            return
        self.lingering = True
        try:
            if self._t.can_write_eof():
                self._t.write_eof()
            self._t.resume_reading()
        except (OSError, RuntimeError):
            self._t.close()
            return
        self._loop.call_later(LINGER_S, self._t.close)

    def is_closing(self) -> bool:
        return self.lingering or self._t.is_closing()


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a per-address cap and JSON refusals."""

    header_timeout_s = 10.0
    max_per_client = 64
    open_by_client: ClassVar[Counter[str]] = Counter()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_Lingering(transport, self.loop))  # type: ignore[arg-type]
        self._who = self.client[0] if self.client else "?"
        self.open_by_client[self._who] += 1
        self._header_timer: asyncio.TimerHandle | None = None
        if self.open_by_client[self._who] > self.max_per_client:
            self._refuse(
                503,
                "Service Unavailable",
                f"this client holds {self.max_per_client} open connections, the most; close one",
                "too_many_connections",
            )
            return
        self._arm()

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._refuse(
                408,
                "Request Timeout",
                f"the request's headers did not arrive within {self.header_timeout_s:g} s",
                "request_timeout",
            )

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self.open_by_client[self._who] -= 1
        if self.open_by_client[self._who] <= 0:
            del self.open_by_client[self._who]
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return  # draining before the close
        super().data_received(data)
        if self._header_timer is not None and self.cycle is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._header_timer is None:
            self._arm()  # the next request's headers on a kept-alive connection

    def timeout_keep_alive_handler(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().timeout_keep_alive_handler()

    def send_400_response(self, msg: str) -> None:
        if len(self.conn.trailing_data[0]) >= MAX_HEADER_BYTES:
            self._refuse(
                431,
                "Request Header Fields Too Large",
                f"the request's headers are over {MAX_HEADER_BYTES} bytes",
                "headers_too_large",
            )
        else:
            self._refuse(400, "Bad Request", "the request is not valid HTTP/1.1", "invalid_http")

    def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if not self.transport.is_closing():
            self.transport.write(_answer(status, reason, message, code))
            self.transport.close()


def guard(app: Any, log: Callable[[str], None]) -> Any:
    """The ASGI ``app``, with a client gone mid-request logged in one line and a failure the app
    already answered (and logged) not re-raised into uvicorn's traceback."""

    async def guarded(scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await app(scope, receive, send)
        except (ClientDisconnect, ConnectionError, asyncio.IncompleteReadError):
            log(f"client gone during {scope.get('method', '')} {scope.get('path', '')}")
        except Exception:  # the app's handler logged it and answered 500
            pass

    return guarded
