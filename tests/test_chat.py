"""``sinklab chat``: the session stays within n_sink + window over many turns, each turn's text is
fitted into the cache before it is read, the first reply equals plain greedy decoding (no cache),
and the CLI is driven through stdin; bad inputs are one-line errors. SmolLM2: integration."""

from __future__ import annotations

import copy
import io
import sys
from pathlib import Path

import pytest
import torch

from conftest import CHAT_TEMPLATE
from helpers import one_line_error, run_main
from sinklab.errors import SinklabError
from sinklab.stream.chat import ChatConfig, ChatSession
from sinklab.stream.generation import GenerateConfig

TURNS = [
    "To be or not to be",
    "that is the question whether tis nobler in the mind to suffer",
    "the slings and arrows of outrageous fortune",
    "or to take arms against a sea of troubles",
    "and by opposing end them to die to sleep no more",
]


@pytest.fixture(scope="module")
def chat_model(tiny_model_factory):
    return tiny_model_factory("llama", seed=13)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, chat_model, chat_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-chat")
    chat_model.save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return folder


@torch.no_grad()
def _plain_greedy(model, ids: list[int], n: int, stops: set[int]) -> list[int]:
    """Greedy decoding by full forwards over the whole text (no cache at all)."""
    out: list[int] = []
    for _ in range(n):
        tok = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
        if tok in stops:
            break
        out.append(tok)
    return out


def test_first_reply_equals_plain_greedy(chat_model, chat_tokenizer):
    session = ChatSession(chat_model, chat_tokenizer, ChatConfig(2, 200, max_new_tokens=8))
    turn = session.turn(TURNS[0])
    text = chat_tokenizer.apply_chat_template(
        [{"role": "user", "content": TURNS[0]}], tokenize=False, add_generation_prompt=True
    )
    ids = chat_tokenizer(text, add_special_tokens=False).input_ids
    want = _plain_greedy(chat_model, ids, 8, session.stops)
    assert turn.prompt_tokens == len(ids)
    assert turn.reply == chat_tokenizer.decode(want, skip_special_tokens=True)


def test_many_turns_stay_within_sinks_plus_window(chat_model, chat_tokenizer):
    cfg = ChatConfig(n_sink=2, window=10, max_new_tokens=6, prompt_chunk=4)
    session = ChatSession(chat_model, chat_tokenizer, cfg)
    spans: list[int] = []  # keys each forward attends to (layer 0)
    layer = session.cache.layers[0]
    update = layer.update

    def spy(k, v, *a, **kw):
        keys, values = update(k, v, *a, **kw)
        spans.append(keys.shape[-2])
        return keys, values

    layer.update = spy
    replies = [session.turn(t) for t in TURNS * 2]
    stats = session.stats()
    assert all(r.new_tokens >= 1 for r in replies)
    assert stats["max_kept"] <= 12 and stats["kept"] <= 12 and stats["capacity"] == 12
    assert max(spans) <= 12 + 1  # prompts fitted before they are read; a decode step: 12 + 1
    assert stats["tokens_seen"] > 3 * 12 and stats["turns"] == 10
    assert stats["max_position_given"] < stats["position_bound"]
    session.reset()
    assert session.stats()["tokens_seen"] == 0 and session.messages == []


@pytest.mark.parametrize("config", [ChatConfig, GenerateConfig])
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"window": 0}, "window must be a positive integer, got 0"),
        ({"n_sink": -1}, "n_sink must be a positive integer, got -1"),
        ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer, got 0"),
        (
            {"temperature": -0.5},
            r"temperature must be a finite number >= 0 \(0 = greedy\), got -0.5",
        ),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0 .* got nan"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0 .* got inf"),
    ],
)
def test_chat_and_generate_configs_check_alike(config, bad, message):
    """Both decoding configs reject the same values with the same words (one check,
    ``sinklab.stream.generation.check_decoding``); their own chunk sizes too."""
    with pytest.raises(SinklabError, match=message):
        config(**bad)
    chunk = "prompt_chunk" if config is ChatConfig else "prefill_chunk"
    with pytest.raises(SinklabError, match=f"{chunk} must be a positive integer, got 0"):
        config(**{chunk: 0})
    assert config(temperature=0.0).temperature == 0.0 and config(temperature=0.7).window > 0


def test_bad_chat_inputs(chat_model, chat_tokenizer, tiny_tokenizer):
    with pytest.raises(SinklabError, match="window"):
        ChatConfig(window=0)
    with pytest.raises(SinklabError, match="temperature"):
        ChatConfig(temperature=-1.0)
    with pytest.raises(SinklabError, match="chat template"):
        ChatSession(chat_model, tiny_tokenizer)
    with pytest.raises(SinklabError, match="empty message"):
        ChatSession(chat_model, chat_tokenizer, ChatConfig(2, 10)).turn("   ")


def _run(capsys, monkeypatch, stdin: str, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8"))))
    return run_main(capsys, "chat", *args)


def test_cli_chat_driven_through_stdin(capsys, monkeypatch, chat_dir):
    script = "\n".join([TURNS[0], "/stats", TURNS[1], TURNS[2], "/bogus", "/stats", "/reset"])
    script += "\n/stats\n/quit\nnever read\n"
    args = ("--model", str(chat_dir), "--n-sink", "2", "--window", "10", "--max-new-tokens", "5")
    code, out, err = _run(capsys, monkeypatch, script, *args)
    assert code == 0, err
    stats = [ln for ln in out.splitlines() if ln.startswith("turns ")]
    assert len(stats) == 3
    assert stats[0].startswith("turns 1,") and stats[1].startswith("turns 3,")
    assert "bound 12" in stats[1] and stats[2].startswith("turns 0, tokens seen 0")
    assert "(conversation reset)" in out
    assert [ln for ln in err.splitlines() if "unknown command /bogus" in ln]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--window", "0"), "window must be a positive integer"),
        (("--temperature", "-2"), "temperature must be a finite number >= 0"),
        (("--max-new-tokens", "0"), "max_new_tokens must be a positive integer"),
    ],
)
def test_cli_chat_bad_options_one_line(capsys, monkeypatch, chat_dir, args, needle):
    code, _, err = _run(capsys, monkeypatch, "hi\n", "--model", str(chat_dir), *args)
    one_line_error(code, err, needle)


def test_cli_chat_refuses_a_model_without_template(capsys, monkeypatch, tiny_model_dir):
    code, _, err = _run(capsys, monkeypatch, "hi\n", "--model", str(tiny_model_dir("llama")))
    one_line_error(code, err, "chat template")


@pytest.mark.integration
def test_smollm2_chat_answers_each_turn_in_a_bounded_cache(smollm2):
    """Three turns on the embedded instruct model with 4 + 60 (the conversation outgrows it)."""
    cfg = ChatConfig(n_sink=4, window=60, max_new_tokens=24)
    session = ChatSession(smollm2.model, smollm2.tokenizer, cfg)
    turns = [
        "What is the capital of France?",
        "Name a play by Shakespeare.",
        "Say hello in one word.",
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        replies = [session.turn(t) for t in turns]
    finally:
        torch.set_num_threads(threads)
    assert all(r.reply.strip() for r in replies), [r.reply for r in replies]
    assert "paris" in replies[0].reply.lower(), replies[0].reply
    stats = session.stats()
    assert stats["max_kept"] <= 64 and stats["tokens_seen"] > 64


def test_prepend_default_is_the_template_start_not_a_second_bos(chat_model, bos_tokenizer):
    """--prepend default means what no --prepend means: the chat template writes the start
    (a BOS tokenizer's <bos> is not added a second time before it)."""
    tok = copy.deepcopy(bos_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    plain = ChatSession(chat_model, tok, ChatConfig(n_sink=2, window=10, max_new_tokens=2))
    default = ChatSession(
        chat_model, tok, ChatConfig(n_sink=2, window=10, max_new_tokens=2, prepend="default")
    )
    assert plain.first.added == default.first.added == ()
    bos = ChatSession(
        chat_model, tok, ChatConfig(n_sink=2, window=10, max_new_tokens=2, prepend="bos")
    )
    assert bos.first.added == (tok.bos_token_id,)


def test_a_reply_cut_at_max_tokens_is_read_once(chat_model, chat_tokenizer):
    """A reply cut at max_new_tokens keeps its last token sampled but unread (``pending``); the
    next turn reads it first and not its text a second time: everything the cache read, decoded,
    is the second turn's rendering token for token."""
    cfg = ChatConfig(n_sink=2, window=200, max_new_tokens=3)
    session = ChatSession(chat_model, chat_tokenizer, cfg)
    read: list[int] = []
    hook = chat_model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, args: read.extend(args[0][0].tolist())
    )
    try:
        first = session.turn(TURNS[0])
        assert first.new_tokens == 3 and len(session.pending) == 1  # cut, not ended
        second = session.turn(TURNS[1])
    finally:
        hook.remove()
    read += session.pending  # the second reply's last token, sampled and not read yet
    full = chat_tokenizer.apply_chat_template(
        [*session.messages[:-1], {"role": "assistant", "content": second.reply}],
        tokenize=False,
        add_generation_prompt=False,
    )
    want = chat_tokenizer(full, add_special_tokens=False).input_ids
    assert read == want[: len(read)]  # no word read twice, none left out
    assert len(read) == len(want) - 1  # all but the closing "</s>"
    assert session.cache.stream_length() == len(read) - len(session.pending)


def _read_ids(model, session: ChatSession, turns: list[str]) -> list[int]:
    """Every token the model reads over ``turns`` of ``session``."""
    read: list[int] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, args: read.extend(args[0][0].tolist())
    )
    try:
        for text in turns:
            session.turn(text)
    finally:
        hook.remove()
    return read


@pytest.mark.parametrize("max_new", [2, 40])  # replies cut at max tokens (pending), or ended
def test_bounded_rendering_reads_what_the_full_rendering_reads(chat_model, chat_tokenizer, max_new):
    """A turn renders only the last exchange and the new message once the self-checks pass;
    the tokens read, the read text and the replies equal a session that renders the whole
    conversation every turn, and no rendering after the checks sees more than 3 messages."""
    cfg = ChatConfig(n_sink=2, window=40, max_new_tokens=max_new)
    turns = TURNS * 3
    full = ChatSession(chat_model, chat_tokenizer, cfg)
    full.bounded = False
    want = _read_ids(chat_model, full, turns)
    fast = ChatSession(chat_model, chat_tokenizer, cfg)
    sizes: list[int] = []
    render = fast._render
    fast._render = lambda messages, prompt: sizes.append(len(messages)) or render(messages, prompt)
    got = _read_ids(chat_model, fast, turns)
    assert got == want
    assert fast.read_text == full.read_text and fast.messages == full.messages
    assert fast.bounded and fast.checks_left == 0
    # turn 1 renders 1 message; turns 2-4 render in full beside the bounded pair; then pairs only
    checked = 1 + 3 * 3
    assert max(sizes[checked:]) == 3 and len(sizes) == checked + 2 * (len(turns) - 4)


def test_a_template_that_numbers_messages_is_rendered_whole(chat_model, chat_tokenizer):
    """A template whose text for a message depends on its place (a running number) fails the
    self-check: the session renders the whole conversation from then on, and reads exactly its
    rendering."""
    tok = copy.deepcopy(chat_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<s> {{ loop.index }} {{ m['role'] }} {{ m['content'] }} </s> "
        "{% endfor %}{% if add_generation_prompt %}<s> assistant {% endif %}"
    )
    cfg = ChatConfig(n_sink=2, window=200, max_new_tokens=3)
    session = ChatSession(chat_model, tok, cfg)
    _read_ids(chat_model, session, TURNS[:3])
    assert not session.bounded
    assert session.read_text.startswith(
        tok.apply_chat_template(session.messages[:-1], tokenize=False, add_generation_prompt=True)
    )


def test_common_prefix_matches_a_character_loop():
    from sinklab.stream.chat import _common

    def naive(a: str, b: str) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    g = __import__("random").Random(0)
    for _ in range(300):
        base = "".join(g.choice("ab") for _ in range(g.randrange(0, 40)))
        a = base + "".join(g.choice("abc") for _ in range(g.randrange(0, 6)))
        b = base + "".join(g.choice("abc") for _ in range(g.randrange(0, 6)))
        assert _common(a, b) == naive(a, b), (a, b)
