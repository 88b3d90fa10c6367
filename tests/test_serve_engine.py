"""The serve engine in-process (no HTTP, no thread: its prefill and decode steps driven by hand):
a reply cut at ``max_tokens`` is read once, as ``sinklab chat`` reads it, and a reply cut at a
stop string is kept in the session as the client got it, so that the client's whole
``messages`` list continues the session; one request failing in the shared prefill or in a
batched decode step (a non-finite row) fails alone."""

from __future__ import annotations

import pytest
import torch

from sinklab.serve.config import ServeConfig
from sinklab.serve.engine import Engine, Job
from sinklab.serve.metrics import Metrics
from sinklab.serve.sampling import Sampling
from sinklab.stream.chat import ChatConfig, ChatSession
from test_chat import TURNS  # the chat tests' turns

N_SINK, WINDOW = 2, 200


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama", seed=13)


def _engine(model, chat_tokenizer, **config) -> Engine:
    cfg = ServeConfig(n_sink=N_SINK, window=WINDOW, **config)
    return Engine(model, chat_tokenizer, cfg, None, Metrics(), print)


def _turn(engine: Engine, sid: str, new, max_tokens: int, stops: list[str] | None = None):
    """One turn of session ``sid`` through the engine's prefill and decode steps -> its events."""
    session = engine.sessions.setdefault(("t", sid), engine.new_session(sid, "t"))
    events: list[tuple[str, object]] = []
    job = Job(session, new, max_tokens, 0.0, None, stops or [], float("inf"), events.append)
    engine._prefill([job])
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
    chat = engine.sessions[("t", "s")].chat
    local = ChatSession(model, chat_tokenizer, ChatConfig(N_SINK, WINDOW, max_new_tokens=3))
    assert [d["reply"] for d in dones] == [local.turn(t).reply for t in TURNS[:2]]
    assert chat.read_text == local.read_text and chat.pending == local.pending
    full = chat_tokenizer.apply_chat_template(chat.messages, tokenize=False)
    want = chat_tokenizer(full, add_special_tokens=False).input_ids
    assert read + chat.pending == want[:-1]  # all but the closing "</s>", each once
    assert engine.sessions[("t", "s")].state.seen == len(read)


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
        chat = engine.sessions[("t", "t")].chat
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


def _alone(model, state, ids, piece):
    """``ids`` read into ``state`` (None: an empty stream) alone, written out here as
    StreamingLLM reads a prompt (each piece of ``piece`` tokens fitted into the cache first, a
    single token read as a decode step) -> (logits, state, highest position given, most kept)."""
    import torch

    from sinklab.stream.cache import CacheConfig, SinkCache

    cache = (
        SinkCache(model, CacheConfig("sink", 2, 12))
        if state is None
        else SinkCache.from_state(model, [state])
    )
    top = kept = 0
    with torch.inference_mode():
        for i in range(0, len(ids), piece):
            part = ids[i : i + piece]
            if len(ids) > 1:
                cache.evict_for_space(len(part))
            extra = cache.prepare(len(part))
            logits = model(torch.tensor([part]), cache=cache, **extra).logits[0, -1]
            top = max(top, int(extra["position_ids"].max()))
            kept = max(kept, cache.kept_length())
    return logits, cache.state(), top, kept


def test_sessions_read_together_equal_each_read_alone(model):
    """read_rows (the server's prefill): rows of different histories (full caches, evicting)
    read turns of different lengths (one token; less than a piece; several pieces, more than
    the window) in one left-padded forward a piece; each row equals the row read alone: logits
    to 1e-4, the same kept positions, ring and sinks, and the same logits on the next tokens."""
    import torch

    from sinklab.stream.cache import SinkCache
    from sinklab.stream.generation import read_rows

    piece = 8  # within _alone's window of 12: both read the same pieces
    gen = torch.Generator().manual_seed(5)
    histories = [torch.randint(4, 400, (n,), generator=gen).tolist() for n in (20, 5, 30, 14)]
    turns = [torch.randint(4, 400, (n,), generator=gen).tolist() for n in (1, 7, 25, 13)]
    states = [_alone(model, None, h, piece)[1] for h in histories]
    with torch.inference_mode():
        together = SinkCache.from_state(model, states)
        read = read_rows(model, together, turns, piece, fit=True)
    for b, (state, ids) in enumerate(zip(states, turns, strict=True)):
        logits, alone, top, kept = _alone(model, state, ids, piece)
        torch.testing.assert_close(read.logits[b], logits, atol=1e-4, rtol=0)
        assert (read.top_position[b], read.most_kept[b]) == (top, kept)
        got = together.state(b)
        assert (got.seen, got.base, got.positions, got.ring, sorted(got.sinks)) == (
            alone.seen, alone.base, alone.positions, alone.ring, sorted(alone.sinks)
        )  # fmt: skip
        # the sink keys may be stored rotated at another position (the batch's last step):
        # the states are the same stream when they continue alike
        after = [_alone(model, st, [7, 8, 9], piece)[0] for st in (got, alone)]
        torch.testing.assert_close(after[0], after[1], atol=1e-4, rtol=0)


def test_turns_waiting_together_are_read_in_one_prefill(model, chat_tokenizer):
    """Three sessions' turns queued at once are read in one prefill (the metric says 3) and each
    reply equals its session served alone."""
    together = _engine(model, chat_tokenizer)
    events = {sid: [] for sid in ("a", "b", "c")}
    for sid, text in zip(events, TURNS, strict=False):
        session = together.sessions.setdefault(("t", sid), together.new_session(sid, "t"))
        new = [{"role": "user", "content": text}]
        together.queue.put(Job(session, new, 4, 0.0, None, [], float("inf"), events[sid].append))
    while together.queue.qsize() or together.busy():
        together.step()
    assert together.metrics.prefill_peak == 3
    for sid, text in zip(events, TURNS, strict=False):
        alone = _turn(_engine(model, chat_tokenizer), sid, [{"role": "user", "content": text}], 4)
        assert events[sid][-1] == alone[-1]


def test_one_turn_failing_after_the_shared_read_fails_alone(model, chat_tokenizer):
    """A turn whose first token cannot be sampled (after the shared prefill: a temperature of
    5e-324, which the protocol refuses, given to the engine directly, makes its logits over the
    temperature infinite) fails with a 400 of its own and leaves its session as before; the turn
    read with it completes with the reply it gets alone."""
    engine = _engine(model, chat_tokenizer)
    events = {sid: [] for sid in ("ok", "bad")}
    for sid, text, t in zip(events, TURNS, (0.0, 5e-324), strict=False):
        session = engine.sessions.setdefault(("t", sid), engine.new_session(sid, "t"))
        new = [{"role": "user", "content": text}]
        engine.queue.put(Job(session, new, 3, t, None, [], float("inf"), events[sid].append))
    bad = engine.sessions[("t", "bad")].chat
    before = bad.record()
    while engine.queue.qsize() or engine.busy():
        engine.step()
    assert engine.metrics.prefill_peak == 2
    assert events["ok"][-1][0] == "done"
    kind, error = events["bad"][-1]
    assert kind == "error" and error.status == 400 and "not finite" in error.message, error
    assert bad.record() == before and engine.sessions[("t", "bad")].state.seen == 0
    alone = _turn(_engine(model, chat_tokenizer), "ok", [{"role": "user", "content": TURNS[0]}], 3)
    assert events["ok"][-1] == alone[-1]


class _Broken(Sampling):
    """A request whose first token cannot be sampled for a reason of the server's (not NaN)."""

    def pick(self, logits, counts, gen):
        raise RuntimeError("sampling broke")


def test_one_turn_whose_sampling_breaks_after_the_shared_read_fails_alone(model, chat_tokenizer):
    """A turn whose first token's sampling raises (after the shared prefill) fails with a 500 of
    its own ("failed to read"), leaves its session as before, and the turn read with it
    completes with the reply it gets alone."""
    engine = _engine(model, chat_tokenizer)
    events = {sid: [] for sid in ("ok", "bad")}
    for sid, text in zip(events, TURNS, strict=False):
        session = engine.sessions.setdefault(("t", sid), engine.new_session(sid, "t"))
        new = [{"role": "user", "content": text}]
        job = Job(session, new, 3, 0.0, None, [], float("inf"), events[sid].append)
        if sid == "bad":
            job.sampling = _Broken()
        engine.queue.put(job)
    bad = engine.sessions[("t", "bad")].chat
    before = bad.record()
    while engine.queue.qsize() or engine.busy():
        engine.step()
    assert engine.metrics.prefill_peak == 2
    kind, error = events["bad"][-1]
    assert kind == "error" and error.status == 500 and "failed to read" in error.message, error
    assert bad.record() == before and engine.sessions[("t", "bad")].state.seen == 0
    alone = _turn(_engine(model, chat_tokenizer), "ok", [{"role": "user", "content": TURNS[0]}], 3)
    assert events["ok"][-1] == alone[-1]


class _NaNOnStep(Sampling):
    """A request whose row turns NaN at its ``n``-th token (as the model's logits would)."""

    def pick(self, logits, counts, gen, allowed=None):
        if sum(counts.values()) + 1 >= 3:
            logits = torch.full_like(logits, float("nan"))
        return super().pick(logits, counts, gen, allowed)


def test_a_nan_row_in_the_batched_decode_fails_only_its_request(model, chat_tokenizer):
    """Two sessions decode in one batch; one's row is NaN at its third token: that request
    fails alone (500, "not finite"; its session as before), the other's reply is token for
    token the one it gets alone, and the engine goes on serving."""
    engine = _engine(model, chat_tokenizer)
    events = {sid: [] for sid in ("ok", "bad")}
    for sid, text in zip(events, TURNS, strict=False):
        session = engine.sessions.setdefault(("t", sid), engine.new_session(sid, "t"))
        new = [{"role": "user", "content": text}]
        job = Job(session, new, 6, 0.0, None, [], float("inf"), events[sid].append)
        job.sampling = _NaNOnStep() if sid == "bad" else None
        engine.queue.put(job)
    before = engine.sessions[("t", "bad")].chat.record()
    peak = 0
    while engine.queue.qsize() or engine.busy():
        engine.step()
        peak = max(peak, len(engine.active))
    assert peak == 2  # they did decode together
    kind, error = events["bad"][-1]
    assert kind == "error" and error.status == 500 and "not finite" in error.message, error
    assert engine.sessions[("t", "bad")].chat.record() == before
    alone = _turn(_engine(model, chat_tokenizer), "ok", [{"role": "user", "content": TURNS[0]}], 6)
    assert events["ok"] == alone
    again = _turn(engine, "ok2", [{"role": "user", "content": TURNS[0]}], 6)
    assert again[-1] == alone[-1]


def _score_task(prompt_ids: list[int], emit, max_tokens: int = 4):
    """A ``/v1/completions`` request for ``prompt_ids`` (greedy, ``logprobs: 1``)."""
    from sinklab.serve.scoring import Prompt, Task

    return Task([Prompt(prompt_ids)], max_tokens, Sampling(), 0, [], False, 1, float("inf"), emit)


def test_scoring_interleaves_with_chat_decode(model, chat_tokenizer):
    """A long ``/v1/completions`` prompt is read on the engine's thread, one forward per engine
    step, between the chat turns' decode steps (not on a thread of its own that competes with
    them): the chat reply is decoded while the prompt is still being read, and both answers equal
    the ones each gets alone."""
    ids = [
        int(t) for t in torch.randint(3, 200, (300,), generator=torch.Generator().manual_seed(5))
    ]
    alone = _engine(model, chat_tokenizer, prompt_chunk=16)  # scoring alone, drained by hand
    solo: list = []
    alone.scorer.submit(_score_task(ids, solo.append))
    alone.scorer.drain()
    new = [{"role": "user", "content": TURNS[0]}]
    chat_alone = _turn(_engine(model, chat_tokenizer, prompt_chunk=16), "s", new, 12)

    engine = _engine(model, chat_tokenizer, prompt_chunk=16)
    assert engine.config.prompt_chunk < len(ids) // 4  # the prompt takes many pieces
    timeline: list[str] = []
    step, scoring = engine.scorer.step, [False]

    per_step: list[int] = []

    def scorer_step() -> None:  # the model forwards made inside it are the scorer's
        scoring[0], before = True, timeline.count("score-forward")
        try:
            step()
        finally:
            scoring[0] = False
            per_step.append(timeline.count("score-forward") - before)

    engine.scorer.step = scorer_step  # type: ignore[method-assign]
    hook = model.register_forward_pre_hook(
        lambda *_: timeline.append("score-forward") if scoring[0] else None
    )
    scored: list = []
    engine.scorer.submit(
        _score_task(ids, lambda ev: (scored.append(ev), timeline.append("score-" + ev[0])))
    )
    session = engine.new_session("s", "t")
    engine.sessions[("t", "s")] = session
    chat: list = []
    job = Job(session, new, 12, 0.0, None, [], float("inf"),
              lambda ev: (chat.append(ev), timeline.append("chat-" + ev[0])))  # fmt: skip
    engine.submit(job)
    try:
        for _ in range(500):
            if not (engine.busy() or engine.scorer.pending() or engine.queue.qsize()):
                break
            engine.step()
    finally:
        hook.remove()
    chat_done, score_done = timeline.index("chat-done"), timeline.index("score-done")
    first_text = timeline.index("chat-text")
    # the prompt was still being read when the chat reply ended, and was read during it
    assert chat_done < score_done
    assert chat_alone[-1][1]["usage"]["completion_tokens"] == 12  # twelve decode steps
    # the scorer's own forwards, one per engine step, while the reply was being decoded
    assert timeline[first_text:chat_done].count("score-forward") >= 9
    assert max(per_step) == 1  # one forward an engine step, never the whole prompt at once
    assert chat == chat_alone
    assert scored == solo and scored[-1][0] == "done"


def test_a_chat_decode_failure_leaves_the_stateless_request_beside_it(model, chat_tokenizer):
    """The engine thread: a chat turn whose decode step raises gets a 500, and the
    ``/v1/completions`` request being read beside it still gets its own answer, equal to the one
    it gets alone (the scorer catches its own errors; the chat's are not its). ``stop`` then
    answers what is still waiting with a 503 instead of leaving its client to hang."""
    import threading

    ids = [
        int(t) for t in torch.randint(3, 200, (120,), generator=torch.Generator().manual_seed(7))
    ]
    alone = _engine(model, chat_tokenizer, prompt_chunk=16)
    solo: list = []
    alone.scorer.submit(_score_task(ids, solo.append))
    alone.scorer.drain()

    engine = _engine(model, chat_tokenizer, prompt_chunk=16)
    real_step = engine._step
    decoded = [0]

    def failing_step() -> None:  # the chat batch's second decode step raises
        decoded[0] += 1
        if decoded[0] == 2:
            raise RuntimeError("a broken decode step")
        real_step()

    engine._step = failing_step  # type: ignore[method-assign]
    chat_done, score_done = threading.Event(), threading.Event()
    chat: list = []
    scored: list = []

    def on_chat(ev) -> None:
        chat.append(ev)
        if ev[0] in ("done", "error"):
            chat_done.set()

    def on_score(ev) -> None:
        scored.append(ev)
        if ev[0] in ("done", "error"):
            score_done.set()

    session = engine.new_session("s", "t")
    engine.sessions[("t", "s")] = session
    new = [{"role": "user", "content": TURNS[0]}]
    engine.scorer.submit(_score_task(ids, on_score))
    engine.submit(Job(session, new, 12, 0.0, None, [], float("inf"), on_chat))
    waiting: list = []
    engine.start()
    try:
        assert chat_done.wait(60) and score_done.wait(60)
    finally:
        engine.stop()
    assert chat[-1][0] == "error" and chat[-1][1].status == 500
    assert scored == solo and scored[-1][0] == "done"

    # after stop: a request still queued is answered 503 (the thread is gone)
    engine.scorer.submit(_score_task(ids, waiting.append))
    engine.stop()
    assert waiting and waiting[-1][0] == "error" and waiting[-1][1].status == 503
