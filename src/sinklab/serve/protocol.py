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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sinklab.serve.sampling import Sampling
from sinklab.serve.tools import Tool, ToolCall, template_call

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
    """A chat message; content is text, or a list of text parts (joined). ``developer`` is
    OpenAI's newer name for ``system`` and is read as one. An assistant message may carry
    ``tool_calls`` (its content then may be null) and a ``tool`` message answers one by its
    ``tool_call_id`` (:mod:`.tools`; only on a model whose template renders tools)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_Part] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, value: Any) -> Any:
        if value == "function":
            raise ValueError("'function' messages are deprecated by OpenAI: send 'tool' messages")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, value: list[ToolCall] | None) -> list[ToolCall] | None:
        for call in value or []:
            template_call(call)  # its arguments must be JSON
        return value

    @model_validator(mode="after")
    def _shape(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and (self.tool_call_id is None or self.content is None):
            raise ValueError("a tool message needs its tool_call_id and content")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only beside an assistant's tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_calls:
            out["tool_calls"] = [template_call(c) for c in self.tool_calls]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        return out

    def uses_tools(self) -> bool:
        return self.role == "tool" or bool(self.tool_calls)


MAX_N = 16  # choices of one chat request (:mod:`.choices` answers n > 1)

# Message fields OpenAI defines that sinklab cannot honour: refused unless absent or null.
MESSAGE_REFUSED = {
    "name": "message names are not supported (the chat template does not render them)",
    "function_call": "function_call is deprecated by OpenAI: send tool_calls",
    "audio": "audio is not supported",
}

# Request fields OpenAI defines that sinklab does not honour: each refused with its reason
# unless absent, null or one of the values named (which ask for nothing: OpenAI's defaults).
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": (([],), "functions are deprecated by OpenAI: send tools"),
    "function_call": (("none",), "function_call is deprecated by OpenAI: send tool_choice"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    "reasoning_effort": ((), "reasoning effort is not supported (no reasoning model)"),
    "store": ((False,), "stored completions are not supported"),
    "service_tier": (("auto", "default"), "service tiers are not supported"),
    "verbosity": ((), "verbosity is not supported"),
}


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


def refuse_description(value: str | None) -> str | None:
    """A format's ``description``: OpenAI shows it to the model; here only the schema reaches
    the reply (as its mask), so a non-empty one is refused rather than dropped."""
    if value:
        raise ValueError(
            "a format description is not shown to the model by this server (the schema is "
            "enforced as a mask); send it as a system message, or leave it out"
        )
    return value


class _JsonSchema(BaseModel):
    """OpenAI's ``response_format.json_schema``: the schema the reply must follow
    (:mod:`.grammar`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=False)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None  # refused unless empty: :func:`refuse_description`
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the mask always holds (:mod:`.grammar`)

    @field_validator("description")
    @classmethod
    def _description(cls, value: str | None) -> str | None:
        return refuse_description(value)


class _ResponseFormat(BaseModel):
    """``text`` (the default), ``json_object`` (any JSON object) or ``json_schema``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> _ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.json_schema is not None:
            out["json_schema"] = {"name": self.json_schema.name, "schema": self.json_schema.schema_}
        return out


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions``. Every field is honoured (sampling: :mod:`.sampling`);
    a field OpenAI defines that is not (:data:`REFUSED`), and any unknown field, is refused by
    :func:`parse_request` with a 400 naming it."""

    model_config = ConfigDict(extra="ignore", strict=False)
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)  # an extension (vLLM, llama.cpp): 0 is off
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int | None = None
    response_format: _ResponseFormat | None = None
    session_id: str | None = None
    user: str | None = None  # an end-user id, as OpenAI's: it changes nothing in the reply
    metadata: dict[str, str] | None = None  # as OpenAI's: tags, it changes nothing either
    tools: list[Tool] | None = None  # rendered by the chat template (:mod:`.tools`)
    # "auto", "none", "required" or {"type": "function", "function": {"name": ...}}: the last
    # two force calls, by a grammar (:meth:`.grammar.Formats.tool_calls`)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: the reply stops after its first call

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        if (
            isinstance(value, dict)
            and set(value) == {"type", "function"}
            and value["type"] == "function"
            and isinstance(value["function"], dict)
            and set(value["function"]) == {"name"}
            and isinstance(value["function"]["name"], str)
        ):
            return value
        raise ValueError(
            "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': NAME}}"
        )

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in value or []]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # a call names its function: two of one name could not be told apart
            raise ValueError(f"function names must differ; {', '.join(map(repr, twice))} is twice")
        return value

    def tools_on(self) -> bool:
        """Whether the request gives tools the model may call (``tool_choice`` not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The tools a reply must call (``tool_choice`` ``"required"``: any of them; a named
        function: that one), as the template renders them; ``None`` when no call is forced."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        if self.tool_choice == "required":
            return tools
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            return [t for t in tools if t["function"]["name"] == name]
        return None

    @field_validator("n")
    @classmethod
    def _n(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_N:
            raise ValueError(f"must be 1 to {MAX_N} choices")
        return value

    @field_validator("top_p", "presence_penalty", "frequency_penalty")
    @classmethod
    def _finite_number(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not re.fullmatch(r"[0-9]{1,12}", key):  # ASCII digits (str.isdigit takes '٣')
                raise ValueError(f"key {key!r} is not a token id (a non-negative integer)")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"the bias of token {key} must be in -100..100")
        if value is not None and len(value) > 1024:
            raise ValueError("at most 1024 tokens")
        return value

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
        if value is not None and not 0 <= value < 2**64:
            raise ValueError("must be an integer in 0..2**64 - 1 (64 bits)")
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

    def sampling(self) -> Sampling:
        """The request's sampling step (:mod:`.sampling`; the temperature is the engine's)."""
        return Sampling(
            temperature=0.0,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=bool(self.logprobs),
            top_logprobs=self.top_logprobs or 0,
        )

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def parse_request(body: bytes) -> ChatRequest:
    """The request in ``body``, or an :class:`ApiError` (400) naming the first bad field."""
    data = load_json(body)
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    _refuse_unsupported(data)
    try:
        req = ChatRequest.model_validate(data, strict=True)  # no "2" for 2, no true for 1
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        msg = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{where}: {msg}", code="invalid_value", param=where) from None
    if req.tool_choice not in (None, "none") and not req.tools:
        shown = repr(req.tool_choice) if isinstance(req.tool_choice, str) else "a named function"
        raise ApiError(
            400,
            f"tool_choice: {shown} needs tools to choose from",
            code="invalid_value",
            param="tool_choice",
        )
    if req.parallel_tool_calls is not None and not req.tools:  # OpenAI's 400 too
        raise ApiError(
            400,
            "parallel_tool_calls: only allowed when tools are given; send no "
            "parallel_tool_calls without tools",
            code="invalid_value",
            param="parallel_tool_calls",
        )
    if req.stop and req.forced_tools() is not None:
        raise ApiError(
            400,
            "stop: a forced tool_choice writes calls under a grammar, which a stop string could "
            "cut mid-call; send no stop with tool_choice 'required' or a named function",
            code="unsupported_parameter",
            param="stop",
        )
    if req.forced_tools() == []:
        raise ApiError(
            400,
            f"tool_choice: names {req.tool_choice['function']['name']!r}, which is not one of "  # type: ignore[index]
            "this request's tools",
            code="invalid_value",
            param="tool_choice",
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(
            400,
            "top_logprobs: logprobs must be true when top_logprobs is given",
            code="invalid_value",
            param="top_logprobs",
        )
    return req


def _refuse_unsupported(data: dict[str, Any]) -> None:
    """A 400 naming the first field that is not honoured (an unknown one, or one of
    :data:`REFUSED` / :data:`MESSAGE_REFUSED` with a value that asks for something)."""
    known = set(ChatRequest.model_fields) | set(REFUSED)
    for name, value in data.items():
        if name not in known:
            raise ApiError(
                400,
                f"{name}: unsupported parameter (this server does not know it; see the README's "
                "Serving section for the parameters it honours)",
                code="unsupported_parameter",
                param=name,
            )
        if name in REFUSED and value is not None and value not in REFUSED[name][0]:
            raise ApiError(400, f"{name}: {REFUSED[name][1]}", code="unsupported_parameter",
                           param=name)  # fmt: skip
    messages = data.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        for name, why in MESSAGE_REFUSED.items():
            if isinstance(m, dict) and m.get(name) not in (None, [], ""):
                where = f"messages.{i}.{name}"
                raise ApiError(400, f"{where}: {why}", code="unsupported_parameter", param=where)


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
    cid: str,
    model: str,
    reply: str,
    finish: str,
    usage: dict[str, Any],
    extra: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
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
                "logprobs": logprobs,
            }
        ],
        "usage": usage,
        **extra,
    }


def chunk(
    cid: str,
    model: str,
    delta: dict[str, str],
    finish: str | None,
    extra: dict[str, Any],
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One server-sent chunk of a streamed completion (``logprobs``: its tokens' entries)."""
    lp = {"content": logprobs} if logprobs is not None else None
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
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
