"""``POST /v1/responses`` on the real server through the official ``openai`` client's
``client.responses.create`` (issue 29, item 3): text in (a string, or message items of
``input_text`` parts, an assistant's ``output_text`` too), text out (``output_text``), the reply
equal to ``sinklab chat``'s for the same conversation, ``instructions`` as its system message,
``max_output_tokens`` ending it as ``incomplete``, ``usage.input_tokens`` the whole prompt, and
every field that is not honoured refused with a 400 naming it, with no traceback in the log."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from serving import Served
from sinklab.models.loading import load_model
from sinklab.stream.chat import ChatConfig, ChatSession

N_SINK, WINDOW = 2, 200


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tiny_model_factory, chat_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-responses")
    tiny_model_factory("llama", seed=5).save_pretrained(folder)
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


def _chat(loaded, text: str, n: int, system: str | None = None):
    session = ChatSession(loaded.model, loaded.tokenizer, ChatConfig(N_SINK, WINDOW,
                          max_new_tokens=n, system=system))  # fmt: skip
    prompt = len(session.to_read([{"role": "user", "content": text}])[2])
    return session.turn(text), prompt


def test_text_in_text_out_equals_sinklab_chat(client, chat_dir, loaded, server):
    out = client.responses.create(model=str(chat_dir), input="to be or not to be",
                                  max_output_tokens=12, temperature=0)  # fmt: skip
    turn, prompt = _chat(loaded, "to be or not to be", 12)
    assert out.output_text == turn.reply != ""
    assert out.output[0].type == "message" and out.output[0].role == "assistant"
    assert out.output[0].content[0].type == "output_text"
    assert out.usage.input_tokens == prompt and out.usage.output_tokens == turn.new_tokens
    assert out.usage.total_tokens == prompt + turn.new_tokens
    assert out.status in ("completed", "incomplete")
    if turn.new_tokens == 12:
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    with_sys = client.responses.create(model=str(chat_dir), input="to be or not to be",
                                       instructions="the king", max_output_tokens=12,
                                       temperature=0)  # fmt: skip
    turn, prompt = _chat(loaded, "to be or not to be", 12, system="the king")
    assert with_sys.output_text == turn.reply and with_sys.usage.input_tokens == prompt
    assert with_sys.instructions == "the king"
    assert "Traceback" not in server.log


def test_message_items_equal_the_chat_route(client, chat_dir):
    history = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "to be "},
                                     {"type": "input_text", "text": "or not"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "that is the question"}]},
        {"role": "user", "content": "whether tis nobler"},
    ]  # fmt: skip
    out = client.responses.create(model=str(chat_dir), input=history, max_output_tokens=10,
                                  temperature=0)  # fmt: skip
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "to be or not"},
        {"role": "assistant", "content": "that is the question"},
        {"role": "user", "content": "whether tis nobler"},
    ]
    chat = client.chat.completions.create(model=str(chat_dir), messages=messages, max_tokens=10,
                                          temperature=0)  # fmt: skip
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens


def test_sampling_and_the_stock_defaults(client, chat_dir):
    """temperature and top_p are honoured (a draw at 1.5 varies, top_p 0 is greedy); the values
    that ask for nothing (no tools, plain text format, store false) are accepted."""
    model = str(chat_dir)
    greedy = client.responses.create(model=model, input="the king", max_output_tokens=8,
                                     temperature=0).output_text  # fmt: skip
    drawn = {client.responses.create(model=model, input="the king", max_output_tokens=8,
                                     temperature=1.5).output_text for _ in range(3)}  # fmt: skip
    assert len(drawn) > 1
    cut = client.responses.create(model=model, input="the king", max_output_tokens=8,
                                  temperature=1.5, top_p=0.0).output_text  # fmt: skip
    assert cut == greedy
    out = client.responses.create(model=model, input="the king", max_output_tokens=4,
                                  tools=[], tool_choice="auto", store=False,
                                  text={"format": {"type": "text"}}, metadata={"a": "b"},
                                  truncation="disabled", parallel_tool_calls=True,
                                  user="someone")  # fmt: skip
    assert out.metadata == {"a": "b"} and out.store is False


def test_a_stream_equals_the_whole_response(client, chat_dir, server):
    """``stream: true``: the Responses API's events, in order, whose deltas make the whole
    response's text; the openai client's own stream helper rebuilds the same text. (Cut by
    ``max_output_tokens``, it ends with ``response.incomplete``, as OpenAI's does.)"""
    kw = {"model": str(chat_dir), "input": "to be or not to be", "max_output_tokens": 10,
          "temperature": 0}  # fmt: skip
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]  # fmt: skip
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text != ""
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.input_tokens == (
        whole.usage.input_tokens)  # fmt: skip
    with client.responses.stream(**kw) as stream:  # the client's helper accumulates the events
        snapshots = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
    assert snapshots[-1] == whole.output_text
    assert "Traceback" not in server.log


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"stream_options": {"include_obfuscation": False}}, "stream_options", "not supported"),
        ({"store": True}, "store", "not stored"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
        ({"tools": [{"type": "function", "name": "f"}]}, "tools", "tools"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "json_object"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format", "name is required"),
        ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity",
         "not permitted"),
        ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
        ({"top_logprobs": 2}, "top_logprobs", "/v1/completions"),
        ({"background": True}, "background", "not supported"),
        ({"frobnicate": 1}, "frobnicate", "unsupported parameter"),
        ({"seed": 1}, "seed", "unsupported parameter"),
        ({"max_output_tokens": 65}, "max_output_tokens", "over this server's 64"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"input": ""}, "input", "empty"),
        ({"input": []}, "input", "non-empty list"),
        ({"input": [{"type": "function_call_output", "call_id": "1", "output": "x"}]},
         "input.0.type", "not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0.type", "input_text"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", "not a role"),
        ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input.0.name",
         "unsupported field"),
        ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
         "input.0.content.0.type", "input_text"),
        ({"input": ["x"]}, "input.0", "message item"),
    ],
)  # fmt: skip
def test_what_is_not_honoured_is_refused_naming_it(server, chat_dir, extra, param, needle):
    body = {"model": str(chat_dir), "input": "hi", **extra}
    resp = httpx.post(server.base + "/responses", json=body, timeout=30,
                      headers={"Authorization": "Bearer key-a"})  # fmt: skip
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert "\n" not in error["message"]
    assert "Traceback" not in server.log


def test_the_client_sees_the_refusals(client, chat_dir, server):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=str(chat_dir), input="hi", stream=True, store=True)
    assert err.value.body["param"] == "store"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="gpt-4o", input="hi")
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base, api_key="nope", max_retries=0).responses.create(
            model=str(chat_dir), input="hi"
        )
    assert "Traceback" not in server.log
