"""``POST /v1/responses``: OpenAI's Responses API (the openai-agents SDK's default), text in and
text out, stateless.

The input (a string, or a list of message items whose content is a string or ``input_text``
parts; an assistant's earlier ``output_text`` parts too) and the ``instructions`` (a system
message before it) are rendered by the model's chat template exactly as ``sinklab chat`` renders
a conversation, read through a sink cache of their own (:mod:`.scoring`) and answered as one
``message`` output item with one ``output_text`` part (``output_text`` in the openai client).
``stream: true`` sends the Responses API's events (``response.created`` ...
``response.output_text.delta`` ... ``response.completed``). Nothing is stored: ``store: true`` and
``previous_response_id`` are refused, as is every field
this server cannot honour (tools, reasoning, other modalities): a 400 naming it
(docs/serve-routes.md#conformance-routes). ``text.format`` ``json_object`` / ``json_schema`` is
honoured as the chat route's ``response_format`` (docs/serve.md#structured-output).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sinklab.errors import SinklabError
from sinklab.serve.completions import (
    Host,
    check_model,
    gather,
    parse_route,
    scorer_of,
    temperature_of,
)
from sinklab.serve.protocol import ApiError, ChatRequest, refuse_description
from sinklab.serve.scoring import Prompt, Task

SHARED = ("temperature", "top_p", "user")  # checked as the chat route checks them

# Fields OpenAI defines that this server does not honour: refused unless absent, null or a
# value that asks for nothing (OpenAI's own defaults).
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "store": ((False,), "responses are not stored by this server; send store: false"),
    "previous_response_id": ((), "responses are not stored: send the whole conversation"),
    "conversation": ((), "conversations are not stored: send the whole conversation"),
    "tools": (([],), "tools are not supported by this server"),
    "tool_choice": (("none", "auto"), "tools are not supported by this server"),
    "parallel_tool_calls": ((False, True), "tools are not supported by this server"),
    "max_tool_calls": ((), "tools are not supported by this server"),
    "reasoning": (({},), "reasoning is not supported (no reasoning model)"),
    "include": (([],), "include is not supported (no extra output data)"),
    "background": ((False,), "background responses are not supported"),
    "truncation": (("disabled",), "only truncation 'disabled' (the sink cache bounds memory)"),
    "service_tier": (("auto", "default"), "service tiers are not supported"),
    "top_logprobs": ((0,), "logprobs are not supported on this route (use /v1/completions)"),
    "prompt": ((), "prompt templates are not supported"),
    "prompt_cache_key": ((), "prompt cache keys are not supported"),
    "safety_identifier": ((), "safety identifiers are not supported"),
    "stream_options": ((), "stream options are not supported on this route"),
}

TEXT_FORMAT = ({"format": {"type": "text"}}, {})  # ``text`` values that ask for plain text


class _TextFormat(BaseModel):
    """The Responses API's ``text.format``: ``text``, ``json_object`` or ``json_schema`` (its
    ``name``, ``schema``, ``strict`` and ``description`` flat beside ``type``), honoured as the
    chat route's ``response_format`` (:mod:`.grammar`)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the mask always holds
    description: str | None = None  # refused unless empty, as on the chat route

    @field_validator("description")
    @classmethod
    def _description(cls, value: str | None) -> str | None:
        return refuse_description(value)

    @model_validator(mode="after")
    def _only_with_json_schema(self) -> _TextFormat:
        if self.type != "json_schema":
            for name in ("name", "schema_", "strict", "description"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name.rstrip('_')} is given only with type 'json_schema'")
        elif self.name is None:
            raise ValueError("name is required with type 'json_schema'")
        return self

    def as_format(self) -> dict[str, Any]:
        """The chat route's ``response_format`` shape, for :meth:`Formats.check`."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": self.type, "json_schema": {"name": self.name, "schema": self.schema_}}


class _Text(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: _TextFormat


def _format_of(text: Any) -> dict[str, Any] | None:
    """``text`` -> the chat route's ``response_format`` (``None``: plain text), or a 400 naming
    the field of ``text.format`` that is wrong."""
    if text is None or text in TEXT_FORMAT:
        return None
    try:
        fmt = _Text.model_validate(text, strict=True).format
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(["text", *(str(x) for x in first["loc"])])
        raise _bad(where, first["msg"].removeprefix("Value error, ")) from None
    return fmt.as_format()


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    input: Any
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    metadata: dict[str, str] | None = None
    text: Any = None
    stream: bool = False


def _bad(where: str, msg: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{where}: {msg}", code=code, param=where)


ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
ITEM_FIELDS = {"type", "role", "content", "id", "status"}  # id, status: an output item sent back


def messages_of(value: Any) -> list[dict[str, str]]:
    """``input`` as chat messages, or a 400 naming the first item or part not text."""
    if isinstance(value, str):
        if not value:
            raise _bad("input", "is empty; send some text")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input", "must be a string or a non-empty list of message items")
    out = []
    for i, item in enumerate(value):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise _bad(where, "must be a message item (an object with role and content)")
        kind = item.get("type", "message")
        if kind != "message":
            raise _bad(f"{where}.type", f"{kind!r} items are not supported (text messages only)",
                       "unsupported_parameter")  # fmt: skip
        for name in item:
            if name not in ITEM_FIELDS:
                raise _bad(f"{where}.{name}", "unsupported field of a message item",
                           "unsupported_parameter")  # fmt: skip
        role = item.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"{role!r} is not a role (user, system, developer, "
                       "assistant)")  # fmt: skip
        out.append({"role": ROLES[role], "content": _text(item.get("content"), where, role)})
    return out


def _text(content: Any, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content", "must be a string or a list of text parts")
    ok = ("output_text", "input_text") if role == "assistant" else ("input_text",)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ok or not isinstance(part.get("text"), str):
            raise _bad(f"{where}.content.{j}.type", f"{kind!r} parts are not supported (only "
                       f"{' and '.join(ok)} with a text)", "unsupported_parameter")  # fmt: skip
        parts.append(part["text"])
    return "".join(parts)


class Responses:
    """The route over a :class:`~sinklab.serve.app.Server`."""

    def __init__(self, server: Host) -> None:
        self.server = server

    def _parse(self, body: bytes) -> tuple[_Req, ChatRequest, list[dict[str, str]]]:
        req, chat = parse_route(body, _Req, SHARED, REFUSED)
        messages = messages_of(req.input)
        if req.instructions:
            messages = [{"role": "system", "content": req.instructions}, *messages]
        return req, chat, messages

    async def create(self, request: Request) -> Response:
        server = self.server
        server.tenant(request)
        req, chat, messages = self._parse(await server.body(request))
        check_model(server, req.model)
        cfg = server.config
        if len(messages) > cfg.max_messages:
            raise _bad("input", f"{len(messages)} messages is over this server's "
                       f"{cfg.max_messages}")  # fmt: skip
        max_tokens = req.max_output_tokens or min(cfg.default_max_tokens, cfg.max_tokens_limit)
        if max_tokens > cfg.max_tokens_limit:
            raise _bad("max_output_tokens", f"{max_tokens} is over this server's "
                       f"{cfg.max_tokens_limit}")  # fmt: skip
        try:  # rendered as sinklab chat renders a conversation (its template, its first token)
            _, _, ids = await asyncio.to_thread(server.engine.make_chat().to_read, messages)
        except SinklabError as err:
            raise _bad("input", str(err), "invalid_conversation") from None
        except Exception as err:  # a template that raises on this conversation
            raise _bad("input", f"the chat template cannot render it ({type(err).__name__})",
                       "invalid_conversation") from None  # fmt: skip
        if not ids:
            raise _bad("input", "renders to no tokens")
        formats = server.engine.formats  # compiled off the event loop, as on the chat route
        fmt = await asyncio.to_thread(
            formats.check, _format_of(req.text), "text.format", "text.format.schema"
        )
        if fmt is not None:  # the matcher starts here, off the loop: its errors are a 400
            await asyncio.to_thread(formats.constraint, fmt)
        temperature = temperature_of(server, chat)
        sampling = replace(chat.sampling(), temperature=temperature)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        task = Task([Prompt(list(ids))], max_tokens, sampling, secrets.randbits(53), [], False,
                    None, time.monotonic() + cfg.request_timeout_s,
                    lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                    continues=False,
                    grammar=None if fmt is None else partial(formats.constraint, fmt))  # fmt: skip
        scorer_of(server).submit(task)
        rid, mid = "resp_" + secrets.token_hex(12), "msg_" + secrets.token_hex(12)
        ids_ = (rid, mid)
        if req.stream:
            return StreamingResponse(
                self._stream(req, chat, task, events, temperature, ids_),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        got = await gather(request, task, events, 1)
        if isinstance(got, Response):
            return got
        finish = got.finish[0] or "stop"
        return JSONResponse(
            self._body(req, chat, got.texts[0], finish, got.usage, temperature, ids_)
        )

    async def _stream(
        self,
        req: _Req,
        chat: ChatRequest,
        task: Task,
        events: asyncio.Queue,
        temperature: float,
        ids: tuple[str, str],
    ) -> AsyncIterator[bytes]:
        """The Responses API's event stream: created, the message item and its text part added,
        text deltas, then each closed, then completed (or incomplete)."""
        seq = iter(range(1 << 30))
        where = {"item_id": ids[1], "output_index": 0, "content_index": 0}

        def event(kind: str, **fields: Any) -> bytes:
            data = {"type": kind, "sequence_number": next(seq), **fields}
            return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

        start = self._body(req, chat, "", "stop", None, temperature, ids)
        start["status"], start["output"] = "in_progress", []
        item = {"type": "message", "id": ids[1], "status": "in_progress", "role": "assistant",
                "content": []}  # fmt: skip
        empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        text, finish, over = [], "stop", False
        try:
            yield event("response.created", response=start)
            yield event("response.in_progress", response=start)
            yield event("response.output_item.added", output_index=0, item=item)
            yield event("response.content_part.added", **where, part=empty)
            while True:
                kind, value = await events.get()
                if kind == "piece" and value.text:
                    text.append(value.text)
                    yield event("response.output_text.delta", **where, delta=value.text,
                                logprobs=[])  # fmt: skip
                elif kind == "finish":
                    finish = value[1]
                elif kind == "error":
                    over = True
                    err = value.body()["error"]
                    yield event("error", code=err["code"], message=err["message"],
                                param=err["param"])  # fmt: skip
                    return
                elif kind == "done":
                    over = True
                    body = self._body(req, chat, "".join(text), finish, value, temperature, ids)
                    message = body["output"][0]
                    part = message["content"][0]
                    yield event("response.output_text.done", **where, text=part["text"],
                                logprobs=[])  # fmt: skip
                    yield event("response.content_part.done", **where, part=part)
                    yield event("response.output_item.done", output_index=0, item=message)
                    done = "response.completed" if body["status"] == "completed" else (
                        "response.incomplete")  # fmt: skip
                    yield event(done, response=body)
                    return
        finally:
            if not over:
                self.server.log("response: client gone mid-reply")
                task.cancelled.set()

    def _body(
        self,
        req: _Req,
        chat: ChatRequest,
        text: str,
        finish: str,
        usage: dict[str, Any] | None,
        temperature: float,
        ids: tuple[str, str],
    ) -> dict[str, Any]:
        """The response object (``usage`` None: not known yet, while it streams)."""
        done = finish != "length"
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        message = {
            "type": "message",
            "id": ids[1],
            "status": "completed" if done else "incomplete",
            "role": "assistant",
            "content": [part],
        }
        return {
            "id": ids[0],
            "object": "response",
            "created_at": int(time.time()),
            "status": "completed" if done else "incomplete",
            "incomplete_details": None if done else {"reason": "max_output_tokens"},
            "error": None,
            "model": self.server.config.model_id,
            "instructions": req.instructions,
            "output": [message],
            "max_output_tokens": req.max_output_tokens,
            "temperature": temperature,
            "top_p": 1.0 if chat.top_p is None else chat.top_p,
            "tools": [],
            "tool_choice": "none",
            "parallel_tool_calls": False,
            "text": req.text if req.text else {"format": {"type": "text"}},
            "truncation": "disabled",
            "reasoning": None,
            "store": False,
            "previous_response_id": None,
            "metadata": req.metadata or {},
            "user": chat.user,
            "usage": None
            if usage is None
            else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            },
        }
