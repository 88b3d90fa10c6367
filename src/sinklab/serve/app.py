"""The HTTP side of ``sinklab serve`` (FastAPI on uvicorn): routes, API keys, limits, errors.

Every refusal is an OpenAI-style JSON error (:class:`~sinklab.serve.protocol.ApiError`); an
unexpected failure is logged on the server and answered with a bare 500, never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from sinklab.serve import choices
from sinklab.serve.completions import Completions
from sinklab.serve.config import ServeConfig
from sinklab.serve.engine import Engine, Job
from sinklab.serve.limits import PerKey, tenant_for
from sinklab.serve.metrics import Metrics
from sinklab.serve.protocol import (
    SESSION_ID,
    ApiError,
    ChatRequest,
    chunk,
    completion,
    completion_id,
    parse_request,
    sse,
)
from sinklab.serve.registry import not_found
from sinklab.serve.responses import Responses
from sinklab.serve.sessions import Session
from sinklab.serve.tools import END as TOOL_END
from sinklab.serve.tools import seen_as


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class Server:
    """The routes over one :class:`Engine`."""

    def __init__(
        self, engine: Engine, config: ServeConfig, metrics: Metrics, log: Callable[[str], None]
    ) -> None:
        self.engine, self.config, self.metrics, self.log = engine, config, metrics, log
        self.created = int(time.time())

    # ---------------------------------------------------------------- checks
    def tenant(self, request: Request) -> str:
        """The tenant of the request's key (401 without a known one); '' when keys are off."""
        tenant = tenant_for(self.config, request.headers.get("authorization", ""))
        if tenant is not None:
            return tenant
        raise ApiError(
            401,
            "a valid API key is required: send 'Authorization: Bearer KEY'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        too_big = ApiError(
            413,
            f"the request body is over {limit} bytes; send only the new message with a session_id",
            code="request_too_large",
            headers={"Connection": "close"},  # the rest of the body is drained, then closed
        )
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise too_big
        data = bytearray()
        seconds = self.config.header_timeout_s
        try:  # a body trickled in past the deadline holds no connection
            async with asyncio.timeout(seconds):
                async for part in request.stream():
                    data += part
                    if len(data) > limit:
                        raise too_big
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {seconds:g} s",
                code="request_timeout",
                headers={"Connection": "close"},
            ) from None
        return bytes(data)

    def owned(self, tenant: str, sid: str) -> Session:
        """The key's session ``sid``; an absent id and another key's answer the same 404."""
        s = self.engine.registry.find(tenant, sid) if SESSION_ID.fullmatch(sid) else None
        if s is None:
            raise not_found(sid)
        return s

    # ---------------------------------------------------------------- routes
    async def chat_completions(self, request: Request) -> Response:
        tenant = self.tenant(request)
        req = parse_request(await self.body(request))
        cfg = self.config
        if req.model != cfg.model_id:
            raise ApiError(
                404,
                f"model {req.model!r} is not served here; this server serves {cfg.model_id!r}",
                code="model_not_found",
                param="model",
            )
        if len(req.messages) > cfg.max_messages:
            raise ApiError(
                400,
                f"{len(req.messages)} messages is over this server's {cfg.max_messages}; send "
                "only the new message with a session_id",
                code="too_many_messages",
                param="messages",
            )
        max_tokens = (  # unasked: the default, within this server's --max-tokens
            req.max_completion_tokens
            or req.max_tokens
            or min(cfg.default_max_tokens, cfg.max_tokens_limit)
        )
        if max_tokens > cfg.max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens {max_tokens} is over this server's {cfg.max_tokens_limit}",
                code="invalid_value",
                param="max_tokens",
            )
        sampling = req.sampling()
        vocab = int(getattr(self.engine.model.config, "vocab_size", 0) or 0)
        if vocab and any(t >= vocab for t in sampling.logit_bias):
            raise ApiError(
                400,
                f"logit_bias: token ids must be below this model's vocabulary size {vocab}",
                code="invalid_value",
                param="logit_bias",
            )
        # compiled off the event loop (a big schema takes a while), before any session is touched
        formats, asked = self.engine.formats, req.response_format
        fmt = None if asked is None else await asyncio.to_thread(formats.check, asked.as_dict())
        if fmt is not None and req.tools_on():
            raise ApiError(
                400,
                f"response_format: a {fmt.name} reply cannot also call tools; send tool_choice "
                "'none' or no response_format",
                code="unsupported_parameter",
                param="response_format",
            )
        if (forced := req.forced_tools()) is not None:  # "required" or a named function
            self._tools(req)  # a template without tools: its 400 first
            # several calls only under "required": a named function is called once
            parallel = req.tool_choice == "required" and req.parallel_tool_calls is not False
            fmt = await asyncio.to_thread(
                formats.tool_calls, forced, self.engine.call_markers, parallel
            )
        grammar = None if fmt is None else await asyncio.to_thread(formats.constraint, fmt)
        # unseeded: a fresh seed, returned so the reply can be replayed (53 bits: exact in JSON)
        seed = req.seed if req.seed is not None else secrets.randbits(53)
        if (req.n or 1) > 1:  # several replies: no session (:mod:`.choices`)
            if (why := choices.refusal(req)) is not None:
                raise why
            t = self.engine.chat_config.temperature if req.temperature is None else req.temperature
            return await choices.answer(self, request, req, fmt, max_tokens, seed, t)
        tools = self._tools(req)
        messages = [m.as_dict() for m in req.messages]
        registry = self.engine.registry
        session, new, created = registry.acquire(tenant, req.session_id, messages, tools)
        stops = req.stops()
        callable_tools = tools if req.tools_on() else None  # "none": no reply parsed as a call
        if callable_tools is not None and req.parallel_tool_calls is False:
            stops.append(TOOL_END)  # at most one call: the reply ends with its first
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        job = Job(
            session,
            new,
            max_tokens,
            req.temperature,
            seed,
            stops,
            time.monotonic() + cfg.request_timeout_s,
            lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
            created=created,
            deferred=True,  # applied once the client can have it (see _whole, _stream)
            sampling=sampling,
            tool_names=frozenset(t["function"]["name"] for t in callable_tools or ()),
            grammar=grammar,
            forced=forced is not None,
        )
        try:
            self.engine.submit(job)
        except ApiError:
            registry.release(session, created)
            raise
        if req.stream:
            return StreamingResponse(
                self._stream(req, job, events),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await self._whole(request, job, events)

    def _tools(self, req: ChatRequest) -> list[dict[str, Any]] | None:
        """The request's tools as the template renders them (None: no tools), or a 400 for a
        model whose template does not render tools."""
        used = [i for i, m in enumerate(req.messages) if m.uses_tools()]
        if (req.tools_on() or used) and not self.engine.tools_ok:
            param = "tools" if req.tools_on() else f"messages.{used[0]}"
            raise ApiError(
                400,
                f"{param}: this model's chat template does not render tools ({self.config.model_id}"
                " has no tool support); serve a model whose template does (e.g. qwen2.5-0.5b)",
                code="unsupported_parameter",
                param=param,
            )
        if not req.tools or not self.engine.tools_ok:
            return None
        # rendered under tool_choice "none" too (the model sees them and is not to call them;
        # OpenAI's meaning), so a tools session's turn with "none" is the same session
        return [t.model_dump(exclude_none=True) for t in req.tools]

    async def _whole(self, request: Request, job: Job, events: asyncio.Queue) -> Response:
        """The reply as one response; a client gone while it is made (checked every second)
        drops the turn, and the turn is applied just before the response goes out."""
        cid, text = completion_id(), []
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(events.get(), timeout=1.0)
                except TimeoutError:
                    if await request.is_disconnected():
                        self.log(f"session {job.session.id}: client gone; the turn was not applied")
                        job.cancelled.set()
                        asyncio.get_running_loop().create_task(self._drain(job, events))
                        return Response(status_code=499)
                    continue
                if kind == "text":
                    text.append(value)
                elif kind == "logprobs":
                    continue  # the whole list comes with "done"
                elif kind == "error":
                    return _error(value)
                else:
                    if await request.is_disconnected():
                        self.log(f"session {job.session.id}: client gone; the turn was not applied")
                        self.engine.abort(job)
                        return Response(status_code=499)
                    error = await asyncio.to_thread(self.engine.commit, job)
                    if error is not None:
                        return _error(error)
                    extra = {"session_id": job.session.id, "session": value["session"],
                             "seed": job.seed}  # fmt: skip
                    body = completion(
                        cid,
                        self.config.model_id,
                        value["reply"],
                        value["finish_reason"],
                        value["usage"],
                        extra,
                        value["logprobs"],
                    )
                    if value["tool_calls"]:
                        body["choices"][0]["message"]["tool_calls"] = value["tool_calls"]
                    return JSONResponse(body)
        except asyncio.CancelledError:  # the client went away: the turn is dropped
            job.cancelled.set()
            if job.final is not None:
                self.engine.abort(job)
            else:
                asyncio.get_running_loop().create_task(self._drain(job, events))
            raise

    async def _stream(
        self, req: ChatRequest, job: Job, events: asyncio.Queue
    ) -> AsyncIterator[bytes]:
        cid, model, sid = completion_id(), self.config.model_id, job.session.id
        over, ids = False, {"session_id": sid, "seed": job.seed}
        want = job.sampling is not None and job.sampling.logprobs
        entries: list[dict[str, Any]] = []  # logprobs waiting for their text
        held = bool(job.tool_names)  # with tools the text waits: it may be a call
        try:
            yield sse(chunk(cid, model, {"role": "assistant", "content": ""}, None, ids))
            while True:
                kind, value = await events.get()
                if kind == "logprobs":
                    entries += value
                elif kind == "text" and held:
                    continue  # the whole reply comes with "done", as text or as calls
                elif kind == "text":
                    lp, entries = (entries if want else None), []
                    yield sse(chunk(cid, model, {"content": value}, None, ids, lp))
                elif kind == "error":
                    over = True
                    yield sse(value.body())
                    return
                else:  # the reply is whole: it is committed once its last chunk went out
                    if held:
                        for delta in _held(value):
                            yield sse(chunk(cid, model, delta, None, ids))
                    extra = {**ids, "session": value["session"]}
                    lp = entries if want and entries else None
                    yield sse(chunk(cid, model, {}, value["finish_reason"], extra, lp))
                    over = True
                    error = await asyncio.to_thread(self.engine.commit, job)
                    if error is not None:
                        yield sse(error.body())
                        return
                    if req.stream_options and req.stream_options.include_usage:
                        usage = chunk(cid, model, {}, None, {"usage": value["usage"]})
                        usage["choices"] = []
                        yield sse(usage)
                    yield sse("[DONE]")
                    return
        finally:
            if not over:  # the client went away before the whole reply: the turn is dropped
                self.log(f"session {sid}: client gone mid-reply; the turn was not applied")
                job.cancelled.set()
                if job.final is not None:
                    self.engine.abort(job)
                else:
                    asyncio.get_running_loop().create_task(self._drain(job, events))

    async def _drain(self, job: Job, events: asyncio.Queue) -> None:
        """After the client left mid-stream: the engine may still finish the (deferred) turn
        before it sees the cancel; such a turn is dropped, never committed."""
        while True:
            kind, _ = await events.get()
            if kind == "error":
                return
            if kind == "done":
                self.engine.abort(job)
                return

    async def models(self, request: Request) -> Response:
        self.tenant(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model_id,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "sinklab",
                    }
                ],
            }
        )

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: the served model, or 404 for any other id."""
        self.tenant(request)
        mid = request.path_params["mid"]
        if mid != self.config.model_id:
            raise ApiError(
                404,
                f"model {mid!r} is not served here; this server serves {self.config.model_id!r}",
                code="model_not_found",
                param="model",
            )
        return JSONResponse(
            {"id": mid, "object": "model", "created": self.created, "owned_by": "sinklab"}
        )

    async def elsewhere(self, request: Request) -> Response:
        """Routes OpenAI has and this server does not: a 404 that names the one to use."""
        raise ApiError(
            404,
            f"{request.url.path} is not served here (sinklab serves chat, completions and "
            "responses); use POST /v1/chat/completions with messages",
            code="unsupported_route",
        )

    async def sessions(self, request: Request) -> Response:
        """``GET /v1/sessions``: the key's sessions (id, turns, kept positions, last use)."""
        rows = self.engine.registry.listing(self.tenant(request))
        return JSONResponse({"object": "list", "data": rows})

    async def session(self, request: Request) -> Response:
        s = self.owned(self.tenant(request), request.path_params["sid"])
        return JSONResponse(
            {
                "id": s.id,
                "object": "session",
                **s.summary(),
                "messages": [seen_as(m) for m in s.chat.messages],
            }
        )

    async def delete_session(self, request: Request) -> Response:
        tenant, sid = self.tenant(request), request.path_params["sid"]
        if not SESSION_ID.fullmatch(sid):
            raise not_found(sid)
        self.engine.registry.delete(tenant, sid)
        return JSONResponse({"id": sid, "object": "session.deleted", "deleted": True})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.config.model_id})

    async def prometheus(self, request: Request) -> Response:
        """Aggregates to any key; per-key series (by tenant hash) only to ``--metrics-key``."""
        per_key = self.config.metrics_key is not None and self._is_metrics_key(request)
        if not per_key:
            self.tenant(request)
        eng = self.engine

        def gauges() -> dict[str, float]:
            with eng.lock:
                n = len(eng.sessions)
            return {"sessions": n, "kept": eng.kept_total(), "queue": eng.queue.qsize()}

        text = self.metrics.render(gauges)
        if per_key:
            text += self._per_key()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def _is_metrics_key(self, request: Request) -> bool:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        known = self.config.metrics_key or ""
        return scheme.lower() == "bearer" and hmac.compare_digest(
            known.encode(), key.strip().encode("utf-8", "replace")
        )

    def _per_key(self) -> str:
        with self.engine.lock:
            by: dict[str, list[int]] = {}
            for (tenant, _), s in self.engine.sessions.items():
                row = by.setdefault(tenant or "open", [0, 0, 0])
                row[0] += 1
                row[1] += s.state.kept
                row[2] += int(s.busy)
        lines = [
            "# HELP sinklab_key_sessions Sessions held, by key (tenant hash).",
            "# TYPE sinklab_key_sessions gauge",
        ]
        lines += [f'sinklab_key_sessions{{tenant="{t}"}} {r[0]}' for t, r in sorted(by.items())]
        lines += [
            "# HELP sinklab_key_kept_positions Cache positions kept, by key.",
            "# TYPE sinklab_key_kept_positions gauge",
        ]
        lines += [
            f'sinklab_key_kept_positions{{tenant="{t}"}} {r[1]}' for t, r in sorted(by.items())
        ]
        lines += [
            "# HELP sinklab_key_busy Turns in flight, by key.",
            "# TYPE sinklab_key_busy gauge",
        ]
        lines += [f'sinklab_key_busy{{tenant="{t}"}} {r[2]}' for t, r in sorted(by.items())]
        return "\n".join(lines) + "\n"


def _held(value: dict[str, Any]) -> list[dict[str, Any]]:
    """A reply held back while tools are on, as stream deltas: its text, then its calls (each
    whole, in OpenAI's indexed form)."""
    deltas: list[dict[str, Any]] = []
    if value["reply"]:
        deltas.append({"content": value["reply"]})
    if value["tool_calls"]:
        calls = [{"index": i, **c} for i, c in enumerate(value["tool_calls"])]
        deltas.append({"tool_calls": calls})
    return deltas


class _Counted:
    """Counts answers by status (``/metrics``). A plain ASGI middleware, not Starlette's
    ``BaseHTTPMiddleware``: that one wraps ``receive`` so that ``request.is_disconnected()``
    never sees a client gone, and a reply would be applied for a client that left."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.add_request(message["status"])
            await send(message)

        await self.app(scope, receive, counted)


def build_app(
    engine: Engine, config: ServeConfig, metrics: Metrics, log: Callable[[str], None]
) -> FastAPI:
    """The ASGI app: OpenAI's routes plus sessions, health and metrics."""
    server = Server(engine, config, metrics, log)
    app = FastAPI(title="sinklab serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/v1/models/{mid:path}", server.model, methods=["GET"])
    app.add_api_route("/v1/completions", Completions(server).create, methods=["POST"])
    app.add_api_route("/v1/responses", Responses(server).create, methods=["POST"])
    app.add_api_route("/v1/embeddings", server.elsewhere, methods=["POST"])
    app.add_api_route("/v1/sessions", server.sessions, methods=["GET"])
    app.add_api_route("/v1/sessions/{sid}", server.session, methods=["GET"])
    app.add_api_route("/v1/sessions/{sid}", server.delete_session, methods=["DELETE"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])

    app.add_middleware(PerKey, config=config)  # inside: its 429s are counted too
    app.add_middleware(_Counted, metrics=metrics)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> Response:
        return _error(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        what = "no such route" if err.status_code == 404 else str(err.detail)
        return _error(ApiError(err.status_code, f"{what}: {request.method} {request.url.path}"))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> Response:
        return _error(ApiError(400, "the request is not valid", code="invalid_value"))

    @app.exception_handler(Exception)
    async def crash(request: Request, err: Exception) -> Response:
        if isinstance(err, (ClientDisconnect, ConnectionError)):
            return Response(status_code=499)  # no one to answer: the guard logs it in one line
        log(f"internal error on {request.method} {request.url.path}: {type(err).__name__}: {err}")
        if os.environ.get("SINKLAB_DEBUG"):
            import traceback

            traceback.print_exception(err)
        metrics.add_request(500)
        return _error(ApiError(500, "internal server error", type="server_error"))

    return app
