"""``sinklab serve`` end to end, on a tiny chat model served on a free 127.0.0.1 port: the official
``openai`` client (plain and streamed completions, sessions, the whole-``messages`` prefix reuse,
``/v1/models``); the replies equal ``sinklab chat``'s for the same turns, alone and with several
sessions decoded in one batch; ``httpx`` for the refusals (401, 404 across keys, 413, bad JSON and
values, OpenAI-style bodies, no traceback; new sessions past ``--max-sessions`` evict the least
recently used idle one instead of a 429); ``/metrics``; ``sinklab chat --server``; the
bind rule. Crash, corrupt files and a full disk are in tests/test_serve_faults.py."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from helpers import assert_one_line_error, run_main
from serving import Served
from sinklab.models.loading import load_model
from sinklab.stream.chat import ChatConfig, ChatSession

N_SINK, WINDOW, MAX_TOKENS = 2, 30, 8
TURNS = [
    "To be or not to be",
    "that is the question whether tis nobler in the mind to suffer",
    "the slings and arrows of outrageous fortune",
    "or to take arms against a sea of troubles",
]
KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tiny_model_factory, chat_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-chat-serve")
    tiny_model_factory("llama", seed=13).save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def local(chat_dir):
    """``sinklab chat``'s engine on the same folder: the reference replies."""
    loaded = load_model(str(chat_dir))

    def replies(turns: list[str], max_new_tokens: int = MAX_TOKENS) -> list[str]:
        cfg = ChatConfig(N_SINK, WINDOW, max_new_tokens=max_new_tokens)
        session = ChatSession(loaded.model, loaded.tokenizer, cfg)
        return [session.turn(t).reply for t in turns]

    return replies


@pytest.fixture(scope="module")
def server(chat_dir, tmp_path_factory):
    sessions = tmp_path_factory.mktemp("sessions")
    args = ["--model", str(chat_dir), "--n-sink", str(N_SINK), "--window", str(WINDOW)]
    args += ["--sessions", str(sessions), "--max-sessions", "8", "--max-tokens", "64"]
    for key in KEYS:
        args += ["--api-key", key]
    served = Served(*args)
    yield served
    served.stop()


def _client(server: Served, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key=key, max_retries=0, timeout=60)


def _say(client: openai.OpenAI, model: str, text: str, sid: str | None, stream: bool):
    """One turn through the openai client -> (reply, session_id, session block)."""
    extra = {"session_id": sid} if sid else {}
    msgs = [{"role": "user", "content": text}]
    if not stream:
        out = client.chat.completions.create(
            model=model, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        return out.choices[0].message.content, out.session_id, out.session
    parts, last = [], None
    for ev in client.chat.completions.create(
        model=model, messages=msgs, max_tokens=MAX_TOKENS, stream=True, extra_body=extra
    ):
        parts += [c.delta.content for c in ev.choices if c.delta.content]
        last = ev
    return "".join(parts), last.session_id, last.session


def test_openai_client_sessions_equal_sinklab_chat(server, local, chat_dir):
    client = _client(server)
    models = client.models.list().data
    assert [m.id for m in models] == [str(chat_dir)]
    model = models[0].id
    got, seen = [], 0
    for i, text in enumerate(TURNS):
        reply, sid, session = _say(client, model, text, "alice", stream=i % 2 == 1)
        got.append(reply)
        assert sid == "alice"
        assert session["turns"] == i + 1
        assert session["kept"] <= N_SINK + WINDOW
        assert session["tokens_seen"] > seen
        seen = session["tokens_seen"]
    assert seen > N_SINK + WINDOW  # the cache evicted
    assert got == local(TURNS)
    # a plain OpenAI request with the whole conversation continues the session it extends
    history = httpx.get(server.base + "/sessions/alice", headers=_auth(KEYS[0]), timeout=30)
    history = history.json()["messages"]
    out = client.chat.completions.create(
        model=model,
        messages=[*history, {"role": "user", "content": "and by opposing end them"}],
        max_tokens=MAX_TOKENS,
    )
    assert out.session_id == "alice" and out.session["turns"] == len(TURNS) + 1
    assert out.choices[0].message.content == local([*TURNS, "and by opposing end them"])[-1]
    assert out.usage.completion_tokens <= MAX_TOKENS
    # without a session_id and a conversation nobody holds: a new session, named in the reply
    fresh = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": TURNS[0]}], max_tokens=MAX_TOKENS
    )
    assert fresh.session_id != "alice" and fresh.session["turns"] == 1
    assert fresh.choices[0].message.content == got[0]


def test_batched_sessions_equal_each_alone(server, local):
    """Four clients at once: their turns decode in one batch, each equal to its session alone."""
    turns = {f"batch{i}": [TURNS[(i + k) % 4] for k in range(3)] for i in range(4)}
    got: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def talk(sid: str) -> None:
        try:
            client = _client(server)
            got[sid] = [_say(client, server_model(server), t, sid, False)[0] for t in turns[sid]]
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=talk, args=(sid,)) for sid in turns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    for sid, texts in turns.items():
        assert got[sid] == local(texts), sid
    metrics = httpx.get(server.url + "/metrics", headers=_auth(KEYS[0]), timeout=30).text
    peak = float(_metric(metrics, "sinklab_batch_size_peak"))
    assert peak >= 2, metrics  # some steps decoded several sessions at once


def server_model(server: Served) -> str:
    return _client(server).models.list().data[0].id


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _metric(text: str, name: str) -> str:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return line.split()[-1]
    raise AssertionError(f"{name} not in /metrics:\n{text}")


def _refused(resp: httpx.Response, status: int, needle: str) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"} and needle in body["error"]["message"], body
    assert "Traceback" not in resp.text
    return body["error"]


def test_refusals_are_openai_errors(server):
    model = server_model(server)
    url = server.base + "/chat/completions"
    ok = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(timeout=60) as http:
        _refused(http.post(url, json=ok), 401, "API key")
        _refused(http.post(url, json=ok, headers=_auth("nope")), 401, "API key")
        _refused(http.get(server.base + "/models"), 401, "API key")
        a, b = _auth(KEYS[0]), _auth(KEYS[1])
        first = http.post(url, json={**ok, "session_id": "carol"}, headers=a)
        assert first.status_code == 200, first.text
        # another key cannot read or delete it, and the same 404 as for an absent id; naming
        # it makes that key's own session (ids are each key's own)
        absent = http.get(server.base + "/sessions/nobody", headers=b)
        other = http.get(server.base + "/sessions/carol", headers=b)
        assert other.status_code == absent.status_code == 404
        assert other.json() == {
            **absent.json(),
            "error": {**absent.json()["error"], "message": "no session 'carol' for this key"},
        }
        _refused(other, 404, "no session")
        _refused(http.delete(server.base + "/sessions/carol", headers=b), 404, "no session")
        own = http.post(url, json={**ok, "session_id": "carol"}, headers=b)
        assert own.status_code == 200 and own.json()["session"]["turns"] == 1
        assert http.get(server.base + "/sessions/carol", headers=a).json()["turns"] == 1
        assert http.delete(server.base + "/sessions/carol", headers=b).status_code == 200
        assert http.get(server.base + "/sessions/carol", headers=a).json()["turns"] == 1
        _refused(http.post(url, content=b"{not json", headers=a), 400, "not valid JSON")
        _refused(http.post(url, json=[1, 2], headers=a), 400, "JSON object")
        _refused(http.post(url, json={**ok, "max_tokens": "many"}, headers=a), 400, "max_tokens")
        _refused(http.post(url, json={**ok, "max_tokens": -3}, headers=a), 400, "max_tokens")
        _refused(http.post(url, json={**ok, "max_tokens": 65}, headers=a), 400, "over this")
        _refused(http.post(url, json={**ok, "temperature": -1}, headers=a), 400, "temperature")
        _refused(http.post(url, json={**ok, "session_id": "no/slash"}, headers=a), 400, "session")
        _refused(http.post(url, json={**ok, "messages": []}, headers=a), 400, "messages")
        _refused(http.post(url, json={**ok, "model": "gpt-4o"}, headers=a), 404, "not served")
        many = [{"role": "user", "content": "x"}] * 300
        _refused(http.post(url, json={**ok, "messages": many}, headers=a), 400, "messages")
        big = {**ok, "messages": [{"role": "user", "content": "x" * (1 << 20)}]}
        _refused(http.post(url, json=big, headers=a), 413, "over")
        _refused(http.get(server.url + "/v1/nowhere", headers=a), 404, "no such route")
        assert http.get(server.url + "/health").json()["status"] == "ok"
        # 8 sessions in memory: new ones evict the least recently used idle one to disk
        # (never a 429 while a slot is idle), and it comes back when named
        for i in range(20):
            resp = http.post(url, json={**ok, "session_id": f"fill{i}"}, headers=b)
            assert resp.status_code == 200, resp.text
        listed = http.get(server.base + "/sessions", headers=b).json()["data"]
        assert {r["id"] for r in listed} >= {f"fill{j}" for j in range(20)}
        assert sum(r["in_memory"] for r in listed) <= 8
        assert not {r["id"] for r in listed} & {"carol"}  # a's session is not b's to list
        assert http.get(server.base + "/sessions/fill0", headers=b).json()["turns"] == 1
        gone = http.delete(server.base + "/sessions/fill0", headers=b)
        assert gone.status_code == 200 and gone.json()["deleted"] is True
        _refused(http.get(server.base + "/sessions/fill0", headers=b), 404, "no session")
        assert http.post(url, json={**ok, "session_id": "late"}, headers=b).status_code == 200
        i = 20
        metrics = http.get(server.url + "/metrics", headers=a).text
        for name in ["late", *(f"fill{j}" for j in range(1, i))]:  # room for the next tests
            assert http.delete(server.base + f"/sessions/{name}", headers=b).status_code == 200
    assert int(_metric(metrics, "sinklab_sessions")) == 8
    assert 'sinklab_requests_total{status="401"}' in metrics
    assert float(_metric(metrics, "sinklab_rss_bytes")) > 1e6
    assert int(_metric(metrics, "sinklab_kept_positions")) > 0


def test_chat_with_server_equals_local_chat(server, local):
    lines = "\n".join(TURNS[:2]) + "\n/stats\n"
    cmd = [sys.executable, "-m", "sinklab.cli", "chat", "--server", server.url]
    cmd += ["--api-key", KEYS[0], "--max-new-tokens", str(MAX_TOKENS)]
    out = subprocess.run(cmd, input=lines, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and not out.stderr, out.stderr
    printed = out.stdout.splitlines()
    assert printed[:2] == local(TURNS[:2])
    assert printed[2].startswith("turns 2, tokens seen")


def test_non_loopback_bind_without_key_is_refused(capsys):
    run = run_main(capsys, "serve", "--host", "0.0.0.0", "--port", "0")
    assert_one_line_error(run, "--api-key")
    run = run_main(capsys, "serve", "--api-key", "k", "--api-key", "k", "--port", "0")
    assert_one_line_error(run, "twice")


def test_load_benchmark_runs_on_a_tiny_model(chat_dir, tmp_path):
    """benchmarks/serve_load.py end to end on the tiny model (so it cannot rot unseen)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sizes = [
        "--clients",
        "2",
        "--turns",
        "2",
        "--max-tokens",
        "3",
        "--soak-turns",
        "3",
        "--soak-max-tokens",
        "2",
        "--out",
        str(tmp_path / "o.json"),
    ]
    cache = ["--n-sink", str(N_SINK), "--window", str(WINDOW)]
    out = bench.main(["--model", str(chat_dir), *sizes, *cache])
    arm = out["arms"]["2"]
    assert arm["turns_done"] == 4 and 0 < arm["completion_tokens"] <= 12
    assert arm["tokens_per_s"] == pytest.approx(arm["completion_tokens"] / arm["wall_s"], 1e-2)
    assert arm["ttft_p50_s"] <= arm["ttft_p95_s"]
    assert 1 <= arm["prefill_batch_peak"] <= 2 and 1 <= arm["batch_size_peak"] <= 2
    assert (tmp_path / "o.json").exists()
    soak = out["soak"]
    assert soak["turns_done"] == 3 and len(soak["turn_seconds"]) == 3
    assert 0 < soak["kept"] <= N_SINK + WINDOW and soak["tokens_seen"] >= soak["kept"]
    # an arm whose every reply was empty gives no ratio, not a division by zero
    rounds = [
        [
            {**out["rounds"][0][0], "engine": "llama.cpp", "tokens_per_s": 0.0},
            {**out["rounds"][0][0]},
        ]
    ]
    arms = bench.summarise(rounds, [("sinklab", 2), ("llama.cpp", 2)])
    assert arms["llama.cpp/2"]["sinklab_over_llama_cpp"] is None
    assert arms["2"]["speedup_vs_1"] is None  # no one-client arm to compare with
