"""Sampling as OpenAI documents it (issue 29): the sampling step pinned against hand computations
(logit_bias, presence and frequency penalties, temperature, top_p, top_k, logprobs), then the real
server through the official ``openai`` client: unseeded requests draw a fresh seed (returned,
replayable), penalties and biases change the reply exactly as a hand-written loop over
``sinklab chat``'s model says, logprobs equal a plain forward's log-softmax (1e-4), streamed
logprobs equal the whole reply's, ``usage`` counts the whole prompt with ``cached_tokens``, and
every parameter that is not honoured is refused with a 400 naming it."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import openai
import pytest
import torch

from serving import Served
from sinklab.models.loading import load_model
from sinklab.serve.sampling import NotFinite, Sampling
from sinklab.stream.chat import ChatConfig, ChatSession

N_SINK, WINDOW = 2, 200  # nothing is evicted in these short turns: a plain forward is exact


# ------------------------------------------------------------------ the step, by hand
def test_bias_and_penalties_are_openais_formula():
    """mu[j] - c[j] * frequency - (c[j] > 0) * presence + bias[j], by hand."""
    s = Sampling(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 5.0, 1: -100.0})
    got = s.adjusted(torch.tensor([2.0, 1.0, 0.0, -1.0]), Counter({0: 2, 2: 1}))
    want = torch.tensor([2 - 2 * 0.25 - 0.5, 1 - 100, 0 - 0.25 - 0.5, -1 + 5], dtype=torch.float64)
    torch.testing.assert_close(got, want)
    assert s.pick(torch.tensor([2.0, 1.0, 0.0, -1.0]), Counter({0: 2, 2: 1}), None) == 3
    # nothing sampled yet: the penalties do nothing, the bias still applies
    assert (
        Sampling(presence_penalty=2, frequency_penalty=2).pick(
            torch.tensor([2.0, 1.0]), Counter(), None
        )
        == 0
    )


def test_temperature_top_p_and_top_k_by_hand():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    probs = Sampling(temperature=1.0, top_p=0.8).probabilities(logits.double())
    # 0.5 then 0.3 reach 0.8; 0.15 starts at 0.8, not below it: cut
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64))
    probs = Sampling(temperature=1.0, top_p=0.81).probabilities(logits.double())
    want = torch.tensor([0.5, 0.3, 0.15, 0], dtype=torch.float64) / 0.95
    torch.testing.assert_close(probs, want)
    probs = Sampling(temperature=0.5).probabilities(logits.double())  # p^2, renormalised
    want = torch.tensor([0.25, 0.09, 0.0225, 0.0025], dtype=torch.float64) / 0.365
    torch.testing.assert_close(probs, want)
    probs = Sampling(temperature=1.0, top_k=2).probabilities(logits.double())
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64))


def test_draws_follow_the_cut_distribution_and_a_seed_replays():
    s = Sampling(temperature=1.0, top_p=0.8)
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    gen = torch.Generator().manual_seed(7)
    draws = Counter(s.pick(logits, Counter(), gen) for _ in range(4000))
    assert set(draws) == {0, 1}
    assert abs(draws[0] / 4000 - 0.625) < 0.03
    again = torch.Generator().manual_seed(7)
    assert [s.pick(logits, Counter(), again) for _ in range(50)] == [
        s.pick(logits, Counter(), g) for g in [torch.Generator().manual_seed(7)] for _ in range(50)
    ]


def test_logprobs_are_the_models_own_log_softmax(chat_tokenizer):
    # the bias changes no logprob: they are the model's own
    s = Sampling(logprobs=True, top_logprobs=2, logit_bias={0: 100.0})
    entry = s.logprob_entry(torch.tensor([0.0, math.log(3.0), -50.0]), 1, chat_tokenizer)
    assert entry["logprob"] == pytest.approx(math.log(3 / 4))
    assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
        [math.log(3 / 4), math.log(1 / 4)]
    )
    assert entry["token"] == chat_tokenizer.decode([1])
    assert entry["bytes"] == list(entry["token"].encode())


def test_non_finite_numbers_raise_with_whose_doing_it_is():
    with pytest.raises(NotFinite) as err:
        Sampling(temperature=1.0).pick(torch.tensor([0.0, float("nan")]), Counter(), None)
    assert err.value.status == 500  # the model's row
    with pytest.raises(NotFinite) as err:
        Sampling(temperature=5e-324).pick(torch.tensor([0.0, 1.0]), Counter(), None)
    assert err.value.status == 400  # the request's temperature


# ------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tiny_model_factory, chat_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-chat-sampling")
    tiny_model_factory("llama", seed=13).save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(chat_dir):
    return load_model(str(chat_dir))


@pytest.fixture(scope="module")
def server(chat_dir):
    args = ["--model", str(chat_dir), "--n-sink", str(N_SINK), "--window", str(WINDOW)]
    served = Served(*args, "--max-tokens", "64", "--api-key", "key-a")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="key-a", max_retries=0, timeout=60)


def _ask(client, model, text, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], **kw
    )


def _reference(loaded, text: str, n: int, presence=0.0, frequency=0.0, bias=None):
    """``sinklab chat``'s model, greedy over the hand-written OpenAI formula -> (token ids,
    each step's raw logits, the ids read)."""
    session = ChatSession(loaded.model, loaded.tokenizer, ChatConfig(N_SINK, WINDOW))
    new = [{"role": "user", "content": text}]
    _, _, read = session.to_read(new)
    logits = session.begin(new).logits
    toks, rows, counts = [], [], Counter()
    for _ in range(n):
        mu = logits.double().clone()
        for j, c in counts.items():
            mu[j] -= c * frequency + presence
        for j, b in (bias or {}).items():
            mu[j] += b
        tok = int(mu.argmax())
        if tok in session.stops:
            break
        toks.append(tok)
        rows.append(logits)
        counts[tok] += 1
        with torch.inference_mode():
            logits = session._forward([tok])
    return toks, rows, read


def test_n_replies_are_the_seeds_draws_without_a_session(client, chat_dir, server):
    """``n`` > 1 (docs/serve.md#choices): choice ``j`` is the ``n = 1`` reply with seed
    ``seed + j`` (its own draws from one read of the conversation); no session is kept or
    named; greedy, every choice is the greedy reply; streamed, the same texts by index;
    ``usage`` counts the prompt once and every choice's tokens."""
    model, kw = str(chat_dir), {"max_tokens": 10, "temperature": 1.3}
    out = _ask(client, model, "To be or not", n=3, seed=7, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2] and out.seed == 7
    assert getattr(out, "session_id", None) is None
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) > 1, texts
    singles = [_ask(client, model, "To be or not", seed=7 + j, **kw) for j in range(3)]
    assert [o.choices[0].message.content for o in singles] == texts
    assert out.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert out.usage.completion_tokens == sum(o.usage.completion_tokens for o in singles)
    streamed = ["", "", ""]
    for ch in _ask(client, model, "To be or not", n=3, seed=7, stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts
    greedy = _ask(client, model, "To be or not", n=2, max_tokens=8, temperature=0)
    alone = _ask(client, model, "To be or not", max_tokens=8, temperature=0)
    assert [c.message.content for c in greedy.choices] == [alone.choices[0].message.content] * 2
    assert "Traceback" not in server.log


def test_n_replies_carry_each_choices_own_logprobs(client, chat_dir, server):
    """``logprobs`` with ``n`` > 1: choice ``j``'s entries (tokens, logprobs, top alternatives)
    are those of the ``n = 1`` reply with seed ``seed + j``, within 1e-4; streamed, the same
    entries by index."""
    model = str(chat_dir)
    kw = {"max_tokens": 8, "temperature": 1.3, "logprobs": True, "top_logprobs": 3}
    out = _ask(client, model, "To be or not", n=3, seed=11, **kw)
    singles = [_ask(client, model, "To be or not", seed=11 + j, **kw) for j in range(3)]

    def rows(entries):
        return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                for e in entries]  # fmt: skip

    for choice, single in zip(out.choices, singles, strict=True):
        got, want = rows(choice.logprobs.content), rows(single.choices[0].logprobs.content)
        assert [g[0] for g in got] == [w[0] for w in want] and got
        assert len(got) == single.usage.completion_tokens - (
            single.choices[0].finish_reason == "stop"
        )  # one entry per reply token; the end of turn has none
        for (_, lp, top), (_, wlp, wtop) in zip(got, want, strict=True):
            assert abs(lp - wlp) < 1e-4 and len(top) == 3
            assert [t for t, _ in top] == [t for t, _ in wtop]
            assert max(abs(a - b) for (_, a), (_, b) in zip(top, wtop, strict=True)) < 1e-4
    streamed: list[list] = [[], [], []]
    for ch in _ask(client, model, "To be or not", n=3, seed=11, stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.logprobs.content if c.logprobs else []
    assert [rows(s) for s in streamed] == [rows(c.logprobs.content) for c in out.choices]
    assert "Traceback" not in server.log


def test_unseeded_requests_draw_fresh_seeds_and_a_seed_replays(client, chat_dir):
    model = str(chat_dir)
    outs = [_ask(client, model, "To be or not", temperature=1.2, max_tokens=12) for _ in range(3)]
    seeds = [o.seed for o in outs]
    assert len(set(seeds)) == 3 and all(isinstance(s, int) and 0 <= s < 2**64 for s in seeds)
    texts = [o.choices[0].message.content for o in outs]
    assert len(set(texts)) > 1, texts  # not three copies
    replay = _ask(client, model, "To be or not", temperature=1.2, max_tokens=12, seed=seeds[1])
    assert replay.choices[0].message.content == texts[1] and replay.seed == seeds[1]


def test_penalties_and_bias_equal_the_hand_written_loop(client, chat_dir, loaded):
    model, text, n = str(chat_dir), "that is the question", 10
    cases = [
        {},
        {"frequency_penalty": 2.0},
        {"presence_penalty": 1.5},
        {"frequency_penalty": -1.0, "presence_penalty": 0.5},
    ]
    replies = set()
    for kw in cases:
        out = _ask(client, model, text, temperature=0, max_tokens=n, **kw)
        toks, _, _ = _reference(
            loaded, text, n, kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0)
        )
        want = loaded.tokenizer.decode(toks, skip_special_tokens=True)
        assert out.choices[0].message.content == want, kw
        replies.add(want)
    assert len(replies) > 1  # the penalties did change the reply
    plain, _, _ = _reference(loaded, text, n)
    banned = {str(plain[0]): -100}  # the greedy first token, banned
    out = _ask(client, model, text, temperature=0, max_tokens=n, logit_bias=banned)
    toks, _, _ = _reference(loaded, text, n, bias={plain[0]: -100.0})
    assert toks[0] != plain[0]
    assert out.choices[0].message.content == loaded.tokenizer.decode(toks, skip_special_tokens=True)
    forced = 7  # +100 on one token: every token of the reply is it
    out = _ask(client, model, text, temperature=1.0, max_tokens=5, logit_bias={"7": 100},
               logprobs=True)  # fmt: skip
    assert [e.token for e in out.choices[0].logprobs.content] == [
        loaded.tokenizer.decode([forced])
    ] * 5


def test_logprobs_equal_a_plain_forward_and_stream_alike(client, chat_dir, loaded):
    model, text, n = str(chat_dir), "whether tis nobler in the mind", 6
    out = _ask(client, model, text, temperature=0, max_tokens=n, logprobs=True, top_logprobs=3)
    toks, _, read = _reference(loaded, text, n)
    ids = torch.tensor([read + toks])
    with torch.inference_mode():
        logp = torch.log_softmax(loaded.model(ids).logits[0].double(), -1)  # a plain forward
    content = out.choices[0].logprobs.content
    assert len(content) == len(toks)
    for k, (entry, tok) in enumerate(zip(content, toks, strict=True)):
        row = logp[len(read) - 1 + k]
        assert entry.token == loaded.tokenizer.decode([tok])
        assert abs(entry.logprob - float(row[tok])) < 1e-4
        values, top = torch.topk(row, 3)
        assert [t.token for t in entry.top_logprobs] == [loaded.tokenizer.decode([int(i)])
                                                          for i in top]  # fmt: skip
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        temperature=0,
        max_tokens=n,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [e for c in stream for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = _ask(client, model, text, temperature=0, max_tokens=n)
    assert plain.choices[0].logprobs is None


def test_usage_counts_the_whole_prompt_and_the_cached_part(client, chat_dir):
    model, sid = str(chat_dir), {"session_id": "usage"}
    one = _ask(client, model, "to be or not to be", max_tokens=4, extra_body=sid)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    two = _ask(client, model, "that is the question", max_tokens=4, extra_body=sid)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached == one.session["tokens_seen"] > 0  # what the session had read
    assert two.usage.prompt_tokens > cached >= one.usage.prompt_tokens
    assert two.usage.total_tokens == two.usage.prompt_tokens + two.usage.completion_tokens


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"n": 17}, "n", "1 to 16"),
        ({"n": 2, "session_id": "s1"}, "session_id", "not kept in a session"),
        ({"n": 2, "tools": [{"type": "function", "function": {"name": "f"}}]}, "n", "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
         "does not render tools"),
        ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ({"tool_choice": "required", "tools": []}, "tool_choice", "needs tools"),
        ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
         "tools", "does not render tools"),
        ({"tool_choice": "any"}, "tool_choice", "must be 'none', 'auto', 'required'"),
        ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is given"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_object"),
        ({"frobnicate": 1}, "frobnicate", "unsupported parameter"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs must be true"),
        ({"logit_bias": {"100000": 1}}, "logit_bias", "vocabulary size"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
        ({"logit_bias": {"3": 101}}, "logit_bias", "-100..100"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
        ({"seed": -1}, "seed", "0..2**64 - 1"),
        ({"reasoning_effort": "high"}, "reasoning_effort", "not supported"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages.0",
         "does not render tools"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type":
          "function", "function": {"name": "f", "arguments": "{}"}}]},
          {"role": "user", "content": "x"}]}, "messages.0", "does not render tools"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages.0.name",
         "names are not supported"),
    ],
)  # fmt: skip
def test_what_is_not_honoured_is_refused_naming_it(client, chat_dir, server, extra, param, needle):
    body = {"model": str(chat_dir), "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{"model": body.pop("model"), "messages": body.pop(
            "messages"), "extra_body": body})  # fmt: skip
    error = err.value.body
    assert error["param"] == param and needle in error["message"], error
    assert "Traceback" not in server.log


def test_text_response_format_and_developer_role_are_honoured(client, chat_dir):
    out = client.chat.completions.create(
        model=str(chat_dir),
        messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
        response_format={"type": "text"},
        max_tokens=3,
        n=1,
        user="someone",
    )
    as_system = client.chat.completions.create(
        model=str(chat_dir),
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
    )
    again = client.chat.completions.create(
        model=str(chat_dir),
        messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
    )
    assert out.choices[0].message.content is not None
    # developer is OpenAI's new name of system: the same prompt, so the same greedy reply
    assert again.choices[0].message.content == as_system.choices[0].message.content


def test_a_refused_temperature_beside_a_stream_leaves_the_stream_alone(client, chat_dir, server):
    """While one client streams a reply, another sends temperature 1e-307 (refused when parsed,
    below the 1e-4 floor: it never enters the batch; the batched non-finite row is
    tests/test_serve_engine.py's): it gets a 400 JSON naming ``temperature``, the stream runs
    to its end with the reply it gets alone, and the log holds no traceback."""
    model, text = str(chat_dir), "or to take arms against a sea of troubles"
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        temperature=0,
        max_tokens=40,
        stream=True,
    )
    pieces = []
    for n, c in enumerate(stream):
        pieces += [ch.delta.content or "" for ch in c.choices]
        if n == 2:  # mid-reply: the other request arrives
            with pytest.raises(openai.BadRequestError) as err:
                _ask(client, model, "x", temperature=1e-307, max_tokens=3)
            assert err.value.body["param"] == "temperature"
    alone = _ask(client, model, text, temperature=0, max_tokens=40)
    assert "".join(pieces) == alone.choices[0].message.content
    assert "Traceback" not in server.log


def test_model_route_and_the_routes_not_served(client, chat_dir, server):
    """GET /v1/models/{id} answers the served model (404 for another); /v1/embeddings answers a
    404 that names the route to use, /v1/responses (served) refuses a field it does not define
    (legacy ``prompt``) with a 400 naming it; defaults that ask for nothing (tool_choice none,
    store false) are accepted, and ``parallel_tool_calls`` without tools is refused with a 400
    naming it, as OpenAI refuses it (no silent acceptance of a parameter nothing honours)."""
    import httpx

    assert client.models.retrieve(str(chat_dir)).id == str(chat_dir)
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found"
    key = {"Authorization": "Bearer key-a"}
    resp = httpx.post(server.base + "/embeddings", json={"model": "m", "input": "x"},
                      headers=key, timeout=30)  # fmt: skip
    assert resp.status_code == 404 and "/v1/chat/completions" in resp.json()["error"]["message"]
    resp = httpx.post(server.base + "/responses", json={"model": "m", "prompt": "x"},
                      headers=key, timeout=30)  # fmt: skip
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text
    out = _ask(client, str(chat_dir), "hi", max_tokens=2, tool_choice="none", store=False)
    assert out.choices[0].finish_reason in ("stop", "length")
    for value in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            _ask(client, str(chat_dir), "hi", max_tokens=2, parallel_tool_calls=value)
        assert err.value.body["param"] == "parallel_tool_calls", err.value.body
