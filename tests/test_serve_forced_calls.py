"""Forced tool calls (``tool_choice`` ``"required"`` or a named function) by the grammar alone:
rows of random logits (no model), masked by :meth:`Formats.tool_calls` and sampled through the
server's own step, always end on a stop token with a reply that :func:`parse_calls` reads as
calls of the allowed tools whose arguments a hand-written validator accepts; in Qwen's
``<tool_call>`` blocks (the markers are added tokens, reached by id) and, for a template that
names no markers, as one bare JSON object. The served route is in tests/test_serve_tools.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from sinklab.serve.grammar import Formats
from sinklab.serve.sampling import Sampling
from sinklab.serve.tools import call_markers, parse_calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10},
                       "format": {"enum": ["12h", "24h"]}},
        "required": ["city", "format"], "additionalProperties": False}}},
]  # fmt: skip


def _valid(name: str, args: dict) -> bool:
    """TOOLS' parameters, checked by hand (independent of the grammar engine)."""
    if not (isinstance(args.get("city"), str) and len(args["city"]) <= 10):
        return False
    if name == "get_weather":
        return set(args) == {"city"}
    return (
        name == "get_time" and set(args) == {"city", "format"} and args["format"] in ("12h", "24h")
    )


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    from sinklab.models.zoo import ZOO, dequantized_dir, is_ready

    if name == "smollm2-135m":
        from sinklab.models.loading import load_model

        return load_model(name).tokenizer
    folder = dequantized_dir(ZOO[name])
    if not is_ready(folder):
        pytest.fail(f"{name} is not installed: run `sinklab models install {name}`")
    return AutoTokenizer.from_pretrained(folder)


def _sample(tok, fmt, formats: Formats, stops: list[int], seed: int, temperature: float) -> str:
    gen = torch.Generator().manual_seed(seed)
    constraint, out, vocab = formats.constraint(fmt), [], formats.vocab
    for _ in range(400):
        row = torch.randn(vocab, generator=gen) * 4
        pick = Sampling(temperature=temperature).pick(
            row, Counter(), gen, constraint.allowed(vocab)
        )
        constraint.accept(pick)
        if pick in stops:
            return tok.decode(out)
        out.append(pick)
    pytest.fail(f"seed {seed}: no stop token in 400 steps")


@pytest.mark.integration
@pytest.mark.parametrize(
    ("model", "forced", "parallel"),
    [
        ("qwen2.5-0.5b", TOOLS, True),  # "required", several calls allowed
        ("qwen2.5-0.5b", TOOLS, False),  # "required", one call
        ("qwen2.5-0.5b", TOOLS[1:], True),  # a named function
        ("smollm2-135m", TOOLS, False),  # a template without markers: a bare JSON object
    ],
)
def test_random_logits_under_a_forced_call_grammar_always_write_calls(model, forced, parallel):
    tok = _tokenizer(model)
    markers = call_markers(tok) if model.startswith("qwen") else None
    if model.startswith("qwen"):  # Qwen's template asks for blocks; its markers are tokens
        assert markers == (f"<[{tok.convert_tokens_to_ids('<tool_call>')}]>",
                           f"<[{tok.convert_tokens_to_ids('</tool_call>')}]>")  # fmt: skip
    else:
        assert call_markers(tok) is None  # SmolLM2's template renders no tools at all
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    formats = Formats(tok, len(tok), sorted(set(stops)))
    fmt = formats.tool_calls(forced, markers, parallel)
    names = {t["function"]["name"] for t in forced}
    counts = []
    for seed, temperature in [(0, 0.0), (1, 1.0), (2, 1.0), (3, 1.0)]:
        text = _sample(tok, fmt, formats, stops, seed, temperature)
        content, calls = parse_calls(text, names, forced=True)
        assert calls and content is None, text
        for call in calls:
            assert call["function"]["name"] in names, text
            assert _valid(call["function"]["name"], json.loads(call["function"]["arguments"]))
        if markers is not None:
            assert text.startswith("<tool_call>") and text.rstrip().endswith("</tool_call>")
        counts.append(len(calls))
    if not parallel:
        assert counts == [1] * 4


def test_a_forced_reply_cut_mid_call_keeps_its_finished_calls():
    """Cut by max_tokens inside its second block, a forced reply keeps the first call; the same
    text not forced is the model's text (a block that is not a call)."""
    done = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    text = done + '\n<tool_call>\n{"name": "get_ti'
    content, calls = parse_calls(text, {"get_weather", "get_time"}, forced=True)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert parse_calls(text, {"get_weather", "get_time"}) == (text, [])


def test_parameters_the_grammar_cannot_enforce_are_refused_naming_them(smollm2):
    from sinklab.serve.protocol import ApiError, parse_request

    tok = smollm2.tokenizer
    formats = Formats(tok, len(tok), [tok.eos_token_id])
    guided = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "x-guidance": {"lenient": True}}}}]  # fmt: skip
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": guided,
            "tool_choice": "required"}  # fmt: skip
    with pytest.raises(ApiError) as err:  # any tool's, when the request is read
        parse_request(json.dumps(body).encode())
    assert err.value.param == "tools.0.function.parameters"
    odd = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "propertyNames": {"pattern": "^a"}}}}]  # fmt: skip
    with pytest.raises(ApiError) as err:
        formats.tool_calls(odd, None, False)
    assert (
        err.value.param == "tools"
        and "not a JSON schema this server can enforce" in err.value.message
    )


def test_references_are_rebased_under_names_and_data_is_not():
    """``call_schema`` rebases every local ``$ref`` to where the parameters sit, also under a
    property whose name is a keyword elsewhere (``default``), and leaves data (a ``const``)."""
    from sinklab.serve.tools import call_schema

    params = {"type": "object", "$defs": {"M": {"type": "string"}},
              "properties": {"default": {"$ref": "#/$defs/M"}, "x": {"$ref": "#"},
                             "c": {"const": {"$ref": "#/y"}}}}  # fmt: skip
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    got = call_schema(tool, "#/anyOf/1")["properties"]["arguments"]["properties"]
    assert got["default"] == {"$ref": "#/anyOf/1/properties/arguments/$defs/M"}
    assert got["x"] == {"$ref": "#/anyOf/1/properties/arguments"}
    assert got["c"] == {"const": {"$ref": "#/y"}}
