"""The serve engine in-process (no HTTP, no thread: its prefill and decode steps driven by hand):
a reply cut at ``max_tokens`` is read once, as ``sinklab chat`` reads it, and a reply cut at a
stop string is kept in the session as the client got it, so that the client's whole
``messages`` list continues the session."""

from __future__ import annotations

import pytest

from sinklab.serve.config import ServeConfig
from sinklab.serve.engine import Engine, Job
from sinklab.serve.metrics import Metrics
from sinklab.stream.chat import ChatConfig, ChatSession
from test_chat import TURNS  # the chat tests' turns

N_SINK, WINDOW = 2, 200


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama", seed=13)


def _engine(model, chat_tokenizer) -> Engine:
    return Engine(
        model, chat_tokenizer, ServeConfig(n_sink=N_SINK, window=WINDOW), None, Metrics(), print
    )


def _turn(engine: Engine, sid: str, new, max_tokens: int, stops: list[str] | None = None):
    """One turn of session ``sid`` through the engine's prefill and decode steps -> its events."""
    session = engine.sessions.setdefault(sid, engine.new_session(sid, "t"))
    events: list[tuple[str, object]] = []
    job = Job(session, new, max_tokens, 0.0, None, stops or [], float("inf"), events.append)
    engine._prefill(job)
    while engine.active:
        engine._step()
    assert events[-1][0] == "done", events
    return events


def test_a_reply_cut_at_max_tokens_is_read_once(model, chat_tokenizer):
    """Two turns whose replies are cut at max_tokens: the engine reads what ``sinklab chat``
    reads, and every token the cache read, in order, is the conversation's rendering."""
    engine = _engine(model, chat_tokenizer)
    read: list[int] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, args: read.extend(args[0].flatten().tolist())
    )
    try:
        dones = [_turn(engine, "s", [{"role": "user", "content": t}], 3)[-1][1] for t in TURNS[:2]]
    finally:
        hook.remove()
    assert [d["finish_reason"] for d in dones] == ["length", "length"]
    chat = engine.sessions["s"].chat
    local = ChatSession(model, chat_tokenizer, ChatConfig(N_SINK, WINDOW, max_new_tokens=3))
    assert [d["reply"] for d in dones] == [local.turn(t).reply for t in TURNS[:2]]
    assert chat.read_text == local.read_text and chat.pending == local.pending
    full = chat_tokenizer.apply_chat_template(chat.messages, tokenize=False)
    want = chat_tokenizer(full, add_special_tokens=False).input_ids
    assert read + chat.pending == want[:-1]  # all but the closing "</s>", each once
    assert engine.sessions["s"].state.seen == len(read)


def test_a_reply_cut_at_a_stop_string_is_kept_as_the_client_got_it(model, chat_tokenizer):
    """The session keeps the reply the client got (what a whole ``messages`` list must repeat
    to continue it); the token that completed the stop string is dropped, not read next turn,
    so what the cache read over two turns is the conversation's rendering, each token once."""
    engine = _engine(model, chat_tokenizer)
    words = _turn(engine, "s", [{"role": "user", "content": TURNS[0]}], 6)[-1][1]["reply"]
    words = words.split()
    assert len(words) >= 3 and words.count(words[2]) == 1
    read: list[int] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, args: read.extend(args[0].flatten().tolist())
    )
    try:
        stopped = _turn(engine, "t", [{"role": "user", "content": TURNS[0]}], 6, [words[2]])
        done = stopped[-1][1]
        assert done["finish_reason"] == "stop" and done["reply"].split() == words[:2]
        chat = engine.sessions["t"].chat
        assert chat.messages[-1] == {"role": "assistant", "content": done["reply"]}
        assert chat.pending == []
        client = [*chat.messages, {"role": "user", "content": TURNS[1]}]  # the client's list
        assert client[: len(chat.messages)] == chat.messages  # continues this session
        _turn(engine, "t", client[len(chat.messages) :], 3)
    finally:
        hook.remove()
    full = chat_tokenizer.apply_chat_template(chat.messages, tokenize=False)
    want = chat_tokenizer(full, add_special_tokens=False).input_ids
    assert read + chat.pending == want[:-1]
