"""Tools (function calling) for ``sinklab serve`` (docs/serve.md#tools).

The request's ``tools`` are rendered by the model's own chat template (``apply_chat_template(...,
tools=...)``); a template that does not render them is refused with one precise 400, never
served as if it had read them. The reply is parsed for calls in the model's own format: Qwen's
(and Hermes') ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, or a reply
that is one such JSON object alone (what small Qwen models write). A call is taken only when it
parses as JSON, names one of the request's tools and has object arguments; anything else stays
the reply's text. The session keeps the model's text as it wrote it (so its cache and its
conversation agree), and remembers the calls as the client got them, so a client that sends the
conversation back (the assistant message with its ``tool_calls``) continues the same session.
A forced call (``tool_choice`` ``"required"`` or a named function) is written under a grammar of
:func:`call_schema` objects in :func:`call_markers` (docs/serve.md#forced-calls).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Literal
from urllib.parse import urljoin, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
END = "</tool_call>"  # a stop after the first call when parallel_tool_calls is false


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """A function's arguments are one JSON object (OpenAI's rule, and what a call carries:
        :func:`parse_calls`); the grammar engine's own options are not a client's to set."""
        if value is not None and value.get("type", "object") not in ("object", ["object"]):
            raise ValueError(
                f"a function's parameters are a JSON schema of type 'object', got type "
                f"{value['type']!r}"
            )
        if value is not None and _has_key(value, "x-guidance"):  # could turn enforcement off
            raise ValueError("x-guidance (grammar-engine options) is not accepted in a schema")
        return value


class Tool(BaseModel):
    """One of a request's ``tools`` (OpenAI's function tool)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ToolFunction


class CallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call in an assistant message a client sends back."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: CallFunction


def template_call(call: ToolCall) -> dict[str, Any]:
    """A call as chat templates read it (its arguments an object: they render it as JSON)."""
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        raise ValueError(f"the arguments of call {call.id!r} are not JSON") from None
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": args}}  # fmt: skip


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a request's tools (a probe tool's name
    must appear in the rendering)."""
    probe = [{"type": "function", "function": {"name": "sinklab_probe_tool", "parameters": {}}}]
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], tools=probe, tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip
    except Exception:
        return False
    return "sinklab_probe_tool" in text


def call_markers(tokenizer: Any) -> tuple[str, str] | None:
    """How the template asks for calls, as a grammar writes it (:mod:`.grammar`): Qwen's and
    Hermes' ``<tool_call>`` ... ``</tool_call>`` blocks, each marker a token of its own (``<[id]>``:
    the grammar engine reads an added token only by its id) or a string; ``None`` where the
    rendering names no such block, so that a forced call is the bare JSON object
    :func:`parse_calls` also takes."""
    probe = [{"type": "function", "function": {"name": "sinklab_probe_tool", "parameters": {}}}]
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], tools=probe, tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip
    except Exception:
        return None
    if "<tool_call>" not in text:
        return None

    def marker(piece: str) -> str:
        ids = tokenizer.encode(piece, add_special_tokens=False)
        return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(piece)

    return marker("<tool_call>"), marker(END)


def call_schema(tool: dict[str, Any], at: str = "#") -> dict[str, Any]:
    """The JSON schema of one call of ``tool`` as the templates ask for it and
    :func:`parse_calls` takes it: ``{"name": <the tool's name>, "arguments": <its parameters>}``,
    placed at the JSON pointer ``at`` of the grammar's schema: the parameters' own references
    (``#/$defs/City``, pydantic's) are rebased to where the parameters now sit."""
    params = _rebased(tool["function"].get("parameters") or {"type": "object"},
                      f"{at}/properties/arguments")  # fmt: skip
    return {
        "type": "object",
        "properties": {"name": {"const": tool["function"]["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


_DATA = frozenset({"const", "enum", "default", "examples"})  # values, not schemas: kept as sent
_NAMED = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
     "dependencies", "dependentRequired"}
)  # fmt: skip


def _has_key(node: Any, key: str) -> bool:
    """Whether ``key`` is a keyword of the schema ``node`` or of any schema inside it (not a
    property's name, nor inside data such as ``const``)."""
    if isinstance(node, list):
        return any(_has_key(v, key) for v in node)
    if not isinstance(node, dict):
        return False
    if key in node:
        return True
    for k, v in node.items():
        if k in _NAMED and isinstance(v, dict):  # name -> schema: the names are not keywords
            if any(_has_key(s, key) for s in v.values()):
                return True
        elif k not in _DATA and _has_key(v, key):
            return True
    return False


def _own_id(node: Any) -> str | None:
    """The base URI a schema node declares (JSON Schema 2020-12, as the grammar compiler reads
    it), or ``None``: a ``$id`` that is a plain ``#anchor`` (draft-07's form) names no
    resource."""
    own = node.get("$id") if isinstance(node, dict) else None
    return own if isinstance(own, str) and own and not own.startswith("#") else None


def _uri(base: str, ref: str) -> str:
    """``ref`` resolved against ``base``, an empty fragment dropped and the scheme and host in
    lower case (so two spellings of one URI compare equal)."""
    parts = urlsplit(urljoin(base, ref) if base else ref)
    return urlunsplit((parts.scheme.lower(), parts.netloc.lower(), parts.path, parts.query, ""))


def declared_ids(node: Any, base: str = "") -> dict[str, list[Any]]:
    """Each name a reference can find in the schema ``node`` (not inside data), with the
    schemas that declare it (their own ``$id``/``$anchor`` left out, so that one schema
    spelled two ways compares equal): a base URI (``$id``, resolved against the ones above it)
    and an anchor (``$anchor``, ``$dynamicAnchor`` or draft-07's ``"$id": "#name"``, as
    ``<base>#<name>``; the base is empty at the grammar's root, which every tool shares)."""
    found: dict[str, list[Any]] = {}
    own_keys = ("$id", "$anchor", "$dynamicAnchor")

    def walk(n: Any, at: str) -> None:
        if isinstance(n, list):
            for v in n:
                walk(v, at)
            return
        if not isinstance(n, dict):
            return
        bare = {k: v for k, v in n.items() if k not in own_keys}
        if (own := _own_id(n)) is not None:
            at = _uri(at, own)
            found.setdefault(at, []).append(bare)
        old = n.get("$id") if isinstance(n.get("$id"), str) and n["$id"][1:] else None
        names = [
            n.get("$anchor"),
            n.get("$dynamicAnchor"),
            old[1:] if old and old[0] == "#" else None,
        ]
        for name in {x for x in names if isinstance(x, str) and x}:
            found.setdefault(f"{at}#{name}", []).append(bare)
        for k, v in n.items():
            if k in _NAMED and isinstance(v, dict):
                for sub in v.values():
                    walk(sub, at)
            elif k not in _DATA:
                walk(v, at)

    walk(node, base)
    return found


def _rebased(node: Any, base: str, rebase: bool = True) -> Any:
    """``node`` with every local ``$ref`` (``#`` or ``#/...``) pointing under ``base`` instead
    of the root (references by URI are left to the compiler, which resolves an embedded ``$id``
    and refuses a remote one; values under ``const``, ``enum``, ``default`` and ``examples`` are
    data and stay as they are). Inside a schema with its own ``$id`` (not a plain ``#anchor``),
    a resource of its own whose local references resolve against it wherever it sits, nothing
    is rebased. A draft-07 anchor, ``"$id": "#name"``, is written as 2020-12's ``"$anchor":
    "name"`` (what it means there; the compiler reads 2020-12 and refuses the old form)."""
    if isinstance(node, dict):
        if _own_id(node) is not None:
            rebase = False
        out: dict[str, Any] = {}
        for k, v in node.items():
            if k == "$id" and isinstance(v, str) and v.startswith("#"):
                if v[1:] and "$anchor" not in node:
                    out["$anchor"] = v[1:]
            elif rebase and k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
                out[k] = base + v[1:]
            elif k in _NAMED and isinstance(v, dict):  # name -> schema: a name is no keyword
                out[k] = {name: _rebased(s, base, rebase) for name, s in v.items()}
            elif k in _DATA:
                out[k] = v
            else:
                out[k] = _rebased(v, base, rebase)
        return out
    if isinstance(node, list):
        return [_rebased(v, base, rebase) for v in node]
    return node


def parse_calls(
    text: str, names: set[str], forced: bool = False
) -> tuple[str | None, list[dict[str, Any]]]:
    """The reply ``text`` as OpenAI's message: (its content outside the calls, or None when
    nothing is left; the calls, as OpenAI returns them). No call: (text, []). ``forced``: the
    reply was written under a forced call's grammar, so an unfinished last block can only be a
    call cut by ``max_tokens``; it is dropped and the finished calls are kept."""
    calls: list[dict[str, Any]] = []
    rest = text
    blocks = list(_BLOCK.finditer(text))
    unfinished = forced and blocks and not blocks[-1].group(0).endswith(END)
    if unfinished and _call(blocks[-1].group(1), names) is None:
        text = text[: blocks[-1].start()]
        blocks.pop()
        rest = text
    if blocks:
        for m in blocks:
            call = _call(m.group(1), names)
            if call is None:
                return text, []  # a block that is not a call of these tools: the model's text
            calls.append(call)
        rest = _BLOCK.sub("", text)
    else:
        call = _call(text.strip(), names)
        if call is None:
            return text, []
        calls, rest = [call], ""
    rest = rest.strip()
    return (rest or None), calls


def _call(body: str, names: set[str]) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}  # fmt: skip


def as_sent(content: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message as a client sends it back (templates' form: arguments parsed), for
    comparing a resent conversation with the session's."""
    return {
        "content": content or "",
        "tool_calls": [
            {"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": json.loads(c["function"]["arguments"])}}
            for c in calls
        ],
    }  # fmt: skip


def seen_as(message: dict[str, Any]) -> dict[str, Any]:
    """A session's message as its client has it (a reply with calls: as the client got it)."""
    sent = message.get("sent")
    if sent is None:
        return message
    return {"role": message["role"], **sent}
