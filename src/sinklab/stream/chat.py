"""Multi-turn chat with a sink cache: StreamingLLM's own demo, on the model's chat template.

The cache never holds more than ``n_sink + window`` positions, however long the conversation:
each turn's new text (the template's rendering of the conversation, less what was already read)
is fitted into the cache before it is read (:meth:`SinkCache.evict_for_space`, StreamingLLM's),
then the reply is decoded one token at a time. Positions stay below the model's
``max_position_embeddings`` (:meth:`SinkCache.prepare`). The sinks (the conversation's first
tokens) are never evicted. The conversation starts the way the chat template starts it (the
template writes the model's own first token, e.g. Gemma's ``<bos>``); ``prepend`` puts a chosen
token before it, through :func:`sinklab.corpus.encode` as every other path that builds ids.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sinklab.corpus import DEFAULT_PREPEND, FirstToken, encode, first_token
from sinklab.errors import SinklabError
from sinklab.models.arch import input_device
from sinklab.stream.cache import CacheConfig, SinkCache
from sinklab.stream.generation import (
    TextStream,
    check_decoding,
    eos_ids,
    next_token,
    read_rows,
)


def _common(a: str, b: str) -> int:
    """Length of the common prefix of two strings, by comparisons of slices (C speed): the
    conversation's text grows with every turn, so a character loop would make a turn's cost grow
    with the conversation."""
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; the first difference is below hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


#: turns on which a session renders its whole conversation beside the bounded rendering and
#: compares the two (:meth:`ChatSession._rendered`); one difference and it renders in full
SELF_CHECKS = 3


@dataclass(frozen=True)
class ChatConfig:
    """One conversation's settings."""

    n_sink: int = 4
    window: int = 508
    max_new_tokens: int = 256  # per reply
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    system: str | None = None  # a system message (None: the template's default)
    prompt_chunk: int = 128  # a turn's text is read in chunks of at most this many tokens
    prepend: str | None = None  # a token before the template's start (None: the template's own)

    def __post_init__(self) -> None:
        check_decoding(self, ("n_sink", "window", "max_new_tokens", "prompt_chunk"))
        if self.prepend is not None and self.prepend.lower() == "none":
            raise SinklabError(
                "chat starts where its chat template starts (the model's own first token); "
                "--prepend none cannot remove it: pass a token to put before it, or omit --prepend"
            )


@dataclass
class Opened:
    """A turn whose text is read and whose reply is not decoded yet (:meth:`ChatSession.begin`)."""

    messages: list[dict[str, str]]  # the conversation with the new messages
    full: str  # its rendering, with the generation prompt
    prompt_tokens: int  # tokens read for this turn
    logits: torch.Tensor  # (V,) of the last of them


@dataclass
class Turn:
    """One reply: its text and tokens, what was read before it, and how fast it came."""

    reply: str
    new_tokens: int
    prompt_tokens: int
    seconds: float
    tokens_per_s: float


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """A message of a chat record: role and content, and what a server's tools add to it."""
    out: dict[str, Any] = {"role": str(m["role"]), "content": str(m["content"])}
    for key, kind in (("tool_calls", list), ("tool_call_id", str), ("sent", dict)):
        if key in m:
            if not isinstance(m[key], kind):
                raise TypeError(f"a message's {key} is not a {kind.__name__}")
            out[key] = m[key]
    return out


class ChatSession:
    """A conversation: ``turn(text)`` returns the assistant's reply; ``stats()``; ``reset()``."""

    def __init__(self, model: Any, tokenizer: Any, config: ChatConfig | None = None) -> None:
        self.model, self.tok = model, tokenizer
        self.config = config or ChatConfig()
        if not getattr(tokenizer, "chat_template", None):
            raise SinklabError(
                "this model's tokenizer has no chat template; sinklab chat needs an instruct "
                "model (the embedded SmolLM2-135M-Instruct has one)"
            )
        self.cache = SinkCache(model, CacheConfig("sink", self.config.n_sink, self.config.window))
        self.first = (  # what goes before the template's text (the template writes the start)
            first_token(tokenizer, self.config.prepend)
            if self.config.prepend not in (None, "", DEFAULT_PREPEND)
            else FirstToken(DEFAULT_PREPEND, (), tokenizer_default=True)
        )
        self.stops = eos_ids(model, tokenizer)
        self.gen = torch.Generator()
        self.reset()

    def reset(self) -> None:
        """Forget the conversation: empty history and cache."""
        self.cache.reset()
        self.messages: list[dict[str, str]] = []
        self.tools: list[dict[str, Any]] | None = None  # rendered by the template (a server's)
        if self.config.system is not None:
            self.messages.append({"role": "system", "content": self.config.system})
        self.read_text = ""  # the rendered conversation whose tokens the cache has read
        self.reply_at: int | None = None  # where the last reply starts in read_text
        self.pending: list[int] = []  # a sampled token not read yet (reply cut at max tokens)
        self.checks_left = SELF_CHECKS  # bounded renderings still compared with the full one
        self.bounded = True  # False: this template renders a message by more than its place
        self.gen.manual_seed(self.config.seed)
        self.turns = 0
        self.most_kept = 0
        self.top_position = 0
        self.last: Turn | None = None

    def _render(self, messages: list[dict[str, str]], prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=prompt
        )

    def _rendered(self, messages: list[dict[str, str]]) -> str:
        """The template's rendering of ``messages`` (the conversation, then this turn's new
        ones) with the generation prompt, at a cost that does not grow with the conversation.

        A template renders a conversation message by message, so the text up to the last reply
        (read already: ``read_text[:reply_at]``) stays as it was, and what follows it comes from
        rendering only the last exchange with and without the new messages
        (:meth:`_bounded`). The first :data:`SELF_CHECKS` turns also render the whole
        conversation and compare: a template that renders a message by more than its place (an
        index, the messages after it) gives a difference, and the session then renders the
        whole conversation every turn (exact, at a cost that grows with it)."""
        fast = self._bounded(messages) if self.bounded else None
        if fast is not None and self.checks_left <= 0:
            return fast
        full = self._render(messages, prompt=True)
        if fast is not None:
            self.checks_left -= 1
            self.bounded = fast == full
        return full

    def _bounded(self, messages: list[dict[str, str]]) -> str | None:
        """``messages``' rendering from the last exchange alone (:meth:`_rendered`), or None where
        it cannot be had that way (no reply yet, an empty one, a template that does not render
        the exchange as a prefix of the exchange and the new messages)."""
        old = self.messages
        if self.reply_at is None or len(old) < 2 or old[-1]["role"] != "assistant":
            return None
        reply = old[-1]["content"]
        if not reply or messages[: len(old)] != old:
            return None
        before = self._render(old[-2:], prompt=False)
        after = self._render([*old[-2:], *messages[len(old) :]], prompt=True)
        at = before.rfind(reply)
        if at < 0 or not after.startswith(before):
            return None
        # the conversation up to the reply + the reply and its closing + the new messages
        return self.read_text[: self.reply_at] + before[at:] + after[len(before) :]

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        extra = self.cache.prepare(len(tokens))
        x = torch.tensor([tokens], device=input_device(self.model))
        out = self.model(x, cache=self.cache, logits_to_keep=1, **extra).logits[0, -1]
        self.watched(int(extra["position_ids"].max()), self.cache.kept_length())
        return out

    @torch.inference_mode()
    def turn(self, text: str, on_text: Callable[[str], None] | None = None) -> Turn:
        """The user says ``text``; the reply is streamed to ``on_text`` and returned."""
        if not text.strip():
            raise SinklabError("empty message; type some text (or /stats, /reset, /quit)")
        opened = self.begin([{"role": "user", "content": text}])
        start = time.perf_counter()  # the reply's speed: decoding only
        stream, tokens, ended = TextStream(self.tok), [], False
        logits = opened.logits
        while True:
            tok = self.sample(logits)
            if tok in self.stops:
                ended = True
                break
            tokens.append(tok)
            if on_text is not None and (piece := stream.push([tok])):
                on_text(piece)
            if len(tokens) == self.config.max_new_tokens:
                break
            logits = self._forward([tok])
        if on_text is not None and (piece := stream.push([], final=True)):
            on_text(piece)
        return self.finish(opened, tokens, ended, time.perf_counter() - start)

    # A turn in three parts, for a caller that decodes the reply elsewhere (sinklab serve decodes
    # many sessions' replies in one batch): begin (read the new text), sample, finish.
    @torch.inference_mode()
    def begin(self, new: list[dict[str, str]]) -> Opened:
        """Read the conversation with the ``new`` messages appended (and the generation prompt)
        into the cache: -> the logits of its last token. Nothing else of the session changes
        until :meth:`finish`."""
        messages, full, ids = self.to_read(new)
        logits = self._read(ids, self.config.prompt_chunk)
        return Opened(messages, full, len(ids), logits)

    def to_read(self, new: list[dict[str, str]]) -> tuple[list[dict[str, str]], str, list[int]]:
        """What :meth:`begin` reads for the ``new`` messages, without reading it: the
        conversation with them, its rendering with the generation prompt, and the token ids the
        cache has not read yet (a server reads many sessions' ids in one forward:
        :func:`~sinklab.stream.generation.read_rows`, then :meth:`watched`)."""
        messages = [*self.messages, *new]
        full = self._rendered(messages)
        new_text = full[_common(self.read_text, full) :]  # what the cache has not read yet
        start = self.first if not self.read_text else FirstToken("none", (), False)
        return messages, full, self.pending + encode(new_text, self.tok, start)

    def watched(self, top_position: int, most_kept: int) -> None:
        """Record what a read outside the session's own cache gave the model (its highest
        position) and kept (its most positions), as :meth:`begin`'s own reads record them."""
        self.top_position = max(self.top_position, top_position)
        self.most_kept = max(self.most_kept, most_kept)

    def sample(self, logits: torch.Tensor, temperature: float | None = None) -> int:
        """The next token from ``logits`` (V,): greedy at temperature 0, else sampled with the
        session's generator (``temperature``: this turn's, else the config's)."""
        t = self.config.temperature if temperature is None else temperature
        return int(next_token(logits[None], t, self.gen)[0])

    def finish(
        self,
        opened: Opened,
        tokens: list[int],
        ended: bool,
        seconds: float,
        cut: str | None = None,
    ) -> Turn:
        """Close the turn ``opened``: the reply is ``tokens`` (``ended``: the model stopped by
        itself, else its last token is sampled but not read and comes first next turn).
        ``cut``: the reply as the caller cut it at a stop string; the conversation keeps that
        text, and the token that completed the stop string is dropped, never read."""
        reply = self.tok.decode(tokens, skip_special_tokens=True)
        if ended:
            self.pending, read = [], reply
        elif cut is not None:
            self.pending, read = [], self.tok.decode(tokens[:-1], skip_special_tokens=True)
        else:
            # The pending token is read first next turn: its text counts as read now, so the
            # next turn's new text starts after it (it is not read twice).
            self.pending, read = tokens[-1:], reply
        self.read_text = opened.full + read
        self.reply_at = len(opened.full)
        reply = reply if cut is None else cut
        self.messages = [*opened.messages, {"role": "assistant", "content": reply}]
        self.turns += 1
        rate = len(tokens) / seconds if seconds > 0 else math.inf
        self.last = Turn(reply, len(tokens), opened.prompt_tokens, round(seconds, 3), rate)
        return self.last

    def record(self) -> dict[str, Any]:
        """The conversation as JSON (everything but the cache and the generator's state)."""
        return {
            "messages": self.messages,
            "read_text": self.read_text,
            "pending": self.pending,
            "turns": self.turns,
            "most_kept": self.most_kept,
            "top_position": self.top_position,
            "reply_at": self.reply_at,
            "render_checks_left": self.checks_left,
            "bounded_render": self.bounded,
            "tools": self.tools,
        }

    def load_record(self, record: dict[str, Any]) -> None:
        """Take the conversation of :meth:`record` (the cache is set apart)."""
        try:
            messages = [_message(m) for m in record["messages"]]
            tools = record.get("tools")
            if tools is not None and not (
                isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
            ):
                raise TypeError("tools is not a list of objects")
            read_text, turns = str(record["read_text"]), int(record["turns"])
            pending = [int(t) for t in record["pending"]]
            most, top = int(record["most_kept"]), int(record["top_position"])
            # absent from records written before the bounded rendering: render in full once
            at = record.get("reply_at")
            reply_at = None if at is None else int(at)
            checks = int(record.get("render_checks_left", SELF_CHECKS))
            bounded = bool(record.get("bounded_render", True))
            if reply_at is not None and not 0 <= reply_at <= len(read_text):
                raise ValueError(f"reply_at {reply_at} outside the read text")
        except (KeyError, TypeError, ValueError) as err:
            raise SinklabError(f"not a chat record ({type(err).__name__}: {err})") from None
        self.messages, self.read_text, self.pending, self.turns = (
            messages,
            read_text,
            pending,
            turns,
        )
        self.most_kept, self.top_position = most, top
        self.reply_at, self.checks_left, self.bounded = reply_at, checks, bounded
        self.tools = tools

    def _read(self, ids: list[int], chunk: int) -> torch.Tensor:
        """Read a turn's tokens, each chunk fitted into the cache first (evict_for_space)."""
        if not ids:
            raise SinklabError("nothing to read for this turn")
        read = read_rows(self.model, self.cache, [ids], chunk, fit=True)
        self.watched(read.top_position[0], read.most_kept[0])
        return read.logits[0]

    def stats(self) -> dict[str, Any]:
        """Tokens seen, kept (and the bound), positions, the last reply's speed."""
        c = self.cache
        return {
            "turns": self.turns,
            "tokens_seen": c.stream_length(),
            "kept": c.kept_length(),
            "max_kept": self.most_kept,
            "capacity": c.capacity,
            "next_position": c.next_position(),
            "max_position_given": self.top_position,
            "position_bound": c.max_position,
            "last_reply_tokens": self.last.new_tokens if self.last else 0,
            "tokens_per_s": round(self.last.tokens_per_s, 2) if self.last else None,
        }
