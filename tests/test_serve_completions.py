"""``POST /v1/completions`` on the real server through the official ``openai`` client (issue 29,
item 3): ``echo`` + ``logprobs`` score a prompt exactly as a plain forward does (1e-4, the first
token null), a greedy reply equals ``sinklab generate``'s, lists of prompts are one choice each,
a stream equals the whole reply, ``stop`` and ``seed`` behave as on the chat route, a prompt longer
than the window is read through the sink cache (bounded; the whole prompt counted in ``usage``),
and every field that is not honoured is refused with a 400 naming it, with no traceback."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import openai
import pytest
import torch

from serving import Served
from sinklab.models.loading import load_model
from sinklab.stream.generation import GenerateConfig, generate

N_SINK, WINDOW = 2, 120
TEXT = "to be or not to be that is the question whether tis nobler in the mind to suffer"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tiny_model_factory, chat_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-completions")
    tiny_model_factory("llama", seed=21).save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(chat_dir):
    return load_model(str(chat_dir))


@pytest.fixture(scope="module")
def server(chat_dir):
    args = ["--model", str(chat_dir), "--n-sink", str(N_SINK), "--window", str(WINDOW)]
    served = Served(*args, "--max-tokens", "64", "--prefill-chunk", "16", "--api-key", "key-a")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="key-a", max_retries=0, timeout=60)


def _plain_logprobs(loaded, ids: list[int]) -> torch.Tensor:
    """A plain transformers forward over ``ids``: row ``i`` is the log-softmax after token i."""
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), -1)


def _ids(loaded, text: str) -> list[int]:
    return list(loaded.tokenizer(text, add_special_tokens=True).input_ids)


def test_echo_logprobs_equal_a_plain_forward(client, chat_dir, loaded, server):
    ids = _ids(loaded, TEXT)
    assert 16 < len(ids) < WINDOW  # read in several pieces, nothing evicted
    out = client.completions.create(
        model=str(chat_dir), prompt=TEXT, echo=True, max_tokens=0, logprobs=2
    )
    choice = out.choices[0]
    lp = choice.logprobs
    logp = _plain_logprobs(loaded, ids)
    assert lp.tokens == [loaded.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - float(logp[i - 1, ids[i]])) < 1e-4, i
        top = lp.top_logprobs[i]
        best = int(logp[i - 1].argmax())
        assert loaded.tokenizer.decode([best]) in top and lp.tokens[i] in top
        assert len(top) <= 3  # the 2 most likely and the chosen one
    assert choice.text == TEXT  # the prompt as sent, each token's offset where it starts
    assert lp.text_offset == sorted(lp.text_offset)
    for tok, at in zip(lp.tokens, lp.text_offset, strict=True):
        assert tok == loaded.tokenizer.unk_token or TEXT[at:].startswith(tok.strip()), (tok, at)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    assert choice.finish_reason == "length"
    assert "Traceback" not in server.log


def test_a_greedy_reply_equals_sinklab_generate(client, chat_dir, loaded):
    ids = _ids(loaded, "the king")
    ref = generate(
        loaded.model,
        loaded.tokenizer,
        torch.tensor(ids),
        GenerateConfig(max_new_tokens=12, n_sink=N_SINK, window=WINDOW, prefill_chunk=16),
    )
    out = client.completions.create(model=str(chat_dir), prompt="the king", max_tokens=12,
                                    temperature=0, logprobs=0)  # fmt: skip
    want = [t for t in ref.new_tokens if t != loaded.tokenizer.eos_token_id]
    dec = loaded.tokenizer.decode
    # the reply continues the prompt's text (its first word's space included)
    assert out.choices[0].text == dec(ids + want, skip_special_tokens=True)[len(dec(ids)) :]
    assert out.usage.completion_tokens == len(want)
    lp = out.choices[0].logprobs
    assert lp.tokens == [loaded.tokenizer.decode([t]) for t in want]
    rows = _plain_logprobs(loaded, ids + want)
    for k, t in enumerate(want):
        assert abs(lp.token_logprobs[k] - float(rows[len(ids) - 1 + k, t])) < 1e-4
        assert list(lp.top_logprobs[k]) == [lp.tokens[k]]  # greedy: the chosen is the top
    # the default is OpenAI's: 16 tokens at most
    assert client.completions.create(model=str(chat_dir), prompt="the king",
                                     temperature=0).usage.completion_tokens <= 16  # fmt: skip


def test_an_end_token_is_scored_not_written(client, chat_dir, loaded):
    """lm-evaluation-harness drops the last entry of ``echo`` + ``max_tokens: 1``: a reply that
    is the end token must still have its entry, or the prompt's last token would be dropped."""
    eos = loaded.tokenizer.eos_token_id
    out = client.completions.create(model=str(chat_dir), prompt="the king", max_tokens=1,
                                    echo=True, logprobs=1, logit_bias={str(eos): 100})  # fmt: skip
    choice, n = out.choices[0], len(_ids(loaded, "the king"))
    assert choice.text == "the king" and choice.finish_reason == "stop"
    assert len(choice.logprobs.token_logprobs) == n + 1
    assert choice.logprobs.tokens[-1] == loaded.tokenizer.decode([eos])
    assert out.usage.completion_tokens == 1


def test_lists_of_prompts_are_one_choice_each(client, chat_dir, loaded):
    prompts = ["the king", "to be or not"]
    many = client.completions.create(model=str(chat_dir), prompt=prompts, max_tokens=5,
                                     temperature=0, echo=True, logprobs=1)  # fmt: skip
    as_ids = client.completions.create(model=str(chat_dir), prompt=[_ids(loaded, p)
                                       for p in prompts], max_tokens=5, temperature=0,
                                       echo=True, logprobs=1)  # fmt: skip
    one_ids = client.completions.create(model=str(chat_dir), prompt=_ids(loaded, prompts[1]),
                                        max_tokens=5, temperature=0)  # fmt: skip
    assert [c.index for c in many.choices] == [0, 1]
    for i, p in enumerate(prompts):
        alone = client.completions.create(model=str(chat_dir), prompt=p, max_tokens=5,
                                          temperature=0, echo=True, logprobs=1)  # fmt: skip
        assert many.choices[i].text == alone.choices[0].text == as_ids.choices[i].text
        assert many.choices[i].logprobs.token_logprobs == pytest.approx(
            alone.choices[0].logprobs.token_logprobs, abs=1e-6
        )
        assert many.choices[i].text.startswith(p)
    assert one_ids.choices[0].text == many.choices[1].text[len(prompts[1]) :] != ""
    n = sum(len(_ids(loaded, p)) for p in prompts)
    assert many.usage.prompt_tokens == n


def test_prompts_read_together_score_as_each_alone(client, chat_dir, loaded):
    """Ten prompts of different lengths (two groups of rows read together; one longer than the
    window, so its row evicts while the others do not): each choice equals its prompt alone."""
    base = _ids(loaded, TEXT) * 20
    prompts = [base[: 3 + 7 * k] for k in range(9)] + [base[:300]]
    kw = {"model": str(chat_dir), "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1}
    many = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in many.choices] == list(range(10))
    for p, choice in zip(prompts, many.choices, strict=True):
        alone = client.completions.create(prompt=p, **kw).choices[0]
        assert choice.text == alone.text
        assert choice.logprobs.token_logprobs == pytest.approx(
            alone.logprobs.token_logprobs, abs=1e-5
        )
    assert many.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_a_stream_equals_the_whole_reply(client, chat_dir):
    kw = {"model": str(chat_dir), "prompt": ["the king", "our"], "max_tokens": 10,
          "temperature": 0, "logprobs": 2, "echo": True}  # fmt: skip
    whole = client.completions.create(**kw)
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == choice.text
        assert mine[-1].finish_reason == choice.finish_reason
        got = [x for c in mine if c.logprobs for x in c.logprobs.token_logprobs]
        assert got == choice.logprobs.token_logprobs
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_strings_and_seeds(client, chat_dir):
    model = str(chat_dir)
    full = client.completions.create(model=model, prompt="the king", max_tokens=20, temperature=0)
    text = full.choices[0].text
    word = next(w for w in text.split() if text.index(w) > 0)
    cut = client.completions.create(model=model, prompt="the king", max_tokens=20,
                                    temperature=0, stop=[word])  # fmt: skip
    assert cut.choices[0].text == text[: text.index(word)]
    assert cut.choices[0].finish_reason == "stop"
    outs = [client.completions.create(model=model, prompt="the", max_tokens=12, temperature=1.5)
            for _ in range(3)]  # fmt: skip
    assert len({o.model_extra["seed"] for o in outs}) == 3
    assert len({o.choices[0].text for o in outs}) > 1
    again = client.completions.create(model=model, prompt="the", max_tokens=12, temperature=1.5,
                                      seed=outs[0].model_extra["seed"])  # fmt: skip
    assert again.choices[0].text == outs[0].choices[0].text


def test_a_prompt_longer_than_the_window_is_read_through_the_sink_cache(client, chat_dir, loaded):
    """Bounded: a 400-token prompt in a 2 + 120 cache. Its first pieces (nothing evicted yet)
    score as a plain forward does; later tokens see only sinks and the window, so they differ
    from a plain forward over the whole prompt; every logprob is finite, the whole prompt is
    counted."""
    ids = (_ids(loaded, TEXT) * 40)[:400]
    out = client.completions.create(model=str(chat_dir), prompt=ids, echo=True, max_tokens=2,
                                    logprobs=0, temperature=0)  # fmt: skip
    lp = out.choices[0].logprobs.token_logprobs
    assert len(lp) == 400 + out.usage.completion_tokens and out.usage.prompt_tokens == 400
    assert all(math.isfinite(x) for x in lp[1:])
    logp = _plain_logprobs(loaded, ids)
    untouched = (N_SINK + WINDOW) // 16 * 16  # the pieces (16 tokens) read before any eviction
    for i in range(1, untouched):
        assert abs(lp[i] - float(logp[i - 1, ids[i]])) < 1e-4, i
    far = [abs(lp[i] - float(logp[i - 1, ids[i]])) for i in range(300, 400)]
    assert max(far) > 1e-3  # the window, not the whole prompt


def test_n_choices_are_the_seeds_draws_in_openais_order(client, chat_dir):
    """``n``: prompt i's j-th choice is index ``i * n + j`` and is exactly the ``n = 1`` reply
    with seed ``seed + j`` (its own draws from one read of the prompt); greedy, every choice is
    the greedy reply; streamed, the same texts by index; ``usage`` counts each prompt once."""
    model, kw = str(chat_dir), {"max_tokens": 10, "temperature": 1.3}
    out = client.completions.create(model=model, prompt=["to be", "or not"], n=3, seed=7, **kw)
    assert [c.index for c in out.choices] == list(range(6))
    texts = [c.text for c in out.choices]
    assert len(set(texts[:3])) > 1, texts  # not three copies
    for i, prompt in enumerate(["to be", "or not"]):
        for j in range(3):
            one = client.completions.create(model=model, prompt=prompt, seed=7 + j, **kw)
            assert one.choices[0].text == texts[i * 3 + j], (i, j)
    alone = client.completions.create(model=model, prompt=["to be", "or not"], seed=7, **kw)
    assert out.usage.prompt_tokens == alone.usage.prompt_tokens
    streamed = [""] * 6
    for chunk in client.completions.create(
        model=model, prompt=["to be", "or not"], n=3, seed=7, stream=True, **kw
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    greedy = client.completions.create(model=model, prompt="to be", n=2, max_tokens=8,
                                       temperature=0)  # fmt: skip
    assert greedy.choices[0].text == greedy.choices[1].text
    top = client.completions.create(model=model, prompt="to be", n=2, seed=2**64 - 1, **kw)
    assert len(top.choices) == 2  # seed + j wraps past 64 bits instead of failing


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"suffix": "x"}, "suffix", "not supported"),
        ({"best_of": 2}, "best_of", "best_of 1"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"n": 33, "prompt": ["a", "b"]}, "n", "over 64 choices"),
        ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"logprobs": True}, "logprobs", "integer"),
        ({"prompt": []}, "prompt", "must be a string"),
        ({"prompt": [[]]}, "prompt", "must be a string"),
        ({"prompt": [1.5]}, "prompt", "must be a string"),
        ({"prompt": ["a", [1]]}, "prompt", "must be a string"),
        ({"prompt": [100000]}, "prompt", "vocabulary"),
        ({"prompt": [[1], [-1]]}, "prompt.1", "vocabulary"),
        ({"prompt": ""}, "prompt", "no tokens"),
        ({"max_tokens": 65}, "max_tokens", "over this server's 64"),
        ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
        ({"frobnicate": 1}, "frobnicate", "unsupported parameter"),
        ({"messages": []}, "messages", "unsupported parameter"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"temperature": 1e-300}, "temperature", "at least"),
        ({"seed": 2**64}, "seed", "64 bits"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "vocabulary size"),
    ],
)  # fmt: skip
def test_what_is_not_honoured_is_refused_naming_it(server, chat_dir, extra, param, needle):
    body = {"model": str(chat_dir), "prompt": "hi", **extra}
    resp = httpx.post(server.base + "/completions", json=body, timeout=30,
                      headers={"Authorization": "Bearer key-a"})  # fmt: skip
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert "\n" not in error["message"]
    assert "Traceback" not in server.log


def test_keys_models_and_bodies(server, chat_dir):
    url, key = server.base + "/completions", {"Authorization": "Bearer key-a"}
    assert httpx.post(url, json={"model": str(chat_dir), "prompt": "x"}).status_code == 401
    resp = httpx.post(url, json={"model": "gpt-3.5-turbo-instruct", "prompt": "x"}, headers=key)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    resp = httpx.post(url, content=b"{not json", headers=key)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"
    resp = httpx.post(url, json=[1, 2], headers=key)
    assert resp.status_code == 400
    resp = httpx.post(url, json={"prompt": "x"}, headers=key)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
    assert "Traceback" not in server.log


def test_hostile_bodies_and_a_client_gone_mid_stream(server, chat_dir, client):
    url, key = server.base + "/completions", {"Authorization": "Bearer key-a",
                                              "Content-Type": "application/json"}  # fmt: skip
    resp = httpx.post(url, content=b'{"model": "m", "prompt": "\\ud800"}', headers=key)
    assert resp.status_code == 400 and "surrogate" in resp.json()["error"]["message"]
    deep = b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    resp = httpx.post(url, content=deep, headers=key)
    assert resp.status_code == 400 and "nests deeper" in resp.json()["error"]["message"]
    with httpx.stream("POST", url, headers=key, timeout=60, json={
        "model": str(chat_dir), "prompt": "the king", "max_tokens": 60, "stream": True,
        "temperature": 0}) as stream:  # fmt: skip
        next(stream.iter_lines())  # one chunk, then the client leaves
    out = client.completions.create(model=str(chat_dir), prompt="the king", max_tokens=3)
    assert out.choices[0].text is not None
    assert "Traceback" not in server.log


def test_a_prompt_past_the_request_timeout_is_answered_504(chat_dir):
    """--request-timeout 3 with --prefill-chunk 1: a 6,000-token prompt (6,000 forwards) is
    dropped between pieces and answered 504 JSON; the next request is answered."""
    args = ["--model", str(chat_dir), "--n-sink", str(N_SINK), "--window", str(WINDOW)]
    served = Served(*args, "--request-timeout", "3", "--prefill-chunk", "1")
    try:
        url = served.base + "/completions"
        resp = httpx.post(url, json={"model": str(chat_dir), "prompt": [5] * 6000,
                                     "max_tokens": 1}, timeout=120)  # fmt: skip
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "request_timeout"
        resp = httpx.post(url, json={"model": str(chat_dir), "prompt": "the", "max_tokens": 1},
                          timeout=120)  # fmt: skip
        assert resp.status_code == 200, resp.text
        assert "Traceback" not in served.log
    finally:
        served.stop()
