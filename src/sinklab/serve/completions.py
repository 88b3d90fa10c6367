"""``POST /v1/completions``: OpenAI's legacy completions (prompt in, text out), stateless.

Each prompt (a string, a list of strings, a list of token ids or a list of such lists: one
choice each) is read through its own sink cache (:mod:`.scoring`) and continued with the same
sampling step as chat (:mod:`.sampling`). ``echo`` returns the prompt before the reply;
``logprobs: k`` returns the legacy block (``tokens``, ``token_logprobs``, ``top_logprobs``: the
``k`` most likely tokens plus the chosen one, ``text_offset``), for the prompt's tokens too when
echoed (the first one's logprob is null): what lm-evaluation-harness's ``local-completions``
model scores loglikelihood tasks with. Every field OpenAI defines is honoured or refused with a
400 naming it (docs/serve-routes.md#conformance-routes).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sinklab.serve.config import ServeConfig
from sinklab.serve.protocol import ApiError, ChatRequest, load_json, sse
from sinklab.serve.scoring import Entry, Piece, Prompt, Scorer, Task


class Host(Protocol):
    """What these routes use of :class:`sinklab.serve.app.Server` (its keys, limits, model and
    log), named here so that the app imports the routes and not the other way round."""

    config: ServeConfig
    engine: Any
    log: Callable[[str], None]

    def tenant(self, request: Request) -> str: ...

    async def body(self, request: Request) -> bytes: ...


MAX_PROMPTS = 64  # prompts in one request
MAX_CHOICES = 64  # prompts x n
MAX_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this route

# sampling fields checked exactly as the chat route checks them (ChatRequest's validators)
SHARED = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty",
          "logit_bias", "seed", "stop", "user")  # fmt: skip

REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": (("",), "suffix (insertion) is not supported"),
    "best_of": ((1,), "only best_of 1 is supported (n choices are all returned; rank them)"),
}


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """The completions-only fields (the sampling ones are :data:`SHARED`, checked by
    :class:`~sinklab.serve.protocol.ChatRequest`)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: Any
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choices per prompt, each its own draws
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    stream_options: _StreamOptions | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _int(cls, value: Any) -> Any:
        if isinstance(value, bool):  # the chat route's boolean, sent here
            raise ValueError("the legacy logprobs is an integer (top alternatives per token)")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x
            )

        if isinstance(value, str) or (ids(value) and value):
            return value
        many = isinstance(value, list) and bool(value)
        if many and (all(isinstance(p, str) for p in value) or all(ids(p) and p for p in value)):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            return value
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of non-empty "
            "token-id lists"
        )


def _bad(where: str, msg: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{where}: {msg}", code=code, param=where)


def validation_error(err: ValidationError) -> ApiError:
    first = err.errors()[0]
    where = ".".join(str(x) for x in first["loc"]) or "body"
    return _bad(where, first["msg"].removeprefix("Value error, "))


def refuse_unknown(data: dict[str, Any], known: set[str], refused: dict[str, Any]) -> None:
    """A 400 naming the first field that is unknown, or refused with a value asking for
    something (absent, null and the listed defaults ask for nothing)."""
    for name, value in data.items():
        if name not in known and name not in refused:
            raise _bad(name, "unsupported parameter (this route does not know it)",
                       "unsupported_parameter")  # fmt: skip
        if name in refused and value is not None and value not in refused[name][0]:
            raise _bad(name, refused[name][1], "unsupported_parameter")


def parse_route(
    body: bytes, model: type[Any], shared: tuple[str, ...], refused: dict[str, Any]
) -> tuple[Any, ChatRequest]:
    """A stateless route's request read strictly as ``model``, its unknown or refused fields a
    400, and its ``shared`` sampling fields read exactly as the chat route reads them (so one
    value means one thing on every route)."""
    data = load_json(body)
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    refuse_unknown(data, set(model.model_fields) | set(shared), refused)
    try:
        req = model.model_validate(data, strict=True)
        picked = {k: data[k] for k in shared if k in data}
        chat = ChatRequest.model_validate(
            {"model": req.model, "messages": [{"role": "user", "content": "-"}], **picked},
            strict=True,  # as the chat route reads them: no "2" for 2, no true for 1
        )
    except ValidationError as err:
        raise validation_error(err) from None
    return req, chat


def parse(body: bytes) -> tuple[CompletionRequest, ChatRequest]:
    """The request (its own fields, and the sampling ones as the chat route reads them)."""
    req, chat = parse_route(body, CompletionRequest, SHARED, REFUSED)
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options", "only with stream: true")
    return req, chat


def check_model(server: Host, model: str) -> None:
    if model != server.config.model_id:
        raise ApiError(
            404,
            f"model {model!r} is not served here; this server serves {server.config.model_id!r}",
            code="model_not_found",
            param="model",
        )


def check_bias(server: Host, chat: ChatRequest) -> None:
    vocab = int(getattr(server.engine.model.config, "vocab_size", 0) or 0)
    if vocab and any(int(t) >= vocab for t in chat.logit_bias or {}):
        raise _bad("logit_bias", f"token ids must be below this model's vocabulary size {vocab}")


def scorer_of(server: Host) -> Scorer:
    """The server's one :class:`Scorer`: the engine's, stepped on its thread."""
    return server.engine.scorer


@dataclass
class Gathered:
    """A stateless task's whole answer: each choice's text, legacy entries and finish reason,
    and the usage."""

    texts: list[str]
    entries: list[list[Entry]]
    finish: list[str | None]
    usage: dict[str, Any]


async def gather(
    request: Request, task: Task, events: asyncio.Queue, n: int
) -> Gathered | Response:
    """The ``n`` choices of ``task`` from its events, for a whole (not streamed) response; or the
    response that ends it early: 499 when the client left (checked every second; the task is
    cancelled, as it is when this coroutine is), the error's JSON when the task failed. Shared
    by the stateless routes (completions, responses, chat with ``n`` > 1)."""
    texts: list[list[str]] = [[] for _ in range(n)]
    entries: list[list[Entry]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(events.get(), timeout=1.0)
            except TimeoutError:
                if await request.is_disconnected():
                    task.cancelled.set()
                    return Response(status_code=499)
                continue
            if kind == "piece":
                texts[value.index].append(value.text)
                entries[value.index] += value.entries
            elif kind == "finish":
                finish[value[0]] = value[1]
            elif kind == "error":
                return JSONResponse(value.body(), status_code=value.status)
            else:
                return Gathered(["".join(t) for t in texts], entries, finish, value)
    except asyncio.CancelledError:
        task.cancelled.set()
        raise


def temperature_of(server: Host, chat: ChatRequest) -> float:
    """The request's temperature, else the server's default (as on the chat route)."""
    return server.engine.chat_config.temperature if chat.temperature is None else chat.temperature


class Completions:
    """The route over a :class:`~sinklab.serve.app.Server` (its keys, limits and model)."""

    def __init__(self, server: Host) -> None:
        self.server = server

    def _prompts(self, prompt: Any) -> list[Prompt]:
        tok = self.server.engine.tok
        vocab = int(getattr(self.server.engine.model.config, "vocab_size", 0) or 0) or len(tok)
        if isinstance(prompt, str) or isinstance(prompt[0], str):
            texts = [prompt] if isinstance(prompt, str) else prompt
            out = [text_prompt(tok, t) for t in texts]
            for i, p in enumerate(out):
                if not p.ids:
                    where = "prompt" if isinstance(prompt, str) else f"prompt.{i}"
                    raise _bad(where, "has no tokens; send some text")
            return out
        lists = [prompt] if isinstance(prompt[0], int) else prompt
        for i, ids in enumerate(lists):
            if any(not 0 <= t < vocab for t in ids):
                where = "prompt" if isinstance(prompt[0], int) else f"prompt.{i}"
                raise _bad(where, f"token ids must be in 0..{vocab - 1} (this model's vocabulary)")
        return [Prompt(list(ids)) for ids in lists]

    async def create(self, request: Request) -> Response:
        server = self.server
        server.tenant(request)
        req, chat = parse(await server.body(request))
        check_model(server, req.model)
        check_bias(server, chat)
        cfg = server.config
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        if max_tokens > cfg.max_tokens_limit:
            raise _bad("max_tokens", f"{max_tokens} is over this server's {cfg.max_tokens_limit}")
        prompts = await asyncio.to_thread(self._prompts, req.prompt)  # off the event loop
        if len(prompts) * req.n > MAX_CHOICES:
            raise _bad("n", f"{len(prompts)} prompts x n {req.n} is over {MAX_CHOICES} choices")
        seed = chat.seed if chat.seed is not None else secrets.randbits(53)
        sampling = replace(chat.sampling(), temperature=temperature_of(server, chat))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        task = Task(
            prompts,
            max_tokens,
            sampling,
            seed,
            chat.stops(),
            req.echo,
            req.logprobs,
            time.monotonic() + cfg.request_timeout_s,
            lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
            copies=req.n,
        )
        scorer_of(server).submit(task)
        head = {"id": "cmpl-" + secrets.token_hex(12), "object": "text_completion",
                "model": cfg.model_id}  # fmt: skip
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._stream(task, events, head, seed, include),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await self._whole(request, task, events, head, seed, len(prompts) * req.n)

    async def _whole(
        self,
        request: Request,
        task: Task,
        events: asyncio.Queue,
        head: dict[str, Any],
        seed: int,
        n: int,
    ) -> Response:
        got = await gather(request, task, events, n)
        if isinstance(got, Response):
            return got
        choices = [
            {
                "index": i,
                "text": got.texts[i],
                "logprobs": legacy(got.entries[i]) if task.logprobs is not None else None,
                "finish_reason": got.finish[i],
            }
            for i in range(n)
        ]
        return JSONResponse({**head, "created": int(time.time()), "choices": choices,
                             "usage": got.usage, "seed": seed})  # fmt: skip

    async def _stream(
        self,
        task: Task,
        events: asyncio.Queue,
        head: dict[str, Any],
        seed: int,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        over = False
        try:
            while True:
                kind, value = await events.get()
                if kind == "piece":
                    yield sse(self._chunk(head, seed, task, value, None))
                elif kind == "finish":
                    yield sse(self._chunk(head, seed, task, Piece(value[0], "", []), value[1]))
                elif kind == "error":
                    over = True
                    yield sse(value.body())
                    return
                else:
                    over = True
                    if include_usage:
                        yield sse({**head, "created": int(time.time()), "choices": [],
                                   "usage": value, "seed": seed})  # fmt: skip
                    yield sse("[DONE]")
                    return
        finally:
            if not over:
                self.server.log("completion: client gone mid-reply")
                task.cancelled.set()

    def _chunk(
        self, head: dict[str, Any], seed: int, task: Task, piece: Piece, finish: str | None
    ) -> dict[str, Any]:
        lp = legacy(piece.entries) if task.logprobs is not None and finish is None else None
        choice = {"index": piece.index, "text": piece.text, "logprobs": lp,
                  "finish_reason": finish}  # fmt: skip
        return {**head, "created": int(time.time()), "choices": [choice], "seed": seed}


def text_prompt(tokenizer: Any, text: str) -> Prompt:
    """``text`` as the model reads it (with the tokenizer's own start, e.g. a BOS: as vLLM
    reads a completions prompt), with each token's start in ``text`` where the tokenizer can
    say (a fast tokenizer's offsets)."""
    try:
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        offsets = [int(a) for a, _ in enc["offset_mapping"]]
    except (NotImplementedError, KeyError, TypeError, ValueError):
        enc, offsets = tokenizer(text, add_special_tokens=True), None
    return Prompt(list(enc["input_ids"]), text if offsets is not None else None, offsets)


def legacy(entries: list[Entry]) -> dict[str, Any]:
    """The legacy ``logprobs`` block of ``entries``."""
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [e.top for e in entries],
        "text_offset": [e.offset for e in entries],
    }
