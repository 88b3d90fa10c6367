"""``sinklab serve`` loses nothing: a saved session continues with the next-token logits it had
(1e-5); broken, truncated or stale session files are refused one by one with a log line; a
server killed with SIGKILL during a streamed reply restarts with every completed turn (the cut
turn reported failed to its client, never applied) and goes on as if never stopped; a full disk
fails the turn and keeps the session as it was."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import threading
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from serving import Served
from sinklab.models.loading import load_model
from sinklab.serve.sessions import Session, SessionStore
from sinklab.stream.cache import SinkCache
from sinklab.stream.chat import ChatConfig, ChatSession
from test_chat import TURNS  # the chat tests' turns

N_SINK, WINDOW, MAX_TOKENS = 2, 30, 8
IDENTITY = {"model": "tiny", "n_sink": N_SINK, "window": WINDOW}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tiny_model_factory, chat_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-chat-faults")
    tiny_model_factory("llama", seed=13).save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(chat_dir):
    return load_model(str(chat_dir))


def _chat(loaded, max_new_tokens: int = MAX_TOKENS) -> ChatSession:
    cfg = ChatConfig(N_SINK, WINDOW, max_new_tokens=max_new_tokens)
    return ChatSession(loaded.model, loaded.tokenizer, cfg)


def _file(sid: str, suffix: str = ".json") -> str:
    """The name sinklab gives session ``sid``'s file (tenant ``tenant``: the tests' sessions)."""
    return SessionStore.stem("tenant", sid) + suffix


def _stored(loaded, turns: int) -> tuple[ChatSession, Session]:
    chat = _chat(loaded)
    for text in TURNS[:turns]:
        chat.turn(text)
    return chat, Session("dana", "tenant", chat, chat.cache.state())


def test_saved_session_continues_with_the_same_logits(loaded, tmp_path):
    chat, session = _stored(loaded, 3)
    logs: list[str] = []
    SessionStore(tmp_path, IDENTITY, logs.append).save(session, session.state)
    back = SessionStore(tmp_path, IDENTITY, logs.append).load_all(lambda: _chat(loaded))
    assert not logs and [s.id for s in back] == ["dana"]
    again = back[0].chat
    assert again.messages == chat.messages and again.turns == 3
    again.cache = SinkCache.from_state(loaded.model, [back[0].state])
    new = [{"role": "user", "content": TURNS[3]}]
    want, got = chat.begin(new).logits, again.begin(new).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_broken_session_files_are_refused_one_by_one(loaded, tmp_path):
    _, session = _stored(loaded, 2)
    store = SessionStore(tmp_path, IDENTITY, print)
    store.save(session, session.state)
    good = json.loads((tmp_path / _file("dana")).read_text())
    tensors = tmp_path / good["tensors"]
    (tmp_path / _file("junk")).write_text("{ not json")
    (tmp_path / _file("half")).write_text((tmp_path / _file("dana")).read_text()[:100])
    (tmp_path / "junk.json").write_text("{ not json")  # not named as sinklab's: never opened
    cut = _file("cut", ".2.safetensors")
    shutil.copy(tensors, tmp_path / cut)
    with open(tmp_path / cut, "r+b") as f:
        f.truncate(tensors.stat().st_size // 2)
    (tmp_path / _file("cut")).write_text(json.dumps({**good, "id": "cut", "tensors": cut}))
    (tmp_path / _file("old")).write_text(
        json.dumps({**good, "id": "old", "server": {**IDENTITY, "window": 9}})
    )
    logs: list[str] = []
    back = SessionStore(tmp_path, IDENTITY, logs.append).load_all(lambda: _chat(loaded))
    assert [s.id for s in back] == ["dana"]
    refused = sorted(line.split()[2] for line in logs if line.startswith("session file"))
    assert refused == sorted([_file("cut"), _file("half"), _file("junk"), _file("old")]), logs
    assert sum("are not sinklab's (junk.json); not read, not touched" in x for x in logs) == 1
    assert any("sha256" in line for line in logs) and any("stale" in line for line in logs)


def _load_within(store: SessionStore, loaded, seconds: float = 60) -> list[Session]:
    """``store.load_all`` in a thread, failing (not hanging) when it blocks past ``seconds``."""
    out: list[list[Session]] = []
    worker = threading.Thread(target=lambda: out.append(store.load_all(lambda: _chat(loaded))))
    worker.daemon = True
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "load_all blocked (it opened a FIFO?)"
    return out[0]


def _resaved(folder: Path, good: dict, sid: str, tensors: dict[str, torch.Tensor]) -> None:
    """A session ``sid`` like ``good`` but with ``tensors`` (a consistent sha256)."""
    data = save_tensors(tensors)
    name = _file(sid, ".2.safetensors")
    (folder / name).write_bytes(data)
    record = {**good, "id": sid, "tensors": name, "sha256": hashlib.sha256(data).hexdigest()}
    (folder / _file(sid)).write_text(json.dumps(record))


def test_a_fifo_and_deeply_nested_json_are_refused_one_line_each(loaded, tmp_path):
    _, session = _stored(loaded, 2)
    SessionStore(tmp_path, IDENTITY, print).save(session, session.state)
    os.mkfifo(tmp_path / _file("pipe"))
    (tmp_path / _file("deep")).write_text("[" * 100_000 + "]" * 100_000)
    logs: list[str] = []
    back = _load_within(SessionStore(tmp_path, IDENTITY, logs.append), loaded)
    assert [s.id for s in back] == ["dana"]
    by_file = {line.split()[2]: line for line in logs}
    assert sorted(by_file) == sorted([_file("deep"), _file("pipe")]) and len(logs) == 2, logs
    assert "FIFO" in by_file[_file("pipe")] and "deeper" in by_file[_file("deep")]
    assert all("\n" not in line for line in logs)


def test_a_tensors_name_leaving_the_folder_is_refused(loaded, tmp_path):
    folder = tmp_path / "sessions"
    _, session = _stored(loaded, 2)
    SessionStore(folder, IDENTITY, print).save(session, session.state)
    good = json.loads((folder / _file("dana")).read_text())
    # starts with evil's stem and a dot but leaves the folder; the file there is genuine
    shutil.copy(folder / good["tensors"], tmp_path / "outside.safetensors")
    (folder / _file("evil", ".")).mkdir()
    (folder / _file("evil")).write_text(
        json.dumps({**good, "id": "evil", "tensors": _file("evil", "./../../outside.safetensors")})
    )
    logs: list[str] = []
    back = SessionStore(folder, IDENTITY, logs.append).load_all(lambda: _chat(loaded))
    assert [s.id for s in back] == ["dana"]
    refused = [line for line in logs if line.startswith("session file")]
    assert len(refused) == 1 and refused[0].split()[2] == _file("evil"), logs
    assert "does not match the file name" in refused[0]
    assert any(f"({_file('evil', '.')}); not read" in line for line in logs)  # the folder


def test_a_session_missing_a_layers_tensor_is_refused_at_start_up(loaded, tmp_path):
    _, session = _stored(loaded, 2)
    SessionStore(tmp_path, IDENTITY, print).save(session, session.state)
    good = json.loads((tmp_path / _file("dana")).read_text())
    tensors = load_tensors((tmp_path / good["tensors"]).read_bytes())
    n_layers = loaded.model.config.num_hidden_layers
    assert n_layers >= 2 and f"{n_layers - 1}.sink_keys" in tensors
    last = n_layers - 1
    _resaved(tmp_path, good, "nokeys", {k: v for k, v in tensors.items() if k != "0.values"})
    _resaved(
        tmp_path,
        good,
        "nolayer",
        {k: v for k, v in tensors.items() if not k.startswith(f"{last}.")},
    )
    _resaved(tmp_path, good, "extra", {**tensors, f"{n_layers}.keys": tensors["0.keys"].clone()})
    logs: list[str] = []
    back = SessionStore(tmp_path, IDENTITY, logs.append).load_all(lambda: _chat(loaded))
    assert [s.id for s in back] == ["dana"]
    by_file = {line.split()[2]: line for line in logs}
    assert sorted(by_file) == sorted(_file(s) for s in ("extra", "nokeys", "nolayer")), logs
    assert "0.values" in by_file[_file("nokeys")]
    assert f"{last}.keys" in by_file[_file("nolayer")]
    assert f"{n_layers}.keys" in by_file[_file("extra")]


def _turn(http: httpx.Client, base: str, model: str, sid: str, text: str) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": MAX_TOKENS,
        "session_id": sid,
    }
    return http.post(base + "/chat/completions", json=body)


def test_kill9_mid_reply_restart_and_full_disk(chat_dir, loaded, tmp_path):
    reference = _chat(loaded)
    want = [reference.turn(t).reply for t in TURNS]
    long_chat = _chat(loaded, max_new_tokens=120)
    for t in TURNS[:2]:
        long_chat.turn(t)
    assert long_chat.turn(TURNS[2]).new_tokens == 120  # the reply to cut is long
    sessions = tmp_path / "sessions"
    args = ["--model", str(chat_dir), "--n-sink", str(N_SINK), "--window", str(WINDOW)]
    args += ["--sessions", str(sessions)]
    model = str(chat_dir)
    first = Served(*args)
    try:
        with httpx.Client(timeout=60) as http:
            for t, w in zip(TURNS[:2], want, strict=False):
                resp = _turn(http, first.base, model, "bob", t)
                assert resp.json()["choices"][0]["message"]["content"] == w
        client = openai.OpenAI(base_url=first.base, api_key="none", max_retries=0, timeout=60)
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": TURNS[2]}],
            max_tokens=120,
            stream=True,
            extra_body={"session_id": "bob"},
        )
        received = 0
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for ev in stream:
                received += sum(1 for c in ev.choices if c.delta.content)
                if received == 3:
                    first.kill()  # SIGKILL in the middle of the reply
    finally:
        first.kill()
    assert received >= 3
    (sessions / "evil.json").write_text("garbage")
    second = Served(*args)
    try:
        assert "are not sinklab's (evil.json); not read, not touched" in second.log
        with httpx.Client(timeout=60) as http:
            bob = http.get(second.base + "/sessions/bob").json()
            assert bob["turns"] == 2  # the cut turn was never applied
            for t, w in zip(TURNS[2:4], want[2:4], strict=True):
                resp = _turn(http, second.base, model, "bob", t)
                assert resp.json()["choices"][0]["message"]["content"] == w
            before = {p.name: p.read_bytes() for p in sessions.iterdir()}
            limit = resource.prlimit(second.proc.pid, resource.RLIMIT_FSIZE)
            resource.prlimit(second.proc.pid, resource.RLIMIT_FSIZE, (1, limit[1]))
            full = _turn(http, second.base, model, "bob", TURNS[4])
            assert full.status_code == 507, full.text
            assert "not applied" in full.json()["error"]["message"]
            assert http.get(second.base + "/sessions/bob").json()["turns"] == 4
            assert {p.name: p.read_bytes() for p in sessions.iterdir()} == before
            resource.prlimit(second.proc.pid, resource.RLIMIT_FSIZE, limit)
            resp = _turn(http, second.base, model, "bob", TURNS[4])
            assert resp.json()["choices"][0]["message"]["content"] == want[4]
            assert resp.json()["session"]["turns"] == 5
        assert "Traceback" not in second.log
    finally:
        second.stop()
