"""Structured output (``response_format`` ``json_object`` / ``json_schema``, issue 29): the mask
written down by hand on small rows, adversarial random logits that still always write a document
the schema accepts (checked by a hand-written validator, not by the grammar engine), then the
real server on the embedded SmolLM2 through the official ``openai`` client's ``parse`` and
LangChain's ``with_structured_output``: a schema-valid object where the unconstrained reply to
the same prompt is not JSON, the stream equal to the whole reply, and every bad format refused
with a 400 naming it (docs/serve.md#structured-output)."""

from __future__ import annotations

import json
from collections import Counter

import openai
import pytest
import torch
from pydantic import BaseModel

from serving import Served
from sinklab.serve.grammar import Formats
from sinklab.serve.sampling import NoAllowedToken, Sampling

MODEL = "smollm2-135m"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "color", "tags"],
    "additionalProperties": False,
}


def _valid(doc: object) -> bool:
    """SCHEMA, checked by hand (independent of the grammar engine)."""
    return (
        isinstance(doc, dict)
        and set(doc) == {"name", "ok", "color", "tags"}
        and isinstance(doc["name"], str)
        and len(doc["name"]) <= 12
        and isinstance(doc["ok"], bool)
        and doc["color"] in ("red", "green", "blue")
        and isinstance(doc["tags"], list)
        and len(doc["tags"]) <= 3
        and all(t in ("a", "b") for t in doc["tags"])
    )


# ------------------------------------------------------------------ the mask, by hand
def test_the_mask_keeps_only_allowed_tokens_before_the_cuts():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    allowed = torch.tensor([False, True, True, False])
    assert Sampling().pick(logits, Counter(), None, allowed) == 1  # greedy: the best allowed
    probs = Sampling(temperature=1.0).probabilities(logits.double(), allowed)
    torch.testing.assert_close(probs, torch.tensor([0, 2 / 3, 1 / 3, 0], dtype=torch.float64))
    # top_p cuts the allowed distribution: 2/3 alone reaches 0.6
    probs = Sampling(temperature=1.0, top_p=0.6).probabilities(logits.double(), allowed)
    torch.testing.assert_close(probs, torch.tensor([0, 1, 0, 0], dtype=torch.float64))
    # a bias still moves the allowed ones, and cannot bring back a masked one
    s = Sampling(logit_bias={0: 100.0, 2: 5.0})
    assert s.pick(logits, Counter(), None, allowed) == 2
    with pytest.raises(NoAllowedToken) as err:
        Sampling().pick(logits, Counter(), None, torch.zeros(4, dtype=torch.bool))
    assert err.value.status == 400 and "response_format" in str(err.value)


@pytest.fixture(scope="module")
def formats(smollm2):
    from sinklab.stream.chat import eos_ids

    stops = sorted(eos_ids(smollm2.model, smollm2.tokenizer))
    return Formats(smollm2.tokenizer, smollm2.model.config.vocab_size, stops), stops


@pytest.mark.integration
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_logits_under_the_mask_always_write_a_document_the_schema_accepts(
    formats, smollm2, temperature
):
    """The mask alone carries the format: rows of random logits (no model), sampled through the
    server's own step, end on a stop token with a document the hand-written validator accepts,
    for several seeds; unmasked, the same rows write no JSON at all."""
    fmts, stops = formats
    fmt = fmts.check({"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
    vocab = smollm2.model.config.vocab_size
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        constraint, out = fmts.constraint(fmt), []
        for _ in range(300):
            row = torch.randn(vocab, generator=gen) * 4
            tok = Sampling(temperature=temperature).pick(
                row, Counter(), gen, constraint.allowed(vocab)
            )
            constraint.accept(tok)
            if tok in stops:
                break
            out.append(tok)
        else:
            pytest.fail(f"seed {seed}: no stop token in 300 steps")
        text = smollm2.tokenizer.decode(out)
        assert _valid(json.loads(text)), text
    gen = torch.Generator().manual_seed(0)
    free = [int(torch.randn(vocab, generator=gen).argmax()) for _ in range(20)]
    with pytest.raises(ValueError):
        json.loads(smollm2.tokenizer.decode(free))


def test_json_object_allows_any_object_and_nothing_else(formats, smollm2):
    fmts, stops = formats
    tok = smollm2.tokenizer
    good = tok.encode('{"a": [1, 2, {"b": null}]}', add_special_tokens=False)
    c = fmts.constraint(fmts.check({"type": "json_object"}))
    for t in good:
        assert c.allowed(len(tok))[t], tok.decode([t])
        c.accept(t)
    assert all(c.allowed(len(tok))[s] for s in stops)  # complete: the reply may end here
    c = fmts.constraint(fmts.check({"type": "json_object"}))
    first = tok.encode("[1]", add_special_tokens=False)[0]
    assert not c.allowed(len(tok))[first]  # an array is JSON, not an object
    assert not any(c.allowed(len(tok))[s] for s in stops)  # nothing written: no end yet


# ------------------------------------------------------------------ the server
class Person(BaseModel):
    name: str
    age: int


ASK = [{"role": "user", "content": "Describe a person in one sentence."}]


@pytest.fixture(scope="module")
def server():
    served = Served("--model", MODEL, "--api-key", "k", "--max-tokens", "96", timeout=600)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="k", max_retries=0, timeout=600)


@pytest.mark.integration
def test_the_official_clients_parse_gets_an_object_of_its_schema(client, server):
    out = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Person, temperature=0, max_tokens=96
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Person), choice.message.content
    free = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=96)
    with pytest.raises(ValueError):  # the model's own answer is prose: the mask made the JSON
        json.loads(free.choices[0].message.content)
    assert "Traceback" not in server.log


@pytest.mark.integration
def test_json_object_streams_the_whole_replys_text(client):
    kw = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 96,
          "response_format": {"type": "json_object"}}  # fmt: skip
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(whole.choices[0].message.content), dict)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices
    )
    assert streamed == whole.choices[0].message.content


@pytest.mark.integration
def test_n_sampled_replies_each_follow_the_schema(client):
    """``n`` > 1 with a schema: a fresh matcher per choice, each choice its own draws."""
    out = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Person, temperature=1.0, seed=3, n=3,
        max_tokens=96,
    )  # fmt: skip
    assert len(out.choices) == 3
    for c in out.choices:
        assert c.finish_reason == "stop" and isinstance(c.message.parsed, Person), c
    assert len({c.message.content for c in out.choices}) > 1


@pytest.mark.integration
def test_the_responses_route_honours_text_format_as_the_chat_route_does(client):
    """``client.responses.parse(text_format=...)`` (what the openai-agents SDK sends for an
    ``output_type``): the same greedy object as the chat route's ``parse`` for the same prompt."""
    got = client.responses.parse(
        model=MODEL, input=ASK[0]["content"], text_format=Person, temperature=0,
        max_output_tokens=96,
    )  # fmt: skip
    assert isinstance(got.output_parsed, Person), got.output_text
    chat = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Person, temperature=0, max_tokens=96
    )
    assert got.output_parsed == chat.choices[0].message.parsed
    assert got.text.format.type == "json_schema"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=MODEL, input="x", max_output_tokens=4,
            text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}},
        )  # fmt: skip
    assert err.value.body["param"] == "text.format.schema", err.value.body
    with pytest.raises(openai.BadRequestError) as err:  # a schema where none is read
        client.responses.create(
            model=MODEL, input="x", max_output_tokens=4,
            text={"format": {"type": "json_object", "schema": {"type": "object"}}},
        )  # fmt: skip
    assert err.value.body["param"] == "text.format", err.value.body
    assert "only with type 'json_schema'" in err.value.body["message"]


@pytest.mark.integration
def test_langchain_with_structured_output_gets_the_object(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=server.base, api_key="k", max_retries=0, timeout=600,
        temperature=0, max_tokens=96,
    )  # fmt: skip
    got = llm.with_structured_output(Person, method="json_schema").invoke(ASK[0]["content"])
    assert isinstance(got, Person)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("fmt", "extra", "param", "needle"),
    [
        ({"type": "json_schema"}, {}, "response_format", "json_schema is given"),
        ({"type": "json_object", "json_schema": {"name": "x"}}, {}, "response_format",
         "json_schema is given"),
        ({"type": "yaml"}, {}, "response_format.type", "json_object"),
        ({"type": "json_object", "indent": 2}, {}, "response_format.indent", "not permitted"),
        ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, {},
         "response_format.json_schema.name", "pattern"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, {},
         "response_format.json_schema.schema", "can enforce: Invalid type"),
        ({"type": "json_object"}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
         "response_format", "cannot also call tools"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "x-guidance": {"lenient": True}}}}, {},
         "response_format.json_schema.schema", "x-guidance"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "propertyNames": {"pattern": "^a"}}}}, {},
         "response_format.json_schema.schema", "propertyNames"),
        ({"type": "json_schema", "json_schema": {"name": "x", "description": "a person",
                                                 "schema": {}}}, {},
         "response_format.json_schema.description", "not shown to the model"),
    ],
)  # fmt: skip
def test_a_bad_format_is_a_400_naming_it(client, server, fmt, extra, param, needle):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4, extra_body={"response_format": fmt, **extra}
        )
    body = err.value.body
    assert body["param"] == param and needle in body["message"], body
    assert "Traceback" not in server.log
