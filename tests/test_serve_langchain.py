"""A second real client: LangChain's ``ChatOpenAI`` (langchain-openai, the dev extra) drives
``sinklab serve`` unmodified (base_url and key only): a plain call, a stream, sampling
parameters and a refusal, each checked against what the official ``openai`` client gets from
the same server (issue 29's client matrix; tools on a tool-capable model are in
tests/test_serve_tools.py)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI

from serving import Served

N_SINK, WINDOW = 2, 200


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tiny_model_factory, chat_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-chat-langchain")
    tiny_model_factory("llama", seed=13).save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(chat_dir):
    args = ["--model", str(chat_dir), "--n-sink", str(N_SINK), "--window", str(WINDOW)]
    served = Served(*args, "--max-tokens", "64", "--api-key", "key-a")
    yield served
    served.stop()


def _lc(server, chat_dir, **kw) -> ChatOpenAI:
    return ChatOpenAI(
        model=str(chat_dir), base_url=server.base, api_key="key-a", max_retries=0, timeout=60, **kw
    )


def _official(server, chat_dir, messages, **kw) -> str:
    client = openai.OpenAI(base_url=server.base, api_key="key-a", max_retries=0, timeout=60)
    out = client.chat.completions.create(model=str(chat_dir), messages=messages, **kw)
    return out.choices[0].message.content


MESSAGES = [SystemMessage("be brief"), HumanMessage("to be or not to be")]
AS_DICTS = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "to be or not to be"}]  # fmt: skip


def test_langchain_invoke_and_stream_get_the_official_clients_reply(server, chat_dir):
    llm = _lc(server, chat_dir, temperature=0, max_tokens=12)
    want = _official(server, chat_dir, AS_DICTS, temperature=0, max_tokens=12)
    got = llm.invoke(MESSAGES)
    assert got.content == want and want
    assert got.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.content for chunk in llm.stream(MESSAGES))
    assert streamed == want
    assert "Traceback" not in server.log


def test_langchain_sampling_parameters_are_honoured(server, chat_dir):
    """A seeded sample with top_p and a penalty is the official client's for the same values;
    a logit_bias of -100 on the greedy first token changes the reply's first token."""
    kw = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "frequency_penalty": 0.5, "max_tokens": 10}
    llm = _lc(server, chat_dir, **kw)
    assert llm.invoke(MESSAGES).content == _official(server, chat_dir, AS_DICTS, **kw)
    client = openai.OpenAI(base_url=server.base, api_key="key-a", max_retries=0, timeout=60)
    greedy = client.chat.completions.create(
        model=str(chat_dir), messages=AS_DICTS, temperature=0, max_tokens=1, logprobs=True
    )
    first = greedy.choices[0].logprobs.content[0].token
    bias_id = _first_token_id(chat_dir, server, first)
    biased = _lc(server, chat_dir, temperature=0, max_tokens=1, logit_bias={bias_id: -100})
    assert biased.invoke(MESSAGES).content != greedy.choices[0].message.content


def _first_token_id(chat_dir, server, piece: str) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_dir))
    ids = [i for i in range(len(tok)) if tok.decode([i]) == piece]
    assert ids, piece
    return ids[0]


def test_langchain_sees_a_refusal_as_the_400_it_is(server, chat_dir):
    llm = _lc(server, chat_dir, max_tokens=4, model_kwargs={"modalities": ["text", "audio"]})
    with pytest.raises(openai.BadRequestError) as err:
        llm.invoke(MESSAGES)
    assert err.value.body["param"] == "modalities"
    assert "Traceback" not in server.log
