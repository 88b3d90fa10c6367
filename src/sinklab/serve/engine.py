"""The one thread that runs the model: it takes turns off a queue and, step after step, reads
the next piece (at most ``--prefill-chunk`` tokens) of every turn still being read (the prefill:
one left-padded forward, each session's row read exactly as ``sinklab chat`` reads it alone),
then decodes one token of every busy session's reply together in one
:class:`~sinklab.stream.generation.StreamBatch` step; so a long prompt delays the others' tokens
by one piece a step, never by its whole length. Sessions join the batch (from their saved
:class:`~sinklab.stream.state.StreamState`) and leave it between steps. A finished turn is
written to disk before it is reported done (a streamed one only once its last chunk went out to
the client: :meth:`Engine.commit`); a turn that fails (full disk, ``--request-timeout`` checked
between pieces and steps, a client gone, a crash) leaves its session as it was before the turn.
"""

from __future__ import annotations

import bisect
import dataclasses
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sinklab.errors import SinklabError
from sinklab.serve.config import ServeConfig
from sinklab.serve.grammar import Constraint, Formats
from sinklab.serve.metrics import Metrics
from sinklab.serve.protocol import ApiError
from sinklab.serve.registry import Registry
from sinklab.serve.sampling import Sampling, TurnFailed
from sinklab.serve.scoring import Scorer, take_all
from sinklab.serve.sessions import Session, SessionStore
from sinklab.serve.tools import as_sent, call_markers, parse_calls, renders_tools
from sinklab.stream.cache import CacheConfig, SinkCache
from sinklab.stream.chat import ChatConfig, ChatSession, Opened
from sinklab.stream.generation import StreamBatch, TextStream, _piece, read_rows
from sinklab.stream.state import StreamState

# ("text", str) | ("logprobs", [entry]) | ("done", dict) | ("error", ApiError)
Emit = Callable[[tuple[str, Any]], None]


@dataclass
class Job:
    """One turn of one session, from the request to its last event."""

    session: Session
    new: list[dict[str, str]]  # the messages this turn adds
    max_tokens: int
    temperature: float | None
    seed: int | None
    stops: list[str]
    deadline: float
    emit: Emit
    created: bool = False  # the session was made for this turn (dropped if the turn fails)
    deferred: bool = False  # committed by the caller once the client has the reply (commit())
    cancelled: threading.Event = field(default_factory=threading.Event)
    opened: Opened | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of ``text`` already emitted
    stream: int | None = None  # its row in the batch
    started: float = 0.0
    snapshot: tuple[dict[str, Any], torch.Tensor] | None = None
    ended: bool = False  # the model stopped by itself (its end token is not part of the reply)
    cut: bool = False  # a stop string cut ``text`` (the session keeps the text as cut)
    detok: TextStream | None = None
    # being read: the messages and rendering of the turn, the ids not read yet, the cache so far
    reading: tuple[list[dict[str, str]], str, int] | None = None
    left: list[int] = field(default_factory=list)
    partial: StreamState | None = None
    seen: tuple[int, int] = (0, 0)  # the highest position given, the most positions kept
    final: tuple[StreamState, str] | None = None  # a deferred turn's cache and finish reason
    sampling: Sampling | None = None  # top_p, penalties, bias, logprobs (None: temperature only)
    counts: Counter[int] = field(default_factory=Counter)  # the reply's tokens sampled so far
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # one entry per reply token
    starts: list[int] = field(default_factory=list)  # where each reply token's text begins
    lp_sent: int = 0  # entries of ``logprobs`` already emitted
    cached: int = 0  # the conversation's tokens the session had read before this turn
    tool_names: frozenset[str] = frozenset()  # the tools the reply may call (:mod:`.tools`)
    parsed: tuple[str | None, list[dict[str, Any]]] | None = None  # the reply, its calls
    grammar: Constraint | None = None  # response_format's mask (:mod:`.grammar`)
    forced: bool = False  # the grammar forces calls (tool_choice "required" or a named one)


class Engine:
    """Owns the model, the sessions and the batch. ``submit(job)`` from any thread; events come
    back through ``job.emit`` (called on the engine thread)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: ServeConfig,
        store: SessionStore | None,
        metrics: Metrics,
        log: Callable[[str], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.model, self.tok, self.config = model, tokenizer, config
        self.store, self.metrics, self.log = store, metrics, log
        self.cache_config = CacheConfig("sink", config.n_sink, config.window)
        self.chat_config = ChatConfig(
            config.n_sink, config.window, prompt_chunk=config.prompt_chunk
        )
        self.make_chat()  # refuses a tokenizer without a chat template, before serving
        self.tools_ok = renders_tools(tokenizer)  # its template renders a request's tools
        # how its template asks for calls (for a forced call's grammar)
        self.call_markers = call_markers(tokenizer) if self.tools_ok else None
        vocab = int(getattr(model.config, "vocab_size", 0) or len(tokenizer))
        self.formats = Formats(tokenizer, vocab, sorted(self.make_chat().stops))
        self.registry = Registry(config, store, self.new_session, self.make_chat, log, clock)
        self.sessions = self.registry.live  # (tenant, id) -> session in memory
        self.lock = self.registry.lock  # guards ``sessions`` and each session's ``busy``
        self.queue: queue.Queue[Job] = queue.Queue()
        self.batch = StreamBatch(model, self.cache_config)
        self.active: list[Job] = []  # decoding
        self.reading: list[Job] = []  # their turn's text still being read
        # the turns being read, by the admission they came in: each group's cache lives across
        # steps (a state is copied out only when a turn is read to its end)
        self.groups: list[tuple[SinkCache, list[Job]]] = []
        self._joining: list[Job] = []
        self._stop = threading.Event()
        self._wake = threading.Event()  # set when a turn or a stateless request is queued
        # the stateless routes' requests, one forward of them per step (docs/serve-routes.md)
        self.scorer = Scorer(model, tokenizer, config.n_sink, config.window,
                             config.prompt_chunk, config.max_queue, self._wake.set)  # fmt: skip
        self.scorer.log = log
        self.thread = threading.Thread(target=self._run, name="sinklab-engine", daemon=True)

    # ------------------------------------------------------------------ sessions
    def make_chat(self) -> ChatSession:
        chat = ChatSession(self.model, self.tok, self.chat_config)
        chat.cache = None  # type: ignore[assignment]  # a session's cache lives in its state
        return chat

    def empty_state(self) -> StreamState:
        return StreamState(self.cache_config)

    def new_session(self, sid: str, tenant: str) -> Session:
        return Session(sid, tenant, self.make_chat(), self.empty_state())

    def load(self) -> int:
        """Take the sessions of ``--sessions`` (refusing broken files one by one)."""
        if self.store is None:
            return 0
        return self.registry.restore(self.store.load_all(self.make_chat))

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """End the thread; the turns and stateless requests still waiting get a 503."""
        self._stop.set()
        self.thread.join(timeout=10)
        if self.thread.is_alive():  # still in a step: its state is not ours to touch
            return
        gone = ApiError(503, "the server is shutting down; retry on another", "server_error")
        for job in [*self.active, *self.reading, *take_all(self.queue)]:
            self._fail(job, gone)
        self.active.clear()
        self.reading.clear()
        self.scorer.fail_all(gone)

    def submit(self, job: Job) -> None:
        if self.queue.qsize() >= self.config.max_queue:
            raise ApiError(
                429,
                f"{self.queue.qsize()} turns are waiting for the model; retry shortly",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self.queue.put(job)
        self._wake.set()

    def busy(self) -> bool:
        """Whether a turn is being read or decoded."""
        return bool(self.active or self.reading)

    def step(self) -> None:
        """One engine step: admit waiting turns, read one piece of each turn being read, drop
        the expired, decode one token of every reply, and run one forward of the stateless
        request in hand (:class:`~sinklab.serve.scoring.Scorer`)."""
        self._chat_step()
        self.scorer.step()

    def _chat_step(self) -> None:
        self._admit()
        if self.reading:
            self._read_step()
        self._expire()
        if self.active:
            self._step()

    def _run(self) -> None:
        swept = 0.0
        failed = ApiError(500, "the server failed to decode", "server_error")
        while not self._stop.is_set():
            try:
                self._chat_step()
                if time.monotonic() - swept > 1.0:
                    swept = time.monotonic()
                    self.registry.sweep()
            except Exception as err:  # never lose the thread: fail the turns in flight
                self.log(f"engine error: {type(err).__name__}: {err}")
                for job in [*self.active, *self.reading]:
                    self._fail(job, failed)
                self.active.clear()
                self.reading.clear()
                self.groups.clear()
                self._joining.clear()
                self.batch = StreamBatch(self.model, self.cache_config)
            try:  # a stateless request fails alone (Scorer.step); this is the scorer itself
                self.scorer.step()
            except Exception as err:
                self.log(f"engine error: {type(err).__name__}: {err}")
                self.scorer.fail_all(failed)
            self.metrics.set_batch(len(self.active))

    def _admit(self) -> None:
        """Take the turns waiting, as many as the batch has room for, to be read."""
        if not self.busy() and not self.scorer.pending() and self.queue.empty():
            self._wake.wait(0.05)  # idle: until a turn or a stateless request comes
        self._wake.clear()  # (each put precedes its set: nothing queued is missed)
        jobs: list[Job] = []
        while len(self.active) + len(self.reading) + len(jobs) < self.config.max_batch:
            try:
                jobs.append(self.queue.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            self._begin(job)

    def _prefill(self, jobs: list[Job]) -> None:
        """Read ``jobs``' turns to their end (piece by piece, together) without decoding: the
        engine's steps without the decode (tests drive the engine by hand)."""
        for job in jobs:
            self._begin(job)
        while any(j in self.reading for j in jobs):
            self._read_step()

    def _begin(self, job: Job) -> None:
        """Set ``job`` up to be read (its session's snapshot taken), or answer it now."""
        if job.cancelled.is_set() or time.monotonic() > job.deadline:
            self._fail(job, _timeout() if not job.cancelled.is_set() else None)
            return
        chat = job.session.chat
        job.snapshot = (chat.record(), chat.gen.get_state())
        job.started = time.perf_counter()
        job.cached = job.session.state.seen
        try:
            if job.seed is not None:
                chat.gen.manual_seed(job.seed)
            messages, full, ids = chat.to_read(job.new)
            if not ids:
                raise SinklabError("nothing to read for this turn")
        except SinklabError as err:
            self._fail(job, ApiError(400, str(err), code="invalid_conversation"))
            return
        except Exception as err:  # the job is not in the batch yet: answer it here
            self._prefill_failed(job, err)
            return
        job.reading, job.left, job.partial = (messages, full, len(ids)), ids, job.session.state
        self.reading.append(job)
        self._joining.append(job)

    @torch.inference_mode()
    def _read_step(self) -> None:
        """Read the next piece of every turn being read: one left-padded forward per group of
        turns admitted together (:func:`~sinklab.stream.generation.read_rows`: each row as
        ``sinklab chat`` reads it alone, piece for piece); a turn read to its end samples its
        first token and joins the decode batch, or is over."""
        if self._joining:
            jobs, self._joining = self._joining, []
            try:
                self.groups.append(
                    (SinkCache.from_state(self.model, [j.partial for j in jobs]), jobs)
                )
            except Exception as err:
                for job in jobs:
                    self.reading.remove(job)
                    self._prefill_failed(job, err)
        for group in list(self.groups):
            self._read_group(group)

    def _read_group(self, group: tuple[SinkCache, list[Job]]) -> None:
        cache, rows = group
        try:
            piece = _piece(cache, self.config.prompt_chunk, True)
            read = read_rows(self.model, cache, [job.left[:piece] for job in rows], piece, fit=True)
        except Exception as err:
            self.groups.remove(group)
            for job in rows:
                self.reading.remove(job)
                self._prefill_failed(job, err)
            return
        self.metrics.set_prefill(len(rows))
        done: list[tuple[Job, torch.Tensor, StreamState]] = []
        for b, job in enumerate(rows):
            job.left = job.left[piece:]
            top, most = job.seen
            job.seen = (max(top, read.top_position[b]), max(most, read.most_kept[b]))
            if not job.left:
                try:
                    done.append((job, read.logits[b], cache.state(b)))
                except Exception as err:
                    done.append((job, read.logits[b], None))  # type: ignore[arg-type]
                    self.log(f"session {job.session.id}: state not taken: {err}")
        if done:
            self._drop_rows(group, [job for job, *_ in done])
        for job, logits, state in done:
            self.reading.remove(job)
            try:  # one turn's failure here is that turn's: the others read with it go on
                if state is None:
                    raise SinklabError("the turn's cache state could not be taken")
                job.partial = state
                self._opened(job, logits)
            except Exception as err:
                self._prefill_failed(job, err)

    def _drop_rows(self, group: tuple[SinkCache, list[Job]], gone: list[Job]) -> None:
        """Take ``gone`` out of their reading group (the others' rows stay as they are)."""
        cache, rows = group
        keep = [b for b, job in enumerate(rows) if job not in gone]
        if not keep:
            self.groups.remove(group)
            return
        cache.keep_streams(keep)
        rows[:] = [rows[b] for b in keep]

    def _opened(self, job: Job, logits: torch.Tensor) -> None:
        """Turn ``job`` is read (``logits``: of its last token): sample its first token; it is
        over, or it joins the decode batch."""
        chat = job.session.chat
        assert job.reading is not None and job.partial is not None
        chat.watched(*job.seen)
        messages, full, n = job.reading
        job.opened = Opened(messages, full, n, logits)
        self.metrics.add_prompt(n)
        job.detok = TextStream(self.tok)
        try:
            tok = self._sample(job, logits)
        except TurnFailed as err:
            self._turn_failed(job, err)
            return
        done = self._take(job, tok)
        if done is not None:
            self._complete(job, job.partial, done)
            return
        job.stream = self.batch.add(job.partial)
        self.active.append(job)

    def _prefill_failed(self, job: Job, err: Exception) -> None:
        self.log(f"session {job.session.id}: prefill failed: {type(err).__name__}: {err}")
        self._fail(job, ApiError(500, "the server failed to read the turn", "server_error"))

    @torch.inference_mode()
    def _step(self) -> None:
        """One decode step for every session in the batch."""
        out = self.batch.feed({j.stream: [j.tokens[-1]] for j in self.active}, last_only=True)
        for job in list(self.active):
            try:  # one row's failure (NaN logits, a bad distribution) is that request's alone
                tok = self._sample(job, out[job.stream][0])
            except Exception as err:
                self._leave(job)
                if isinstance(err, TurnFailed):
                    self._turn_failed(job, err)
                else:
                    self.log(f"session {job.session.id}: sampling failed: {type(err).__name__}")
                    self._fail(job, ApiError(500, "the server failed to sample", "server_error"))
                continue
            done = self._take(job, tok)
            if done is not None:
                state = self.batch.state(job.stream)
                self._leave(job)
                self._complete(job, state, done)

    def _sample(self, job: Job, logits: torch.Tensor) -> int:
        """The next token of ``job``'s reply (:mod:`.sampling`), its logprobs noted."""
        chat = job.session.chat
        t = chat.config.temperature if job.temperature is None else job.temperature
        sampling = dataclasses.replace(job.sampling or Sampling(), temperature=t)
        allowed = None if job.grammar is None else job.grammar.allowed(logits.numel())
        tok = sampling.pick(logits, job.counts, chat.gen, allowed)
        if job.grammar is not None:
            job.grammar.accept(tok)
        job.counts[tok] += 1
        if sampling.logprobs and tok not in chat.stops:
            job.logprobs.append(sampling.logprob_entry(logits, tok, self.tok))
        return tok

    def _turn_failed(self, job: Job, err: TurnFailed) -> None:
        """A request whose numbers left the finite range, or whose format allows no token: it
        fails alone, the others go on."""
        self.log(f"session {job.session.id}: {err}; the turn was not applied")
        self._fail(
            job,
            ApiError(
                err.status,
                f"{err}; the turn was not applied",
                "invalid_request_error" if err.status < 500 else "server_error",
                code=err.code,
            ),
        )

    def _take(self, job: Job, tok: int) -> str | None:
        """Add a sampled token to the reply; -> the finish reason when the reply is over."""
        assert job.detok is not None
        finish = None
        if tok in job.session.chat.stops:
            job.ended, finish = True, "stop"
        else:
            job.tokens.append(tok)
            self.metrics.add_tokens(1)
            job.starts.append(len(job.text))
            job.text += job.detok.push([tok])
            if len(job.tokens) >= job.max_tokens:
                finish = "length"
        if finish is not None:
            job.text += job.detok.push([], final=True)
        for stop in job.stops:
            if (at := job.text.find(stop)) >= 0:
                job.text, finish, job.cut = job.text[:at], "stop", True
        self._flush(job, final=finish is not None)
        return finish

    def _flush(self, job: Job, final: bool) -> None:
        """Emit the reply's text not sent yet (holding back what could start a stop string)."""
        hold = 0 if final else max((len(s) - 1 for s in job.stops), default=0)
        upto = max(job.sent, len(job.text) - hold)
        if job.sampling and job.sampling.logprobs:  # the entries of the text going out
            kept = _entries_in(job, None if final else upto)
            if kept > job.lp_sent:
                job.emit(("logprobs", job.logprobs[job.lp_sent : kept]))
                job.lp_sent = kept
        if upto > job.sent:
            job.emit(("text", job.text[job.sent : upto]))
            job.sent = upto

    def _leave(self, job: Job) -> None:
        self.batch.remove(job.stream)
        self.active.remove(job)
        job.stream = None

    def _expire(self) -> None:
        """Drop the turns whose client went away or whose ``--request-timeout`` passed (checked
        between pieces of a read and between decode steps)."""
        now = time.monotonic()
        for job in [*self.active, *self.reading]:
            if job.cancelled.is_set() or now > job.deadline:
                if job in self.reading:
                    self.reading.remove(job)
                    if job in self._joining:
                        self._joining.remove(job)
                    for group in list(self.groups):
                        if job in group[1]:
                            self._drop_rows(group, [job])
                else:
                    self._leave(job)
                self._fail(job, None if job.cancelled.is_set() else _timeout())

    def _complete(self, job: Job, state: StreamState, finish: str) -> None:
        """The reply is over: commit the turn, write it, then report it done (a deferred turn:
        report it done, the caller commits it once the client has it)."""
        if job.deferred:
            job.final = (state, finish)
            job.emit(("done", self._result(job, state, finish, job.session.chat.turns + 1)))
            return
        error = self._commit(job, state)
        if error is not None:
            self._fail(job, error)
            return
        self.registry.release(job.session, False)
        job.emit(("done", self._result(job, state, finish, job.session.chat.turns)))

    def commit(self, job: Job) -> ApiError | None:
        """Commit a deferred turn the client has received (any thread: the session is busy, the
        engine no longer touches it); -> the error when it could not be saved (the session is
        then as before the turn)."""
        assert job.final is not None
        error = self._commit(job, job.final[0])
        if error is not None:
            self._fail(job, error, emit=False)
            return error
        self.registry.release(job.session, False)
        return None

    def abort(self, job: Job) -> None:
        """Drop a deferred turn the client did not receive: the session is as before it."""
        self._fail(job, None)

    def _calls(self, job: Job) -> tuple[str | None, list[dict[str, Any]]]:
        """The reply as the client gets it: its content and its tool calls (parsed once)."""
        if job.parsed is None:
            job.parsed = (
                parse_calls(job.text, set(job.tool_names), job.forced)
                if job.tool_names
                else (job.text, [])
            )
        return job.parsed

    def _commit(self, job: Job, state: StreamState) -> ApiError | None:
        session, chat = job.session, job.session.chat
        assert job.opened is not None
        cut = job.text if job.cut else None  # the session keeps the reply the client gets
        chat.finish(job.opened, job.tokens, job.ended, time.perf_counter() - job.started, cut)
        content, calls = self._calls(job)
        if calls:  # the model's text stays as it wrote it; the client's form beside it
            chat.messages[-1]["sent"] = as_sent(content, calls)
        elif job.forced:  # cut inside its first call: the client got no content
            chat.messages[-1]["sent"] = {"content": ""}
        session.used = self.registry.clock()
        try:
            if self.store is not None:
                self.store.save(session, state)
        except OSError as err:
            self.log(f"session {session.id}: turn {chat.turns} not saved ({err.strerror or err})")
            return ApiError(
                507,
                f"the session could not be saved ({err.strerror or err}); the turn was "
                "not applied, the session is as before it",
                type="server_error",
                code="insufficient_storage",
            )
        except Exception as err:
            self.log(f"session {session.id}: turn {chat.turns} not saved ({err})")
            return ApiError(500, "the turn could not be saved", "server_error")
        session.state = state
        return None

    def _result(self, job: Job, state: StreamState, finish: str, turns: int) -> dict[str, Any]:
        assert job.opened is not None
        prompt = job.cached + job.opened.prompt_tokens  # the whole prompt, read before or now
        logprobs = job.logprobs[: _entries_in(job)]  # the reply's text as the client gets it
        content, calls = self._calls(job)
        return {
            # a forced reply cut by max_tokens keeps its finished calls and says it was cut
            "finish_reason": "tool_calls"
            if calls and not (job.forced and finish == "length")
            else finish,
            # a forced reply is calls only: one cut inside its first call has empty content (not
            # its markup; "" rather than null, which a client could not send back without calls)
            "reply": content if calls else ("" if job.forced else job.text),
            "tool_calls": calls,
            "logprobs": {"content": logprobs} if job.sampling and job.sampling.logprobs else None,
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": len(job.tokens),
                "total_tokens": prompt + len(job.tokens),
                "prompt_tokens_details": {"cached_tokens": job.cached},
            },
            "session": {"turns": turns, "tokens_seen": state.seen, "kept": state.kept},
        }

    def _fail(self, job: Job, error: ApiError | None, emit: bool = True) -> None:
        """Undo the turn (the session is as before it) and report ``error``."""
        session, chat = job.session, job.session.chat
        if job.snapshot is not None:
            record, gen = job.snapshot
            chat.load_record(record)
            chat.gen.set_state(gen)
        chat.cache = None  # type: ignore[assignment]
        self.registry.release(session, job.created)
        if error is not None and emit:
            job.emit(("error", error))

    # ------------------------------------------------------------------ read-outs
    def kept_total(self) -> int:
        with self.lock:
            return sum(s.state.kept for s in self.sessions.values())


def _timeout() -> ApiError:
    return ApiError(
        504,
        "the turn ran past the server's --request-timeout; it was not applied",
        type="timeout_error",
        code="request_timeout",
    )


def _entries_in(job: Job, upto: int | None = None) -> int:
    """How many of ``job``'s logprobs entries belong to its text up to character ``upto``
    (None: the whole reply as the client gets it): the tokens whose text begins before it. A
    stop string's cut drops the entries of every token after the cut, all of the stop string's
    own (a token straddling the cut keeps its entry, as its text keeps its first part); a token
    held back with its text is emitted with it (docs/serve.md#logprobs)."""
    if upto is None and not job.cut:
        return len(job.logprobs)
    return min(
        len(job.logprobs), bisect.bisect_left(job.starts, len(job.text) if upto is None else upto)
    )
