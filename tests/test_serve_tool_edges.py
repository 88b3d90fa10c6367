"""The chat route's forced calls and logprobs at their edges (the review of 3d14533 and f53d75f),
on a tiny random Qwen2 with Qwen2.5's own tokenizer and chat template, served in process by the
real engine and app:

- a tool whose parameters use ``$defs`` (pydantic's) is forced like any other, alone or beside
  another, also under their own ``$id``, its arguments checked by hand against the schema; data
  that looks like a reference (a ``const``) stays as sent;
- parameters that are not an object, grammar-engine options on any tool, two tools of one name
  and a ``stop`` beside a forced call are precise 400s;
- a forced reply cut by ``max_tokens`` inside its first call has empty content (not the raw
  markup), whole and streamed, and its conversation, sent back as it came, continues the session;
- a named function is called once;
- logprobs entries are the tokens whose text begins before a stop string's cut: their texts
  joined are the content when the stop string begins on a token, for n = 1 and n > 1, whole and
  streamed (each chunk carrying the entries of the tokens its text begins), and on the
  completions route."""

from __future__ import annotations

import json

import pytest

from conftest import make_tiny_model

pytestmark = pytest.mark.integration

QWEN = "qwen2.5-0.5b"
MSG = [{"role": "user", "content": "hi"}]
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
        "required": ["name"], "additionalProperties": False}  # fmt: skip
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "$defs": {"City": CITY}, "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
    "required": ["city"], "additionalProperties": False}}}  # fmt: skip
# a schema with its own base URI: its references resolve against it wherever it is placed
BOOK_ID = {"type": "function", "function": {"name": "book", "parameters": {
    **BOOK["function"]["parameters"], "$id": "https://example.com/book.json"}}}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"], "additionalProperties": False}}}  # fmt: skip


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from sinklab.models.zoo import ZOO, dequantized_dir, is_ready
    from sinklab.serve.app import build_app
    from sinklab.serve.config import ServeConfig
    from sinklab.serve.engine import Engine
    from sinklab.serve.metrics import Metrics

    folder = dequantized_dir(ZOO[QWEN])
    if not is_ready(folder):
        pytest.fail(f"{QWEN} is not installed: run `sinklab models install {QWEN}`")
    tok = AutoTokenizer.from_pretrained(folder)
    model = make_tiny_model("qwen2", vocab_size=len(tok), max_position_embeddings=2048)
    config = ServeConfig(model_id="m")
    log: list[str] = []
    engine = Engine(model, tok, config, None, Metrics(), log.append)
    engine.start()
    with TestClient(build_app(engine, config, Metrics(), log.append)) as c:
        c.log = log
        yield c
    engine.stop()
    assert not any("Traceback" in line for line in log)


def _chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "m", "messages": MSG, **body})


def _streamed(client, path: str, body: dict) -> tuple[dict[int, str], dict[int, list], list]:
    """Each choice's streamed text and logprob entries, and every chunk. After each chunk a
    choice's entries so far must be the tokens whose text begins in its text so far (an entry
    goes out with its token's text): checked here, for any stream with logprobs."""
    text: dict[int, str] = {}
    entries: dict[int, list] = {}
    chunks = []
    with client.stream("POST", path, json={"model": "m", **body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            for ch in chunk.get("choices", []):
                i = ch["index"]
                piece = ch["delta"].get("content") if "delta" in ch else ch.get("text")
                text[i] = text.get(i, "") + (piece or "")
                lp = ch.get("logprobs") or {}
                entries.setdefault(i, []).extend(lp.get("content") or lp.get("tokens") or [])
                if entries[i] and ch.get("finish_reason") is None:
                    got = [e["token"] if isinstance(e, dict) else e for e in entries[i]]
                    begun = "".join(got[:-1])  # every entry but the last began before its text
                    assert len(begun) < len(text[i]) <= len("".join(got)), (got, text[i])
    return text, entries, chunks


def _bad(resp, param: str, needle: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and needle in err["message"], err


@pytest.mark.parametrize("book", [BOOK, BOOK_ID], ids=["defs", "defs-under-own-id"])
@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside-another"])
def test_parameters_with_defs_are_forced_like_any_other(client, beside, book):
    tools = [WEATHER, book] if beside else [book]  # the named tool is forced alone
    named = {"type": "function", "function": {"name": "book"}}
    for seed in range(3):
        out = _chat(client, tools=tools, tool_choice=named, max_tokens=80, seed=seed)
        assert out.status_code == 200, out.text
        choice = out.json()["choices"][0]
        if choice["finish_reason"] == "length":
            continue  # a random model may write the longest name it may
        (call,) = choice["message"]["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "book" and set(args) == {"city"}
        assert set(args["city"]) == {"name"} and isinstance(args["city"]["name"], str)
        assert len(args["city"]["name"]) <= 8
        break
    else:
        pytest.fail("no forced call finished in 3 seeds")


def test_what_a_forced_call_cannot_honour_is_a_precise_400(client):
    text_params = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    _bad(_chat(client, tools=[text_params], tool_choice="required"),
         "tools.0.function.parameters", "of type 'object'")  # fmt: skip
    guided = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "x-guidance": {"lenient": True}}}}  # fmt: skip
    _bad(_chat(client, tools=[WEATHER, guided], tool_choice={"type": "function",
         "function": {"name": "g"}}), "tools.1.function.parameters", "x-guidance")  # fmt: skip
    inner = {"type": "string", "x-guidance": {"lenient": True}}
    nested = {"type": "function", "function": {"name": "n", "parameters": {"type": "object",
              "properties": {"a": inner}}}}  # fmt: skip
    _bad(_chat(client, tools=[nested], tool_choice="required"),
         "tools.0.function.parameters", "x-guidance")  # fmt: skip
    _bad(_chat(client, tools=[WEATHER, WEATHER]), "tools", "'get_weather' is twice")
    _bad(_chat(client, tools=[WEATHER], tool_choice="required", stop=["city"]), "stop", "mid-call")
    # beside a call the model may choose not to make, a stop string is honoured
    assert _chat(client, tools=[WEATHER], stop=["city"], max_tokens=4).status_code == 200


def test_a_forced_reply_cut_in_its_first_call_has_no_content_and_continues(client):
    body = {"tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 8, "seed": 3}
    out = _chat(client, **body)
    assert out.status_code == 200, out.text
    data = out.json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "" and "tool_calls" not in choice["message"]
    text, _, chunks = _streamed(client, "/v1/chat/completions", {"messages": MSG, **body})
    assert text == {0: ""} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("tool_calls" in ch["delta"] for c in chunks for ch in c["choices"])
    # the client sends the conversation back with the (empty) reply: the same session goes on
    history = [*MSG, choice["message"], {"role": "user", "content": "again"}]
    more = client.post("/v1/chat/completions", json={"model": "m", "messages": history,
                       "tools": body["tools"], "max_tokens": 2,
                       "session_id": data["session_id"]})  # fmt: skip
    assert more.status_code == 200, more.text
    assert more.json()["session"]["turns"] == 2


def test_data_that_looks_like_a_reference_is_kept_as_sent(client):
    """A ``const`` whose value is an object with a ``$ref`` key is data: only the value sent
    (not one rebased into the calls' grammar) can be the call's argument."""
    value = {"$ref": "#/x"}
    tool = {"type": "function", "function": {"name": "pin", "parameters": {"type": "object",
            "properties": {"v": {"const": value}}, "required": ["v"],
            "additionalProperties": False}}}  # fmt: skip
    out = _chat(client, tools=[tool], tool_choice="required", max_tokens=200, seed=0,
                parallel_tool_calls=False)  # fmt: skip
    assert out.status_code == 200, out.text
    (call,) = out.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"v": value}


def test_a_named_function_is_called_once(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    finished = 0
    for seed in range(4, 16):  # seed 8 wrote two calls when a named function allowed several
        out = _chat(client, tools=[WEATHER, TIME], tool_choice=named, max_tokens=300,
                    temperature=1.5, seed=seed)  # fmt: skip
        choice = out.json()["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        assert len(calls) <= 1 and all(c["function"]["name"] == "get_time" for c in calls)
        finished += choice["finish_reason"] == "tool_calls"
    assert finished >= 6  # most replies end on their one call


def _reply_tokens(client) -> list[str]:
    out = _chat(client, max_tokens=24, temperature=0, logprobs=True).json()
    return [e["token"] for e in out["choices"][0]["logprobs"]["content"]]


def _stop_on_a_token(tokens: list[str]) -> tuple[int, str]:
    """A stop string beginning on token k and ending inside token k + 1 (both plain, and the
    string found nowhere earlier in the reply)."""
    text = "".join(tokens)
    for k in range(2, len(tokens) - 1):
        a, b = tokens[k], tokens[k + 1]
        stop = a + b[:-1] if len(b) > 1 else a + b
        plain = all(ch.isprintable() and ch != "\ufffd" for ch in a + b)
        if plain and len(a) >= 2 and text.find(stop) == len("".join(tokens[:k])):
            return k, stop
    pytest.fail(f"no usable stop string in {tokens!r}")


def test_logprobs_end_where_a_stop_string_cuts_the_text(client):
    tokens = _reply_tokens(client)
    k, stop = _stop_on_a_token(tokens)
    content = "".join(tokens[:k])
    kw = {"messages": MSG, "max_tokens": 24, "temperature": 0, "logprobs": True, "stop": [stop]}
    for n in (1, 2):
        whole = _chat(client, **kw, n=n).json()
        for choice in whole["choices"]:
            assert choice["message"]["content"] == content and choice["finish_reason"] == "stop"
            assert [e["token"] for e in choice["logprobs"]["content"]] == tokens[:k]
        text, entries, _ = _streamed(client, "/v1/chat/completions", {**kw, "n": n})
        assert text == dict.fromkeys(range(n), content)
        assert {i: [e["token"] for e in v] for i, v in entries.items()} == dict.fromkeys(
            range(n), tokens[:k]
        )
    # a stop string beginning inside token k: the content keeps its first part, and its entry
    mid = stop[1:]
    assert "".join(tokens).find(mid) == len(content) + 1
    out = _chat(client, **{**kw, "stop": [mid]}).json()["choices"][0]
    assert out["message"]["content"] == content + tokens[k][0]
    assert [e["token"] for e in out["logprobs"]["content"]] == tokens[: k + 1]


def test_completions_logprobs_end_where_a_stop_string_cuts_the_text(client):
    prompt = "To be, or not to be"
    base = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 1}
    full = client.post("/v1/completions", json={"model": "m", **base}).json()["choices"][0]
    tokens = full["logprobs"]["tokens"]
    assert "".join(tokens) == full["text"]
    k, stop = _stop_on_a_token(tokens)
    out = client.post("/v1/completions", json={"model": "m", **base, "stop": [stop]}).json()
    choice = out["choices"][0]
    assert choice["text"] == "".join(tokens[:k]) and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"] == tokens[:k]
    assert choice["logprobs"]["text_offset"] == full["logprobs"]["text_offset"][:k]
    text, entries, _ = _streamed(client, "/v1/completions", {**base, "stop": [stop]})
    assert text == {0: "".join(tokens[:k])} and entries == {0: tokens[:k]}
