"""The serve engine's session lifecycle in-process, on a tiny model with an injectable clock: an
idle session expires after ``--session-ttl`` (memory and files), the least recently used idle one
leaves memory for a new one (its files stay until its TTL, and naming it loads it back), 429 only
when every slot is busy now, per-key caps, listings and reuse are each key's own, and a long
prompt is read a piece a step between the other replies' tokens (``--prefill-chunk``)."""

from __future__ import annotations

import pytest

from sinklab.serve.config import ServeConfig
from sinklab.serve.engine import Engine, Job
from sinklab.serve.metrics import Metrics
from sinklab.serve.protocol import ApiError
from sinklab.serve.sessions import SessionStore
from test_chat import TURNS

N_SINK, WINDOW = 2, 30


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama", seed=13)


def _engine(model, tok, tmp_path=None, clock=None, **limits) -> Engine:
    cfg = ServeConfig(model_id="tiny", n_sink=N_SINK, window=WINDOW, **limits)
    store = None
    if tmp_path is not None:
        store = SessionStore(tmp_path, {"model": "tiny", "n_sink": N_SINK, "window": WINDOW}, print)
        store.claim()
    return Engine(model, tok, cfg, store, Metrics(), print, clock or Clock())


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _turn(engine: Engine, tenant: str, sid: str | None, messages, max_tokens: int = 3):
    """One request through the registry and the engine's steps -> (session, events)."""
    session, new, created = engine.registry.acquire(tenant, sid, messages)
    events: list = []
    job = Job(session, new, max_tokens, 0.0, None, [], float("inf"), events.append, created)
    engine.queue.put(job)
    while engine.queue.qsize() or engine.busy():
        engine.step()
    assert events[-1][0] == "done", events
    return session, events


def _files(folder) -> set[str]:
    return {p.name for p in folder.iterdir() if p.name != ".sinklab-sessions"}


def test_idle_sessions_expire_after_the_ttl_in_memory_and_on_disk(model, chat_tokenizer, tmp_path):
    clock = Clock()
    engine = _engine(model, chat_tokenizer, tmp_path, clock, session_ttl_s=60)
    _turn(engine, "k", "old", _user(TURNS[0]))
    clock.now += 50
    _turn(engine, "k", "young", _user(TURNS[1]))
    assert len(_files(tmp_path)) == 4  # two sessions, a JSON and a tensors file each
    clock.now += 20  # old: idle 70 s > 60; young: 20 s
    engine.registry.sweep()
    assert [r["id"] for r in engine.registry.listing("k")] == ["young"]
    assert engine.registry.find("k", "old") is None
    stem = SessionStore.stem("k", "young")
    assert _files(tmp_path) == {f"{stem}.json", f"{stem}.1.safetensors"}


def test_the_least_recently_used_idle_session_is_evicted_and_comes_back(
    model, chat_tokenizer, tmp_path
):
    clock = Clock()
    engine = _engine(model, chat_tokenizer, tmp_path, clock, max_sessions=2, session_ttl_s=100)
    for sid in ("a", "b"):
        _turn(engine, "k", sid, _user(TURNS[0]))
        clock.now += 1
    _turn(engine, "k", "a", _user(TURNS[1]))  # a is used again: b is the least recent
    clock.now += 1
    _turn(engine, "k", "c", _user(TURNS[2]))
    assert set(engine.sessions) == {("k", "a"), ("k", "c")}
    rows = {r["id"]: r for r in engine.registry.listing("k")}
    assert set(rows) == {"a", "b", "c"} and rows["b"]["in_memory"] is False
    assert rows["b"]["turns"] == 1 and rows["a"]["turns"] == 2
    # naming b loads it back from disk (evicting a, now the least recent), with its history
    session, _events = _turn(engine, "k", "b", _user(TURNS[3]))
    assert session.chat.turns == 2 and session.chat.messages[0]["content"] == TURNS[0]
    assert set(engine.sessions) == {("k", "b"), ("k", "c")}
    # an evicted session's files go at its TTL
    clock.now += 150
    engine.registry.sweep()
    assert engine.registry.listing("k") == [] and _files(tmp_path) == set()


def test_429_only_when_every_slot_is_busy_now(model, chat_tokenizer):
    engine = _engine(model, chat_tokenizer, max_sessions=2)
    first, *_ = engine.registry.acquire("k", None, _user("one"))
    _second, *_ = engine.registry.acquire("k", None, _user("two"))
    with pytest.raises(ApiError) as err:
        engine.registry.acquire("k", None, _user("three"))
    assert err.value.status == 429 and "answering a turn now" in err.value.message
    assert err.value.headers["Retry-After"] == "1"
    engine.registry.release(first, False)  # idle now: its slot can be taken
    _third, _, created = engine.registry.acquire("k", None, _user("three"))
    assert created and ("k", first.id) not in engine.sessions


def test_seventy_one_shot_requests_are_never_refused(model, chat_tokenizer, tmp_path):
    engine = _engine(model, chat_tokenizer, tmp_path, max_sessions=4, max_saved_sessions=8)
    ids = set()
    for i in range(70):
        session, _ = _turn(engine, "k", None, _user(f"question {i}"), max_tokens=1)
        ids.add(session.id)
    assert len(ids) == 70 and len(engine.sessions) == 4
    assert len(engine.registry.listing("k")) == 12  # 4 in memory, 8 on disk
    assert len(_files(tmp_path)) == 24  # the folder is bounded too


def test_per_key_caps_keep_one_key_from_taking_every_slot(model, chat_tokenizer):
    engine = _engine(model, chat_tokenizer, max_sessions=8, max_sessions_per_key=2)
    a1, *_ = engine.registry.acquire("a", None, _user("1"))
    a2, *_ = engine.registry.acquire("a", None, _user("2"))
    with pytest.raises(ApiError) as err:
        engine.registry.acquire("a", None, _user("3"))
    assert err.value.status == 429 and "this key's sessions" in err.value.message
    engine.registry.acquire("b", None, _user("1"))  # another key is not held back
    engine.registry.release(a1, False)
    engine.registry.acquire("a", None, _user("3"))  # a's own idle session made room
    assert ("a", a1.id) not in engine.sessions and ("a", a2.id) in engine.sessions
    busy = _engine(model, chat_tokenizer, max_requests_per_key=1)
    busy.registry.acquire("a", None, _user("1"))
    with pytest.raises(ApiError) as err:
        busy.registry.acquire("a", None, _user("2"))
    assert err.value.status == 429 and "in flight" in err.value.message
    busy.registry.acquire("b", None, _user("1"))


def test_resent_history_continues_only_the_keys_own_idle_session(model, chat_tokenizer):
    engine = _engine(model, chat_tokenizer)
    mine, events = _turn(engine, "a", None, _user(TURNS[0]))
    history = [*_user(TURNS[0]), {"role": "assistant", "content": events[-1][1]["reply"]}]
    history += _user(TURNS[1])
    theirs, _, created = engine.registry.acquire("b", None, history)
    assert created and theirs.id != mine.id  # never another key's session
    engine.registry.release(theirs, True)
    again, new, created = engine.registry.acquire("a", None, history)
    assert again is mine and not created and new == _user(TURNS[1])
    # while a's session answers, the same history starts a fresh one (never a busy session)
    other, _, created = engine.registry.acquire("a", None, history)
    assert created and other is not mine
    # listings are each key's own, and ids too: b may hold its own session of mine's id
    assert {r["id"] for r in engine.registry.listing("b")} == set()
    same_id, _, created = engine.registry.acquire("b", mine.id, _user("hi"))
    assert created and same_id is not mine


def test_a_long_prompt_is_read_a_piece_a_step_between_the_others_tokens(model, chat_tokenizer):
    engine = _engine(model, chat_tokenizer, prompt_chunk=8)
    talker, *_ = engine.registry.acquire("k", None, _user(TURNS[0]))
    talk: list = []
    engine.queue.put(Job(talker, _user(TURNS[0]), 40, 0.0, None, [], float("inf"), talk.append))
    engine.step()
    engine.step()
    assert engine.active  # decoding
    long_text = " ".join(TURNS * 4)
    reader, *_ = engine.registry.acquire("k", None, _user(long_text))
    read: list = []
    engine.queue.put(Job(reader, _user(long_text), 2, 0.0, None, [], float("inf"), read.append))
    steps_reading, tokens_meanwhile = 0, 0
    while engine.queue.qsize() or engine.busy():
        before = len(talk)
        engine.step()
        if engine.reading:
            steps_reading += 1
            tokens_meanwhile += len(talk) - before
    text = chat_tokenizer.apply_chat_template(
        _user(long_text), tokenize=False, add_generation_prompt=True
    )
    n_ids = len(chat_tokenizer(text, add_special_tokens=False).input_ids)
    assert steps_reading >= n_ids // 8 - 1 > 5  # 8 tokens a step, at most
    assert tokens_meanwhile >= steps_reading - 1  # the talker got a token (nearly) every step
    assert read[-1][0] == "done" and talk[-1][0] == "done"
    # the reply read piece by piece equals the one read in one go
    alone = _engine(model, chat_tokenizer, prompt_chunk=8)
    _, events = _turn(alone, "k", None, _user(long_text), max_tokens=2)
    assert events[-1][1]["reply"] == read[-1][1]["reply"]


def test_a_timeout_is_checked_between_pieces_and_not_committed(model, chat_tokenizer):
    engine = _engine(model, chat_tokenizer, prompt_chunk=4)
    session, new, created = engine.registry.acquire("k", "slow", _user(" ".join(TURNS * 4)))
    events: list = []
    import time

    job = Job(session, new, 2, 0.0, None, [], time.monotonic() + 1e9, events.append, created)
    engine.queue.put(job)
    engine.step()
    assert engine.reading == [job]
    job.deadline = time.monotonic() - 1  # the deadline passes while the prompt is read
    engine.step()
    kind, error = events[-1]
    assert kind == "error" and error.status == 504 and not engine.busy()
    assert ("k", "slow") not in engine.sessions  # made for the turn, dropped with it
    assert session.chat.turns == 0 and session.state.seen == 0


def test_a_restart_restores_only_the_sessions_still_live(model, chat_tokenizer, tmp_path):
    """Sessions written by one server and read by the next: one that passed its TTL while the
    server was down is removed (files too), the live one is served with its history."""
    clock = Clock()
    first = _engine(model, chat_tokenizer, tmp_path, clock, session_ttl_s=60)
    _turn(first, "k", "old", _user(TURNS[0]))
    clock.now += 50
    _turn(first, "k", "live", _user(TURNS[1]))
    clock.now += 30  # down for a while: old idle 80 s > 60, live 30 s
    second = _engine(model, chat_tokenizer, tmp_path, clock, session_ttl_s=60)
    assert second.load() == 1
    assert [r["id"] for r in second.registry.listing("k")] == ["live"]
    assert second.registry.find("k", "live").chat.messages[0]["content"] == TURNS[1]
    stem = SessionStore.stem("k", "live")
    assert _files(tmp_path) == {f"{stem}.json", f"{stem}.1.safetensors"}


def test_over_http_sessions_expire_are_evicted_and_listed_per_key(
    tiny_model_factory, chat_tokenizer, tmp_path
):
    """The real server through the official openai client: 20 one-shot conversations against
    --max-sessions 4 are all answered (the least recently used idle session leaves, no 429);
    GET /v1/sessions lists only the caller's; with --session-ttl 2 an idle session is gone from
    the listing and the folder a few seconds later."""
    import time

    import httpx
    import openai

    from serving import Served

    folder = tmp_path / "model"
    tiny_model_factory("llama", seed=13).save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    sessions = tmp_path / "sessions"
    args = ["--model", str(folder), "--n-sink", str(N_SINK), "--window", str(WINDOW)]
    args += ["--sessions", str(sessions), "--max-sessions", "4", "--max-saved-sessions", "4"]
    args += ["--session-ttl", "2", "--max-tokens", "8", "--api-key", "ka", "--api-key", "kb"]
    server = Served(*args)
    try:
        a = openai.OpenAI(base_url=server.base, api_key="ka", max_retries=0, timeout=60)
        for i in range(20):
            out = a.chat.completions.create(
                model=str(folder), messages=[{"role": "user", "content": f"q {i}"}], max_tokens=2
            )
            assert out.choices[0].message.content is not None
        a.chat.completions.create(
            model=str(folder),
            messages=[{"role": "user", "content": "keep"}],
            max_tokens=2,
            extra_body={"session_id": "mine"},
        )
        with httpx.Client(timeout=30) as http:
            mine = http.get(server.base + "/sessions", headers={"Authorization": "Bearer ka"})
            theirs = http.get(server.base + "/sessions", headers={"Authorization": "Bearer kb"})
            assert "mine" in {r["id"] for r in mine.json()["data"]}
            assert theirs.json()["data"] == []
            for _ in range(100):  # the sweep runs every second
                rows = http.get(server.base + "/sessions", headers={"Authorization": "Bearer ka"})
                if not rows.json()["data"]:
                    break
                time.sleep(0.2)
            assert rows.json()["data"] == []
        assert {p.name for p in sessions.iterdir()} == {".sinklab-sessions"}
    finally:
        server.stop()
    assert "Traceback" not in server.log
