"""The OpenAI chat-completions shapes ``sinklab serve`` speaks: the request it accepts
(:class:`ChatRequest`, checked field by field), its responses and stream chunks, and the one error
body every refusal uses (:class:`ApiError`)."""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
MIN_TEMPERATURE = 1e-4  # below it (and above 0) a temperature is refused: 1/t overflows float32
MAX_DEPTH = 64  # JSON nesting a request may have (a deeper body is refused, never recursed into)


@dataclass
class ApiError(Exception):
    """A refused request: its HTTP status and the OpenAI error body
    ``{"error": {"message", "type", "param", "code"}}``."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """A chat message; content is text, or a list of text parts (joined)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[_Part]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions``. Fields OpenAI defines and sinklab does not use are
    accepted and ignored when they are of their type; ``n`` > 1, tools and the like are refused."""

    model_config = ConfigDict(extra="ignore", strict=False)
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    session_id: str | None = None
    tools: None = None
    user: str | None = None

    @field_validator("temperature")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        if value is not None and 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None and not -(2**63) <= value < 2**64:
            raise ValueError("must fit in 64 bits (-2**63 to 2**64 - 1)")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else value or []
        if len(items) > 4 or any(not s for s in items):
            raise ValueError("at most 4 non-empty stop strings")
        return value

    @field_validator("session_id")
    @classmethod
    def _session_id(cls, value: str | None) -> str | None:
        if value is not None and not SESSION_ID.fullmatch(value):
            raise ValueError("a session_id is 1 to 64 characters of A-Z, a-z, 0-9, _ and -")
        return value

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def parse_request(body: bytes) -> ChatRequest:
    """The request in ``body``, or an :class:`ApiError` (400) naming the first bad field."""
    data = load_json(body)
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}", code="invalid_value", param=where) from None


def load_json(body: bytes) -> Any:
    """A request body's JSON, or an :class:`ApiError` (400): not JSON, nested deeper than
    :data:`MAX_DEPTH` (checked without recursion, before parsing), or holding a string that is
    not Unicode text (a lone surrogate such as ``"\\ud800"`` cannot be tokenized)."""
    from sinklab.safeio import json_depth_ok

    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and not json_depth_ok(
        body.decode("utf-8", "replace"), MAX_DEPTH
    ):
        raise ApiError(
            400, f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json"
        )
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
    todo = [data]
    while todo:  # every string, keys too: one that is not UTF-8-encodable is refused
        item = todo.pop()
        if isinstance(item, dict):
            todo += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            todo += item
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(
                    400,
                    "the request holds a lone UTF-16 surrogate (e.g. \\ud800), which is not "
                    "text; send valid Unicode",
                    code="invalid_value",
                ) from None
    return data


def completion_id() -> str:
    import secrets

    return "chatcmpl-" + secrets.token_hex(12)


def completion(
    cid: str, model: str, reply: str, finish: str, usage: dict[str, int], extra: dict[str, Any]
) -> dict[str, Any]:
    """A whole (not streamed) chat completion."""
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply},
                "finish_reason": finish,
                "logprobs": None,
            }
        ],
        "usage": usage,
        **extra,
    }


def chunk(
    cid: str, model: str, delta: dict[str, str], finish: str | None, extra: dict[str, Any]
) -> dict[str, Any]:
    """One server-sent chunk of a streamed completion."""
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        **extra,
    }


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
