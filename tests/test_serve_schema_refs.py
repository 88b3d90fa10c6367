"""A forced call's grammar keeps what each tool's schema references (the review of cd66fc3):
the calls' grammar embeds every tool's ``parameters`` under ``#/properties/arguments`` (or
``#/anyOf/i/...`` beside other tools), so local ``$ref``s are rebased, except inside a schema
with its own ``$id`` (a resource whose references resolve against it); an ``$anchor`` declares
no base, and draft-07's ``"$id": "#name"`` is that anchor; one ``$id`` (resolved) naming two
different schemas is a 400 ``tools`` that says why. Each case is
compiled by the server's own :class:`~sinklab.serve.grammar.Formats` (llguidance) and driven
with SmolLM2's tokenizer: a call the schema allows is accepted whole, one it forbids is not."""

from __future__ import annotations

import json

import pytest

from sinklab.serve.protocol import ApiError

CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
        "required": ["name"], "additionalProperties": False}  # fmt: skip
GOOD = {"city": {"name": "Oslo"}}
BAD = {"city": {"name": "far too long a name"}}  # the referenced schema's maxLength


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _book(**extra) -> dict:
    return _tool("book", {"$defs": {"City": CITY}, "type": "object", **extra,
                          "properties": {"city": {"$ref": "#/$defs/City"}},
                          "required": ["city"], "additionalProperties": False})  # fmt: skip


OTHER = _tool("count", {"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"], "additionalProperties": False})  # fmt: skip


@pytest.fixture(scope="module")
def formats():
    from transformers import AutoTokenizer

    from sinklab.models.zoo import ZOO, dequantized_dir, is_ready
    from sinklab.serve.grammar import Formats

    folder = dequantized_dir(ZOO["smollm2-135m"])
    if not is_ready(folder):
        pytest.fail("smollm2-135m is not installed: run `sinklab models install smollm2-135m`")
    tok = AutoTokenizer.from_pretrained(folder)
    return Formats(tok, len(tok), [tok.eos_token_id])


def _accepts(formats, fmt, name: str, arguments: dict) -> bool:
    """Whether the compiled calls' grammar takes this call whole."""
    from llguidance import LLMatcher

    text = json.dumps({"name": name, "arguments": arguments})
    ids = formats.tokenizer.encode(text, add_special_tokens=False)
    matcher = LLMatcher(formats._llg(), fmt.grammar, log_level=0)
    if matcher.validate_tokens(ids) < len(ids):
        return False
    matcher.consume_tokens(ids)
    return matcher.is_accepting()


CASES = {
    "defs": _book(),
    "defs-under-own-id": _book(**{"$id": "https://example.com/book.json"}),
    "relative-id": _book(**{"$id": "book.json"}),
    "anchor": _book(**{"$anchor": "book"}),  # 2020-12's anchor: no base of its own, rebased
}


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside-another"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_references_resolve_where_the_parameters_sit(formats, case, beside):
    tools = [OTHER, CASES[case]] if beside else [CASES[case]]  # beside: under #/anyOf/1
    fmt = formats.tool_calls(tools, None, parallel=False)
    assert _accepts(formats, fmt, "book", GOOD)
    assert not _accepts(formats, fmt, "book", BAD)  # the referenced schema is enforced
    assert _accepts(formats, fmt, "count", {"n": 3}) == beside


def test_a_nested_id_and_a_pointer_into_it(formats):
    """A property's schema with its own ``$id`` keeps its local reference; a reference from
    outside into it by JSON pointer is rebased with the rest and still lands on it."""
    inner = {"$id": "https://example.com/city.json", "$defs": {"Name": CITY["properties"]["name"]},
             "type": "object", "properties": {"name": {"$ref": "#/$defs/Name"}},
             "required": ["name"], "additionalProperties": False}  # fmt: skip
    tool = _tool("book", {"type": "object", "additionalProperties": False,
                          "properties": {"city": inner, "home": {"$ref": "#/properties/city"}},
                          "required": ["city", "home"]})  # fmt: skip
    fmt = formats.tool_calls([OTHER, tool], None, parallel=False)
    assert _accepts(formats, fmt, "book", GOOD | {"home": {"name": "Bergen"}})
    assert not _accepts(formats, fmt, "book", GOOD | {"home": {"name": "far too long a name"}})
    assert not _accepts(formats, fmt, "book", BAD | {"home": {"name": "Bergen"}})


def test_one_id_for_two_different_schemas_is_a_400(formats):
    same = {"$id": "https://example.com/args.json"}
    a, b = _book(**same), _tool("count", {**OTHER["function"]["parameters"], **same})
    with pytest.raises(ApiError) as err:
        formats.tool_calls([a, b], None, parallel=False)
    assert err.value.status == 400 and err.value.param == "tools", err.value
    assert "https://example.com/args.json" in err.value.message, err.value
    formats.tool_calls([a], None, parallel=False)  # alone it is one resource: compiled


def test_ids_that_name_one_schema_each_compile(formats):
    """What the check above must let through: one shared schema under one ``$id`` in two
    tools, and one relative ``$id`` under two different bases (two resources)."""
    city = {"$id": "https://example.com/city.json", **CITY}
    a = _tool("book", {"type": "object", "properties": {"city": city}, "required": ["city"],
                       "additionalProperties": False})  # fmt: skip
    b = _tool("visit", a["function"]["parameters"])
    fmt = formats.tool_calls([a, b], None, parallel=False)
    assert _accepts(formats, fmt, "visit", GOOD) and not _accepts(formats, fmt, "visit", BAD)
    rel = [_book(**{"$id": f"https://example.com/{n}/"}) for n in ("a", "b")]
    for tool in rel:
        tool["function"]["parameters"]["$defs"]["City"] = {"$id": "city.json", **CITY}
    rel[1]["function"]["name"] = "visit"
    shorter = {"type": "string", "maxLength": 6}  # a different schema under the same relative id
    rel[1]["function"]["parameters"]["$defs"]["City"]["properties"] = {"name": shorter}
    fmt = formats.tool_calls(rel, None, parallel=False)
    assert _accepts(formats, fmt, "visit", GOOD) and not _accepts(formats, fmt, "book", BAD)
    seven = {"city": {"name": "Tromsoe"}}  # each tool's own City: 8 characters, then 6
    assert _accepts(formats, fmt, "book", seven) and not _accepts(formats, fmt, "visit", seven)
    # one URI spelled two ways (relative under a base with a capital host, and absolute) is one
    # name: the same schema under it compiles, a different one is refused
    bases = {"book": ("https://Example.com/t/", "city.json"),
             "visit": ("https://example.com/u/", "https://example.com/t/city.json")}  # fmt: skip
    for city, refused in ((CITY, False), ({**CITY, "properties": {"name": shorter}}, True)):
        spelled = [
            _tool(
                n,
                {
                    "$id": base,
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"city": {"$id": c, **(CITY if n == "book" else city)}},
                    "required": ["city"],
                },
            )
            for n, (base, c) in bases.items()
        ]
        if refused:
            with pytest.raises(ApiError, match=r"https://example\.com/t/city\.json"):
                formats.tool_calls(spelled, None, parallel=False)
        else:
            formats.tool_calls(spelled, None, parallel=False)


@pytest.mark.parametrize(
    "mark",
    [{"$id": "https://example.com/city.json"}, {"$anchor": "city"}, {"$id": "#city"}],
    ids=["nested-id", "anchor", "draft-07-anchor"],
)
def test_one_name_for_two_different_nested_schemas_is_a_400(formats, mark):
    """Two tools each nesting a schema under one name (a base URI or, at the shared root, an
    anchor) that differ: a reference could find either, so it is refused."""
    shorter = {**CITY, "properties": {"name": {"type": "string", "maxLength": 6}}}
    tools = [_tool(n, {"type": "object", "properties": {"city": {**mark, **c}},
                       "required": ["city"], "additionalProperties": False})
             for n, c in (("book", CITY), ("visit", shorter))]  # fmt: skip
    with pytest.raises(ApiError) as err:
        formats.tool_calls(tools, None, parallel=False)
    assert err.value.param == "tools" and "two different schemas" in err.value.message, err.value
    tools[1]["function"]["parameters"]["properties"]["city"] = {**mark, **CITY}
    formats.tool_calls(tools, None, parallel=False)  # the same schema twice: one, compiled


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside-another"])
def test_a_draft_07_anchor_id_means_an_anchor(formats, beside):
    """``"$id": "#city"`` is draft-07's anchor: written as ``$anchor`` for the compiler, a
    ``$ref`` to it resolves, and one with no reference to it compiles as before."""
    tool = _tool("book", {"$defs": {"City": {"$id": "#city", **CITY}}, "type": "object",
                          "properties": {"city": {"$ref": "#city"}}, "required": ["city"],
                          "additionalProperties": False})  # fmt: skip
    fmt = formats.tool_calls([OTHER, tool] if beside else [tool], None, parallel=False)
    assert _accepts(formats, fmt, "book", GOOD) and not _accepts(formats, fmt, "book", BAD)
    bare = _tool("visit", _book(**{"$id": "#"})["function"]["parameters"])
    formats.tool_calls([_book(**{"$id": "#book"}), bare], None, parallel=False)
