"""Tools on a model whose chat template renders them (the zoo's qwen2.5-0.5b), through the real
server and the official ``openai`` client: the template renders the request's tools, the model's
call is parsed into ``tool_calls`` (``finish_reason: "tool_calls"``), the client sends the call
and the tool's result back and the same session continues; what is not supported with tools is
refused with a 400 naming it (docs/serve.md#tools). The refusal on a template without tools is
in tests/test_serve_sampling.py."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from serving import Served

QWEN = "qwen2.5-0.5b"
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = "What is the weather in Paris right now?"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from sinklab.models.zoo import ZOO, dequantized_dir, is_ready

    if not is_ready(dequantized_dir(ZOO[QWEN])):
        pytest.fail(f"{QWEN} is not installed: run `sinklab models install {QWEN}`")
    sessions = tmp_path_factory.mktemp("tools") / "sessions"
    served = Served("--model", QWEN, "--api-key", "k", "--max-tokens", "48",
                    "--sessions", str(sessions), timeout=600)  # fmt: skip
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(qwen) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen.base, api_key="k", max_retries=0, timeout=600)


def test_a_call_is_parsed_and_its_result_continues_the_session(qwen, client):
    messages = [{"role": "user", "content": ASK}]
    out = client.chat.completions.create(
        model=QWEN, messages=messages, tools=WEATHER, temperature=0, max_tokens=40
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and choice.message.content is None
    # the conversation sent back as the client has it: the same session continues, the tool's
    # answer read after what the session holds
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18, "sky": "clear"}'},
    ]
    again = client.chat.completions.create(
        model=QWEN, messages=messages, tools=WEATHER, temperature=0, max_tokens=30
    )
    sid = out.model_extra["session_id"]
    assert again.model_extra["session_id"] == sid
    assert again.model_extra["session"]["turns"] == 2
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == out.model_extra["session"]["tokens_seen"] > 0
    reply = again.choices[0]  # the model may call again or answer: either is reported as such
    assert (reply.finish_reason == "tool_calls") == bool(reply.message.tool_calls)
    assert reply.message.tool_calls or reply.message.content
    import httpx

    held = httpx.get(f"{qwen.base}/sessions/{sid}", headers={"Authorization": "Bearer k"}).json()
    assert held["messages"][:3] == [
        messages[0],
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        messages[2],
    ]  # fmt: skip
    # the session's conversation as the client has it, and its tools are its own
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=QWEN, messages=[{"role": "user", "content": "and in Rome?"}], max_tokens=2,
            extra_body={"session_id": sid},
        )  # fmt: skip
    assert err.value.body["param"] == "tools" and "other tools" in err.value.body["message"]
    assert "Traceback" not in qwen.log


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "tool_choice", "not one of this request's tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}, "x": 1}},
         "tool_choice", "must be"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "cannot also call tools"),
        ({"tool_choice": "required", "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "x-guidance": {"lenient": True}}}}]},
         "tools.0.function.parameters", "x-guidance"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools.0.function.name", "pattern"),
    ],
)  # fmt: skip
def test_what_tools_do_not_support_is_refused_naming_it(qwen, client, extra, param, needle):
    body = {"tools": WEATHER, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=QWEN, messages=[{"role": "user", "content": ASK}], max_tokens=2,
            extra_body=body,
        )  # fmt: skip
    assert err.value.body["param"] == param and needle in err.value.body["message"], err.value.body
    assert "Traceback" not in qwen.log


def test_a_streamed_reply_with_tools_gives_the_call_in_deltas(qwen, client):
    """Streamed with tools, the reply is held until it is whole (it may be a call), then sent as
    OpenAI's indexed ``tool_calls`` deltas, which the client assembles into the call."""
    stream = client.chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": ASK}], tools=WEATHER, temperature=0,
        max_tokens=40, stream=True,
    )  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    finish, text = None, ""
    for ev in stream:
        for ch in ev.choices:
            text += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                got = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                got["id"] += d.id or ""
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and text == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0]["id"].startswith("call_")


def test_tool_choice_none_is_text_and_keeps_a_tools_session(qwen, client):
    """``tool_choice: "none"``: the reply is text, never parsed as a call; the tools are still
    rendered (the model sees them and is not to call them, as OpenAI means it), so a session
    started with tools takes a turn with "none" and then calls again (it was a 400 "other
    tools" when "none" meant no tools)."""
    out = client.chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": ASK}], tools=WEATHER,
        tool_choice="none", temperature=0, max_tokens=8,
    )  # fmt: skip
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
    sid = {"session_id": "tools-then-none"}
    first = client.chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": ASK}], tools=WEATHER,
        temperature=0, max_tokens=40, extra_body=sid,
    )  # fmt: skip
    assert first.choices[0].finish_reason == "tool_calls", first
    called = first.choices[0].message
    history = [{"role": "user", "content": ASK}, called.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": called.tool_calls[0].id,
                "content": "18 C, sunny"}]  # fmt: skip
    second = client.chat.completions.create(
        model=QWEN, messages=history, tools=WEATHER, tool_choice="none", temperature=0,
        max_tokens=12, extra_body=sid,
    )  # fmt: skip
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    assert second.model_extra["session_id"] == "tools-then-none"


NAMES = {"get_weather", "add"}


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None,
         [("get_weather", {"city": "Paris"})]),
        ('Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
         "</tool_call>", "Let me look.", [("add", {"a": 1, "b": 2}),
                                          ("get_weather", {"city": "Rome"})]),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n', None, [("add", {"a": 1})]),
        ('{"name": "unknown", "arguments": {}}', '{"name": "unknown", "arguments": {}}', []),
        ('{"name": "add", "arguments": "1, 2"}', '{"name": "add", "arguments": "1, 2"}', []),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ("The weather is fine.", "The weather is fine.", []),
    ],
)  # fmt: skip
def test_calls_are_taken_only_when_they_are_calls_of_the_tools(text, content, calls):
    from sinklab.serve.tools import parse_calls

    got_content, got = parse_calls(text, NAMES)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert len({c["id"] for c in got}) == len(got)


def test_a_sessions_tools_and_calls_survive_its_file(tiny_model_factory, chat_tokenizer, tmp_path):
    """A session's tools and a reply's calls (as the client got them) are written with it and
    read back at start-up: the restored session renders the same tools and matches the same
    resent conversation."""
    from sinklab.serve.sessions import Session, SessionStore
    from sinklab.serve.tools import seen_as
    from sinklab.stream.chat import ChatConfig, ChatSession

    model = tiny_model_factory("llama", seed=13)
    chat = ChatSession(model, chat_tokenizer, ChatConfig(2, 30))
    chat.tools = WEATHER
    chat.turn("hi")
    sent = {"content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}  # fmt: skip
    chat.messages[-1]["sent"] = sent
    identity = {"model": "tiny", "n_sink": 2, "window": 30}
    store = SessionStore(tmp_path, identity, print)
    store.claim()
    store.save(Session("t", "k", chat, chat.cache.state()), chat.cache.state())
    (back,) = SessionStore(tmp_path, identity, print).load_all(
        lambda: ChatSession(model, chat_tokenizer, ChatConfig(2, 30))
    )
    assert back.chat.tools == WEATHER
    assert back.chat.messages == chat.messages
    assert seen_as(back.chat.messages[-1]) == {"role": "assistant", **sent}


def test_langchain_bind_tools_gets_the_call_and_continues(qwen, client):
    """LangChain's ``ChatOpenAI.bind_tools`` (a second real client, unmodified): the model's call
    comes back as LangChain's ``tool_calls``, equal to what the official client gets, and a
    ``ToolMessage`` with the result continues the conversation (the model then answers or
    calls again, each reported as such)."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=QWEN, base_url=qwen.base, api_key="k", max_retries=0, timeout=600,
                     temperature=0, max_tokens=40).bind_tools(WEATHER)  # fmt: skip
    got = llm.invoke([HumanMessage(ASK)])
    want = client.chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": ASK}], tools=WEATHER, temperature=0,
        max_tokens=40,
    ).choices[0].message.tool_calls  # fmt: skip
    assert [(c["name"], c["args"]) for c in got.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in want
    ] and got.tool_calls
    result = ToolMessage("18 C, sunny", tool_call_id=got.tool_calls[0]["id"])
    reply = llm.invoke([HumanMessage(ASK), got, result])
    calls_again = reply.response_metadata["finish_reason"] == "tool_calls"
    assert calls_again == bool(reply.tool_calls)  # the model may call again or answer
    assert reply.tool_calls or reply.content
    assert "Traceback" not in qwen.log


TWO = [
    *WEATHER,
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "format": {"enum": ["12h", "24h"]}},
                "required": ["city", "format"],
                "additionalProperties": False,
            },
        },
    },
]
OFF_TOPIC = [{"role": "user", "content": "Hello! Who wrote Hamlet?"}]


def test_a_forced_call_is_a_call_where_auto_answers_in_text(qwen, client):
    """On a question no tool answers, qwen2.5 writes text under ``auto``; under ``required``
    (one call: ``parallel_tool_calls`` false) the reply is one call of one of the tools, and
    under a named function a call of that one, with arguments its schema accepts. The session
    keeps the forced call and continues after the tool's answer."""
    kw = {"model": QWEN, "tools": TWO, "temperature": 0, "max_tokens": 48}
    auto = client.chat.completions.create(messages=OFF_TOPIC, **kw)
    assert auto.choices[0].finish_reason == "stop" and not auto.choices[0].message.tool_calls
    required = client.chat.completions.create(
        messages=OFF_TOPIC, tool_choice="required", parallel_tool_calls=False, **kw
    )
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    named = client.chat.completions.create(
        messages=OFF_TOPIC, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw,
    )  # fmt: skip
    (call,) = named.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_time" and set(args) == {"city", "format"}
    assert isinstance(args["city"], str) and args["format"] in ("12h", "24h")
    history = [
        *OFF_TOPIC,
        named.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"time": "09:30"}'},
    ]
    again = client.chat.completions.create(messages=history, **kw)
    assert again.model_extra["session_id"] == named.model_extra["session_id"]
    assert "Traceback" not in qwen.log


def test_langchain_tool_choice_required_gets_a_call(qwen):
    """LangChain's ``bind_tools(..., tool_choice="required")`` sends OpenAI's ``"required"``;
    the reply is a call where the unbound model answers in text."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=QWEN, base_url=qwen.base, api_key="k", max_retries=0, timeout=600,
                     temperature=0, max_tokens=48)  # fmt: skip
    bound = llm.bind_tools(TWO, tool_choice="required", parallel_tool_calls=False)
    got = bound.invoke(OFF_TOPIC[0]["content"])
    assert [c["name"] for c in got.tool_calls] in (["get_weather"], ["get_time"]), got


# ------------------------------------------- tools through three more real clients (unmodified)


def test_litellm_tools_get_the_official_clients_call_and_continue(qwen, client):
    """litellm's ``openai/`` provider with ``tools``: the call the official client gets, and the
    conversation sent back with litellm's own assistant message and a tool result continues."""
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price map from GitHub
    import litellm

    messages = [{"role": "user", "content": ASK}]
    kw = {"model": f"openai/{QWEN}", "api_base": qwen.base, "api_key": "k", "tools": WEATHER,
          "temperature": 0, "max_tokens": 40}  # fmt: skip
    got = litellm.completion(messages=messages, **kw)
    want = client.chat.completions.create(
        model=QWEN, messages=messages, tools=WEATHER, temperature=0, max_tokens=40
    ).choices[0].message.tool_calls  # fmt: skip
    message = got.choices[0].message
    assert got.choices[0].finish_reason == "tool_calls"
    assert (
        [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
        == [(c.function.name, json.loads(c.function.arguments)) for c in want]
        == [("get_weather", {"city": "Paris"})]
    )
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C, clear"}
    again = litellm.completion(
        messages=[*messages, message.model_dump(exclude_none=True), result], **kw
    )
    reply = again.choices[0]  # the model may call again or answer: either is reported as such
    assert (reply.finish_reason == "tool_calls") == bool(reply.message.tool_calls)
    assert reply.message.tool_calls or reply.message.content
    assert "Traceback" not in qwen.log


def test_agents_sdk_runs_a_function_tool(qwen):
    """The openai-agents SDK's ``Agent`` with a ``function_tool`` on its chat-completions model:
    under ``tool_choice`` "required" (forced by the grammar) the model calls the tool, the SDK
    runs it with the parsed arguments, and ``stop_on_first_tool`` makes its output the run's
    (one call: with parallel calls allowed qwen2.5-0.5b writes the same call twice)."""
    import os

    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # it exports to OpenAI
    import agents

    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return "18 C, clear"

    model = agents.OpenAIChatCompletionsModel(
        model=QWEN,
        openai_client=openai.AsyncOpenAI(base_url=qwen.base, api_key="k", max_retries=0),
    )
    agent = agents.Agent(
        name="weather", instructions="You are a helpful assistant.", model=model,
        tools=[get_weather], tool_use_behavior="stop_on_first_tool",
        model_settings=agents.ModelSettings(
            temperature=0, max_tokens=48, tool_choice="required", parallel_tool_calls=False
        ),
    )  # fmt: skip
    result = agents.Runner.run_sync(agent, ASK, max_turns=2)
    assert seen == ["Paris"] and result.final_output == "18 C, clear"
    assert "Traceback" not in qwen.log


def test_llm_cli_runs_a_tool_chain(qwen, tmp_path):
    """The ``llm`` CLI with ``--functions``: the server's parsed call is run by llm, whose tool
    result goes back as a ``tool`` message and continues the same session. qwen2.5-0.5b then
    calls the tool again (it does so under transformers' ``generate`` on the same template
    too), so llm's chain limit of 2 ends the run at that second reply: the error is llm's, the
    round trip before it is whole."""
    import os
    import subprocess
    import sys

    import httpx

    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: qwen\n  model_name: {QWEN}\n  api_base: {json.dumps(qwen.base)}\n"
        "  api_key_name: sinklab\n  supports_tools: true\n"
    )
    (tmp_path / "keys.json").write_text(json.dumps({"sinklab": "k"}))
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "LLM_LOAD_PLUGINS": ""}
    fn = 'def get_weather(city: str) -> str:\n    "Get the current weather in a city"\n    ' \
         'return "18 C, clear"\n'  # fmt: skip
    before = {s["id"] for s in _sessions(qwen)}
    done = subprocess.run(
        [str(Path(sys.executable).with_name("llm")), "prompt", "-m", "qwen", "-o", "temperature",
         "0", "-o", "max_tokens", "40", "--functions", fn, "--td", "--cl", "2", ASK],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert out.count("Tool call: get_weather({'city': 'Paris'})") == 1, out
    assert "Chain limit of 2 exceeded" in out, out
    (sid,) = {s["id"] for s in _sessions(qwen)} - before
    held = httpx.get(f"{qwen.base}/sessions/{sid}", headers={"Authorization": "Bearer k"}).json()
    roles = [m["role"] for m in held["messages"]]
    assert roles[:4] == ["user", "assistant", "tool", "assistant"], roles
    assert held["messages"][2]["content"] == "18 C, clear"
    assert held["messages"][1]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": {"city": "Paris"}}  # fmt: skip
    assert "Traceback" not in qwen.log


def _sessions(served) -> list[dict]:
    import httpx

    got = httpx.get(f"{served.base}/sessions", headers={"Authorization": "Bearer k"})
    return got.json()["data"]
