"""``n`` > 1 on ``POST /v1/chat/completions``: several independent replies to one conversation,
answered without a session.

A session holds one conversation's cache and continues it with the reply the client got; with
``n`` replies there is no one reply to continue, and a client that sends ``n`` > 1 (sampling for
self-consistency, ranking, best-of) is asking one question several times. So the conversation is
rendered as ``sinklab chat`` renders it (its template, its first token), read once through a sink
cache of its own by the stateless routes' :class:`~sinklab.serve.scoring.Scorer`, and each
choice ``j`` is decoded from that read with its own draws: seed ``seed + j`` (so choice ``j``
is the ``n = 1`` reply with seed ``seed + j``, modulo 2**64, and a seeded request replays).
The choices are decoded one after another by the stateless routes' scorer (stepped on the
engine's thread), under the request's one ``--request-timeout``. ``usage`` counts the prompt
once and every choice's tokens. The response carries no ``session_id``.

``logprobs`` / ``top_logprobs`` are each choice's own, as the chat route gives them for
``n = 1`` (the model's log-softmax at each reply token; none for the end of turn), so choice
``j``'s entries are the ``n = 1`` reply's with seed ``seed + j``.

Refused with a 400 naming the field: a ``session_id`` (nothing is kept), ``tools`` or tool
messages (a reply could be a call, and a call continues a session), ``n`` above
:data:`MAX_N`. ``response_format`` is honoured, a fresh matcher per choice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sinklab.errors import SinklabError
from sinklab.serve.completions import gather, scorer_of
from sinklab.serve.grammar import Format
from sinklab.serve.protocol import ApiError, ChatRequest, chunk, completion_id, sse
from sinklab.serve.scoring import Prompt, Task


def _bad(where: str, msg: str, code: str = "unsupported_parameter") -> ApiError:
    return ApiError(400, f"{where}: {msg}", code=code, param=where)


def refusal(req: ChatRequest) -> ApiError | None:
    """What an ``n`` > 1 request asks that cannot be answered without a session."""
    if req.session_id is not None:
        return _bad("session_id", "n > 1 replies are not kept in a session; send no session_id")
    if req.tools or any(m.uses_tools() for m in req.messages):
        return _bad("n", "n > 1 with tools or tool messages is not supported (a reply may be a "
                    "call, which continues a session): send n = 1")  # fmt: skip
    return None


async def answer(
    server: Any,
    request: Request,
    req: ChatRequest,
    fmt: Format | None,
    max_tokens: int,
    seed: int,
    temperature: float,
) -> Response:
    """The ``n`` replies to ``req`` (whole or streamed), as the module says."""
    n = int(req.n or 1)
    messages = [m.as_dict() for m in req.messages]
    try:  # rendered as sinklab chat renders a conversation
        _, _, ids = await asyncio.to_thread(server.engine.make_chat().to_read, messages)
    except SinklabError as err:
        raise _bad("messages", str(err), "invalid_conversation") from None
    except Exception as err:  # a template that raises on this conversation
        raise _bad(
            "messages",
            f"the chat template cannot render them ({type(err).__name__})",
            "invalid_conversation",
        ) from None
    if not ids:
        raise _bad("messages", "render to no tokens", "invalid_conversation")
    formats = server.engine.formats
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    sampling = replace(req.sampling(), temperature=temperature)
    task = Task(
        [Prompt(list(ids))],
        max_tokens,
        sampling,
        seed,
        req.stops(),
        False,
        None,
        time.monotonic() + server.config.request_timeout_s,
        lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
        continues=False,
        grammar=None if fmt is None else partial(formats.constraint, fmt),
        copies=n,
        chat_logprobs=bool(req.logprobs),
    )
    scorer_of(server).submit(task)
    cid, model = completion_id(), server.config.model_id
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(server, task, events, cid, model, n, seed, include),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    got = await gather(request, task, events, n)
    if isinstance(got, Response):
        return got
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": got.texts[i]},
            "finish_reason": got.finish[i],
            "logprobs": {"content": got.entries[i]} if req.logprobs else None,
        }
        for i in range(n)
    ]
    return JSONResponse({"id": cid, "object": "chat.completion", "created": int(time.time()),
                         "model": model, "choices": choices, "usage": got.usage,
                         "seed": seed})  # fmt: skip


def _at(body: dict[str, Any], index: int) -> dict[str, Any]:
    body["choices"][0]["index"] = index
    return body


async def _stream(
    server: Any,
    task: Task,
    events: asyncio.Queue,
    cid: str,
    model: str,
    n: int,
    seed: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    extra, over = {"seed": seed}, False
    try:
        for i in range(n):
            yield sse(_at(chunk(cid, model, {"role": "assistant", "content": ""}, None, extra), i))
        while True:
            kind, value = await events.get()
            if kind == "piece" and (value.text or value.entries):
                lp = value.entries if task.chat_logprobs else None
                delta = {"content": value.text}
                yield sse(_at(chunk(cid, model, delta, None, extra, lp), value.index))
            elif kind == "finish":
                yield sse(_at(chunk(cid, model, {}, value[1], extra), value[0]))
            elif kind == "error":
                over = True
                yield sse(value.body())
                return
            elif kind == "done":
                over = True
                if include_usage:
                    usage = chunk(cid, model, {}, None, {**extra, "usage": value})
                    usage["choices"] = []
                    yield sse(usage)
                yield sse("[DONE]")
                return
    finally:
        if not over:
            server.log("chat completion (n > 1): client gone mid-reply")
            task.cancelled.set()
