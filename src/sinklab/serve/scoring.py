"""Stateless reads and replies for ``/v1/completions`` and ``/v1/responses``: a prompt of token
ids is read through its own :class:`~sinklab.stream.cache.SinkCache` (``n_sink + window`` of the
server's config, each piece fitted into the cache first, as ``sinklab chat`` reads a turn), so
scoring a long prompt is bounded in memory, then a reply is decoded one token at a time with the
request's :class:`~sinklab.serve.sampling.Sampling`.

The work runs on the chat engine's thread, interleaved with its steps (:class:`Scorer`): one
request at a time, one forward of it (a piece of its prompt, or one token of a reply) per engine
step, beside the chat turns' pieces and decode; so a long prompt on these routes slows the chat
replies by a piece per step, as a long chat prompt does, and never competes with them for the
cores from a second thread. A request waits its turn in a bounded queue (429 beyond it) and is
dropped between pieces and tokens when its client leaves or its ``--request-timeout`` passes.
Nothing is kept after the reply: these routes hold no session.

With a prompt that fits in the window, every prompt token's logprob equals a plain forward's
log-softmax (the cache evicts nothing; only the summation order of the pieces differs;
docs/serve-routes.md#scoring).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from sinklab.models.arch import input_device
from sinklab.serve.grammar import Constraint
from sinklab.serve.protocol import ApiError
from sinklab.serve.sampling import NotFinite, Sampling, TurnFailed
from sinklab.stream.cache import CacheConfig, SinkCache
from sinklab.stream.generation import TextStream, _piece, eos_ids, left_padded

GROUP = 8  # prompts of one request read together (their logits: GROUP x piece x vocabulary)

# ("piece", Piece) | ("finish", (index, reason)) | ("done", usage dict) | ("error", ApiError)
Emit = Callable[[tuple[str, Any]], None]


@dataclass
class Entry:
    """One token of a legacy ``logprobs`` block: its text, the model's logprob of it given what
    comes before (None for a prompt's first token), the top alternatives, its text offset."""

    token: str
    logprob: float | None
    top: dict[str, float] | None
    offset: int


@dataclass
class Piece:
    """Text of choice ``index`` ready to go out, with its tokens' entries (when asked)."""

    index: int
    text: str
    entries: list[Entry]  # or, for a task with ``chat_logprobs``, the chat route's entries


@dataclass
class Prompt:
    """One prompt: its token ids and, when it came as text, that text and where each token
    starts in it (the tokenizer's offsets; else both come from decoding the ids)."""

    ids: list[int]
    text: str | None = None
    offsets: list[int] | None = None


@dataclass
class Task:
    """One request: its prompts (one choice each) and how to continue them."""

    prompts: list[Prompt]
    max_tokens: int
    sampling: Sampling  # with the request's temperature
    seed: int
    stops: list[str]
    echo: bool
    logprobs: int | None  # top alternatives per token (legacy ``logprobs``); None: no block
    deadline: float
    emit: Emit
    stop_ids: set[int] | None = None  # None: the model's end-of-sequence ids
    # a response format's mask (:mod:`.grammar`): a fresh one for each choice
    grammar: Callable[[], Constraint] | None = None
    copies: int = 1  # choices per prompt (``n``): choice ``i * copies + j`` is prompt i's j-th
    continues: bool = True  # the reply continues the prompt's text (False: a chat reply)
    # chat ``logprobs`` (``n`` > 1 on the chat route): each reply token's entry as the chat
    # route gives it (:meth:`Sampling.logprob_entry`, ``top_logprobs`` from the sampling), in
    # place of legacy entries; the end-of-turn token has none, as on the chat route
    chat_logprobs: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)


class Gone(Exception):
    """The task's client left, or its deadline passed: stop working on it."""


def take_all(q: queue.Queue) -> list[Any]:
    """Everything waiting in ``q``, taken off it without blocking (the engine's queues)."""
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


class Scorer:
    """The stateless routes' work, stepped by the chat engine's thread: :meth:`step` runs one
    forward of the request in hand (a piece of its prompts or one token of a reply), so the
    engine interleaves it with the chat turns (docs/serve-routes.md)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        n_sink: int,
        window: int,
        chunk: int,
        max_queue: int,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.model, self.tok = model, tokenizer
        self.cache_config = CacheConfig("sink", n_sink, window)
        self.chunk, self.max_queue = chunk, max_queue
        self.eos = eos_ids(model, tokenizer)
        self.queue: queue.Queue[Task] = queue.Queue()
        self.wake = wake  # tells the engine's thread that work is waiting
        self._task: Task | None = None
        self._work: Generator[None, None, None] | None = None
        self.log: Callable[[str], None] = lambda _: None

    def submit(self, task: Task) -> None:
        """Queue ``task`` (429 when ``max_queue`` are waiting), from any thread."""
        if self.queue.qsize() >= self.max_queue:
            raise ApiError(
                429,
                f"{self.queue.qsize()} requests are waiting for the model; retry shortly",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self.queue.put(task)
        self.wake()

    def pending(self) -> bool:
        """Whether a request is in hand or waiting."""
        return self._work is not None or not self.queue.empty()

    def step(self) -> None:
        """Run one forward of the request in hand (taking the next one when none is): called
        once per engine step, on the engine's thread. A request that fails answers alone."""
        while self._work is None:  # the next request whose client still waits for it
            try:
                task = self.queue.get_nowait()
            except queue.Empty:
                return
            try:
                self._check(task)
            except Gone:  # it left, or its deadline passed, while waiting: not a forward more
                self._dropped(task)
                continue
            self._task, self._work = task, self.run(task)
        task = self._task
        assert task is not None
        try:
            next(self._work)
            return
        except StopIteration:
            pass
        except Gone:
            self._dropped(task)
        except TurnFailed as err:
            self._answer(task, ApiError(err.status, str(err), code=err.code))
        except ApiError as err:  # e.g. a format's matcher that fails to start
            self._answer(task, err)
        except Exception as err:  # never lose the engine: that request fails alone
            self.log(f"completion failed: {type(err).__name__}: {err}")
            self._answer(task, ApiError(500, "the server failed to decode", "server_error"))
        self._task = self._work = None

    def _dropped(self, task: Task) -> None:
        self.log("completion dropped: its client left or --request-timeout passed")
        if not task.cancelled.is_set():
            self._answer(task, _timeout())

    def _answer(self, task: Task, error: ApiError) -> None:
        """Send ``error`` to ``task``'s client; a client that cannot be told (its loop closed at
        shut-down) is logged, never allowed to stop the engine."""
        try:
            task.emit(("error", error))
        except Exception as err:
            self.log(f"completion error not delivered: {type(err).__name__}: {err}")

    def fail_all(self, error: ApiError) -> None:
        """Answer the request in hand and every waiting one with ``error`` (the engine failed)."""
        tasks = [] if self._task is None else [self._task]
        self._task = self._work = None
        for task in [*tasks, *take_all(self.queue)]:
            self._answer(task, error)

    def drain(self) -> None:
        """Run every request to its end on the calling thread (tests without an engine)."""
        while self.pending():
            self.step()

    # ------------------------------------------------------------------ the work
    def _check(self, task: Task) -> None:
        if task.cancelled.is_set() or time.monotonic() > task.deadline:
            raise Gone

    @torch.inference_mode()
    def run(self, task: Task) -> Generator[None, None, None]:
        """Answer every prompt of ``task`` in order (events through ``task.emit``): up to
        :data:`GROUP` prompts are read together, one left-padded forward a piece; it yields
        before each forward (where the engine runs its own step)."""
        prompt_tokens = completion_tokens = 0
        want = task.echo and task.logprobs is not None  # every prompt token's logprob
        for start in range(0, len(task.prompts), GROUP):
            group = task.prompts[start : start + GROUP]
            echoes = [self._echo(task, p, want) for p in group]
            lasts, cache = yield from self._read(
                task, [p.ids for p in group], [e[1] for e in echoes]
            )
            for b, (prompt, (echoed, entries, _)) in enumerate(zip(group, echoes, strict=True)):
                prompt_tokens += len(prompt.ids)  # once, however many choices (as OpenAI's)
                for j in range(task.copies):  # each choice from the same read, its own draws
                    index = (start + b) * task.copies + j
                    detok = echoes[b][2] if j == 0 else self._echo(task, prompt, False)[2]
                    if task.echo:
                        copied = [replace(e) for e in entries or []]
                        task.emit(("piece", Piece(index, echoed, copied)))
                    # its own cache to decode in (the others' rows are not read with it): only
                    # when a second token is decoded, the first comes from the read's logits
                    own = cache
                    if (len(group) > 1 or task.copies > 1) and task.max_tokens > 1:
                        own = SinkCache.from_state(self.model, [cache.state(b)])
                    completion_tokens += yield from self._decode(
                        task, index, own, lasts[b], detok, len(echoed), task.seed + j
                    )
        task.emit(
            (
                "done",
                {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
            )
        )

    def _echo(
        self, task: Task, prompt: Prompt, want: bool
    ) -> tuple[str, list[Entry] | None, TextStream]:
        """The prompt's echoed text, its entries to fill in (``want``), and the detokenizer its
        reply is decoded with."""
        ids = prompt.ids
        detok = TextStream(self.tok)
        echoed, entries = "", []
        if task.echo and prompt.text is not None and prompt.offsets is not None:
            echoed = prompt.text
            if want:
                entries = [Entry(self.tok.decode([t]), None, None, at)
                           for t, at in zip(ids, prompt.offsets, strict=True)]  # fmt: skip
        elif task.echo:  # ids: their text, token by token (each token's offset: where it starts)
            for k, tok in enumerate(ids):
                if want:
                    entries.append(Entry(self.tok.decode([tok]), None, None, len(echoed)))
                echoed += detok.push([tok], final=k == len(ids) - 1)
        # a completion's first token decodes as it follows the prompt (its leading space kept);
        # a chat reply is decoded alone, as sinklab chat decodes it
        detok.context = ids[-4:] if task.continues else []
        return echoed, entries if want else None, detok

    def _read(
        self, task: Task, ids: list[list[int]], entries: list[list[Entry] | None]
    ) -> Generator[None, None, tuple[list[torch.Tensor], SinkCache]]:
        """Read each of ``ids`` in its own row of one cache, piece by piece (each fitted into
        its row first, rows left-padded to the longest piece) -> each row's last logits and the
        cache; ``entries[b]``: fill in row ``b``'s logprobs and top alternatives."""
        dev = input_device(self.model)
        cache = SinkCache(self.model, self.cache_config)
        if len(ids) > 1:
            cache.add_streams(len(ids) - 1)
        score = any(e is not None for e in entries)
        last: list[torch.Tensor | None] = [None] * len(ids)
        done = 0
        while done < max(len(r) for r in ids):
            yield
            self._check(task)
            piece = _piece(cache, self.chunk, True)
            parts = [r[done : done + piece] for r in ids]
            counts = [len(p) for p in parts]
            fit = [c if len(r) > 1 else 0 for c, r in zip(counts, ids, strict=True)]
            cache.evict_for_space(fit)
            extra = cache.prepare(counts)
            keep = {} if score else {"logits_to_keep": 1}
            out = self.model(left_padded(parts).to(dev), cache=cache, **extra, **keep).logits
            for b, part in enumerate(parts):
                if not part:
                    continue
                rows = out[b, out.shape[1] - len(part) :] if score else out[b]
                if entries[b] is not None:  # row j predicts ids[b][done + j + 1]
                    nxt = ids[b][done + 1 : done + len(part) + 1]
                    if nxt:
                        self._score(rows[: len(nxt)], nxt, entries[b], done + 1, task.logprobs or 0)
                last[b] = rows[-1]
            done += piece
        return [lg for lg in last if lg is not None], cache

    def _score(
        self, logits: torch.Tensor, targets: list[int], entries: list[Entry], at: int, k: int
    ) -> None:
        logp = torch.log_softmax(logits.detach().double().cpu(), -1)
        if not torch.isfinite(logp).all():
            raise NotFinite("the model's logits for this prompt are not finite (NaN or inf)", 500)
        picked = logp[torch.arange(len(targets)), torch.tensor(targets)]
        tops = torch.topk(logp, min(k, logp.shape[-1])) if k else None
        for j, tok in enumerate(targets):
            entry = entries[at + j]
            entry.logprob = float(picked[j])
            entry.top = self._top(logp[j], tok, tops, j, k)

    def _top(self, row: torch.Tensor, tok: int, tops: Any, j: int, k: int) -> dict[str, float]:
        """The ``k`` most likely tokens and the chosen one (OpenAI: up to ``logprobs + 1``)."""
        out: dict[str, float] = {}
        if tops is not None:
            for v, i in zip(tops.values[j].tolist(), tops.indices[j].tolist(), strict=True):
                out.setdefault(self.tok.decode([i]), v)
        out.setdefault(self.tok.decode([tok]), float(row[tok]))
        return out

    def _decode(
        self,
        task: Task,
        index: int,
        cache: SinkCache,
        logits: torch.Tensor,
        detok: TextStream,
        before: int,
        seed: int,
    ) -> Generator[None, None, int]:
        """Decode up to ``max_tokens`` of the reply (``before``: characters of the choice's text
        ahead of it, the echoed prompt; ``seed``: its draws', the request's seed plus the
        choice's copy number) -> how many tokens it has. Text that could start a stop string is
        held back until it cannot."""
        stops = self.eos if task.stop_ids is None else task.stop_ids
        gen = torch.Generator().manual_seed(seed % 2**64)  # seed + j may pass 64 bits: it wraps
        grammar = None if task.grammar is None else task.grammar()
        hold = max((len(s) - 1 for s in task.stops), default=0)
        text, sent, counts = "", 0, Counter()
        # (where its token's text begins in ``text``, entry): not sent yet. An entry goes out
        # with its token's text, so a stop string's cut drops its tokens' entries too
        pending: list[tuple[int, Any]] = []
        dev = input_device(self.model)
        n, finish, cut = 0, "length", False
        while n < task.max_tokens:
            yield
            self._check(task)
            allowed = None if grammar is None else grammar.allowed(logits.numel())
            tok = task.sampling.pick(logits, counts, gen, allowed)
            if grammar is not None:
                grammar.accept(tok)
            if tok in stops:  # its logprob is reported (as OpenAI's), its text is not
                if task.logprobs is not None:
                    entry = self._entry(logits, tok, task.logprobs, before + len(text))
                    pending.append((len(text), entry))
                finish, n = "stop", n + 1
                break
            counts[tok] += 1
            n += 1
            if task.logprobs is not None:
                entry = self._entry(logits, tok, task.logprobs, before + len(text))
                pending.append((len(text), entry))
            elif task.chat_logprobs:
                pending.append((len(text), task.sampling.logprob_entry(logits, tok, self.tok)))
            text += detok.push([tok])
            at = min((i for s in task.stops if (i := text.find(s)) >= 0), default=-1)
            if at >= 0:  # the tokens after the cut (the stop string's) go with their text
                text, finish, cut = text[:at], "stop", True
                pending = [(start, e) for start, e in pending if start < at]
                break
            if n >= task.max_tokens:
                break
            upto = max(sent, len(text) - hold)
            if upto > sent:
                ready = [e for start, e in pending if start < upto]
                task.emit(("piece", Piece(index, text[sent:upto], ready)))
                sent, pending = upto, pending[len(ready) :]
            extra = cache.prepare(1)
            out = self.model(torch.tensor([[tok]], device=dev), cache=cache, **extra).logits
            logits = out[0, -1]
        if not cut:
            text += detok.push([], final=True)
        if len(text) > sent or pending:
            task.emit(("piece", Piece(index, text[sent:], [e for _, e in pending])))
        task.emit(("finish", (index, finish)))
        return n

    def _entry(self, logits: torch.Tensor, tok: int, k: int, offset: int) -> Entry:
        """The sampled ``tok``'s entry: the model's own log-softmax (before any bias)."""
        logp = torch.log_softmax(logits.detach().double().cpu(), -1)
        tops = torch.topk(logp[None], min(k, logp.numel())) if k else None
        return Entry(self.tok.decode([tok]), float(logp[tok]), self._top(logp, tok, tops, 0, k),
                     offset)  # fmt: skip


def _timeout() -> ApiError:
    return ApiError(
        504,
        "the request ran past the server's --request-timeout",
        type="timeout_error",
        code="request_timeout",
    )
