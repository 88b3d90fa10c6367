"""Structured output: ``response_format`` ``{"type": "json_object"}`` or ``{"type":
"json_schema", "json_schema": {"name": ..., "schema": {...}}}`` (README, "Serving": structured
output).

Each step's logits are masked to the tokens that keep the reply a prefix of a document the
format accepts, before the sampling step (:mod:`.sampling`: bias, penalties, temperature, top-k
and top-p then act on the allowed tokens only). The masks come from llguidance, the grammar
engine vLLM, SGLang and llama.cpp use for the same job: a JSON schema is compiled into a grammar
once per request, and a matcher walks it token by token. The chat's end-of-turn tokens are the
grammar's end tokens, so they are allowed exactly where the document is complete: a finished
document ends the reply (finish reason ``stop``); a reply cut by ``max_tokens`` is a prefix of one
(``length``), as OpenAI's is. ``logprobs`` stay the model's own, before the mask.

A schema the grammar compiler cannot take is a 400 naming it, before any session is touched;
``strict`` is accepted either way (the mask always holds: the reply follows the schema whether
or not the client asked for strictness); a keyword the compiler would not enforce (its warning,
e.g. ``propertyNames``) and llguidance's own ``x-guidance`` options are refused.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import torch

from sinklab.serve.protocol import ApiError
from sinklab.serve.sampling import TurnFailed
from sinklab.serve.tools import call_schema, declared_ids

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # json_object: any JSON object
# Between two JSON tokens, at most 16 spaces, newlines or tabs: room for indented output, and a
# model that falls into writing whitespace (small ones do under llguidance's default, any
# amount) still has to write the document; the schema's "x-guidance" cannot widen it.
WHITESPACE = r"[\x20\x0A\x09]{0,16}"
_BITS = torch.arange(32, dtype=torch.int32)


def _bad(message: str, where: str = "response_format") -> ApiError:
    return ApiError(400, f"{where}: {message}", code="invalid_value", param=where)


class FormatFailed(TurnFailed):
    """The grammar engine left this reply's matcher in an error state (a parser limit)."""

    code = "format_failed"


class Constraint:
    """One reply's matcher: which tokens may come next, and each chosen token consumed."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        self.matcher, self.vocab = matcher, vocab

    def allowed(self, size: int) -> torch.Tensor:
        """(size,) bool, for a logits row of ``size``: the tokens that keep the reply a prefix of
        an accepted document (ids past the tokenizer's vocabulary never are)."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        if self.matcher.is_error():  # e.g. a parser limit this schema ran into
            raise FormatFailed(
                f"response_format: the grammar engine stopped: {self.matcher.get_error()}", 400
            )
        bits = ((words[:, None] >> _BITS) & 1).bool().reshape(-1)
        out = torch.zeros(size, dtype=torch.bool)
        n = min(size, self.vocab, bits.numel())
        out[:n] = bits[:n]
        return out

    def accept(self, token: int) -> None:
        """Consume the chosen ``token`` (always one :meth:`allowed` gave)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")


@dataclass(frozen=True)
class Format:
    """A request's checked format: the llguidance grammar and what the 400s call it."""

    grammar: str
    name: str


class Formats:
    """The engine's grammar compiler: one llguidance tokenizer for the model (built on first
    use, about half a second), whose end tokens are the chat's ``stops``."""

    def __init__(self, tokenizer: Any, vocab: int, stops: list[int]) -> None:
        self.tokenizer, self.vocab, self.stops = tokenizer, vocab, list(stops)
        self._ll: Any = None
        self._lock = threading.Lock()

    def _llg(self, where: str = "response_format") -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                try:
                    self._ll = llguidance.hf.from_tokenizer(
                        self.tokenizer, n_vocab=self.vocab, eos_token=self.stops
                    )
                except Exception as err:  # a slow (Python) tokenizer: llguidance needs a fast one
                    self._ll = err
            if isinstance(self._ll, Exception):
                raise _bad(
                    "this model's tokenizer cannot drive the grammar engine "
                    f"({type(self._ll).__name__}: {self._ll}); structured output needs a fast "
                    "(tokenizers) tokenizer",
                    where,
                )
            return self._ll

    def check(
        self,
        response_format: dict[str, Any] | None,
        where: str = "response_format",
        schema_at: str = "response_format.json_schema.schema",
    ) -> Format | None:
        """The grammar for ``response_format`` (already shaped by the protocol: ``{"type":
        ..., "json_schema": {"name", "schema"}}``), ``None`` for plain text, or a 400 naming
        what the compiler refused (``where`` the format, ``schema_at`` its schema: the chat
        route's names by default; the Responses route's ``text.format`` has its own)."""
        kind = (response_format or {}).get("type", "text")
        if kind == "text":
            return None
        from llguidance import LLMatcher

        if kind == "json_object":
            schema, name = ANY_OBJECT, "json_object"
        else:
            spec = response_format["json_schema"]  # type: ignore[index]
            schema = spec.get("schema") or {}  # none given: any JSON value, as OpenAI's
            name, where = spec["name"], schema_at
        if isinstance(schema, dict) and "x-guidance" in schema:
            # llguidance reads compile options there (lenient, separators): a client could turn
            # enforcement off or write something that is not JSON
            raise _bad("x-guidance (grammar-engine options) is not accepted in a schema", where)
        try:
            grammar = LLMatcher.grammar_from_json_schema(
                json.dumps(schema), overrides={"whitespace_pattern": WHITESPACE}
            )
        except (ValueError, TypeError) as err:
            raise _bad(f"not a JSON schema this server can enforce: {err}", where) from None
        failed, notes = LLMatcher.validate_grammar_with_warnings(grammar, self._llg(where))
        if failed or notes:  # a warning is a keyword the compiler would not enforce: refused
            first = (notes or ["invalid"])[0].splitlines()[0]
            raise _bad(f"not a JSON schema this server can enforce: {first}", where)
        return Format(grammar, name)

    def tool_calls(
        self, tools: list[dict[str, Any]], markers: tuple[str, str] | None, parallel: bool
    ) -> Format:
        """The grammar of a reply that is calls of ``tools`` and nothing else (``tool_choice``
        ``"required"``, or one named function): each call ``{"name": ..., "arguments": ...}``
        with the tool's ``parameters`` as the arguments' schema, inside the template's
        ``markers`` (:func:`.tools.call_markers`; one call or, when ``parallel``, several on
        lines of their own), or one bare JSON object where the template names no markers. A
        tool's parameters this server cannot enforce are a 400 naming them."""
        from llguidance import LLMatcher

        # one grammar embeds every tool: a base URI or an anchor may name one schema only
        seen: dict[str, tuple[str, str]] = {}
        for tool in tools:
            name = tool["function"]["name"]
            found = declared_ids(tool["function"].get("parameters") or {})
            for uri, schemas in sorted(found.items()):
                for schema in schemas:
                    text = json.dumps(schema, sort_keys=True)
                    first = seen.setdefault(uri, (name, text))
                    if first[1] != text:
                        where = f"{first[0]!r} and {name!r}" if first[0] != name else repr(name)
                        what = "anchor" if "#" in uri else "$id"
                        raise _bad(
                            f"the parameters of {where} declare {what} {uri!r} for two different "
                            f"schemas; give each its own {what}",
                            "tools",
                        )
        if len(tools) == 1:
            body = call_schema(tools[0])
        else:
            body = {"anyOf": [call_schema(t, f"#/anyOf/{i}") for i, t in enumerate(tools)]}
        body = {**body, "x-guidance": {"whitespace_pattern": WHITESPACE}}
        if markers is None:
            lark = f"start: %json {json.dumps(body)}"
        else:
            start = 'call ("\\n" call)*' if parallel else "call"
            lark = (
                f"start: {start}\n"
                f'call: {markers[0]} "\\n" body "\\n" {markers[1]}\n'
                f"body: %json {json.dumps(body)}"
            )
        why = "a tool's parameters are not a JSON schema this server can enforce"
        try:
            grammar = LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError) as err:
            raise _bad(f"{why}: {err}", "tools") from None
        failed, notes = LLMatcher.validate_grammar_with_warnings(grammar, self._llg("tools"))
        if failed or notes:
            first = (notes or ["invalid"])[0].splitlines()[0]
            raise _bad(f"{why}: {first}", "tools")
        return Format(grammar, "tool-call")

    def constraint(self, fmt: Format) -> Constraint:
        """A fresh matcher for one reply."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llg(), fmt.grammar, log_level=0)
        if matcher.is_error():
            raise _bad(f"the grammar failed to start: {matcher.get_error()}")
        return Constraint(matcher, self.vocab)
