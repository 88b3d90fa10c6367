"""The one thread that runs the model: it takes turns off a queue, reads the new texts of the
turns waiting together (the prefill: one left-padded forward a piece, each session's row read
exactly as ``sinklab chat`` reads it alone), then decodes every busy session's reply together in
one :class:`~sinklab.stream.generation.StreamBatch` step after step; sessions
join the batch (from their saved :class:`~sinklab.stream.state.StreamState`) and leave it
between steps. A finished turn is written to disk before it is reported done; a turn that fails
(full disk, timeout, a client gone, a crash) leaves its session as it was before the turn.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sinklab.errors import SinklabError
from sinklab.serve.config import ServeConfig
from sinklab.serve.metrics import Metrics
from sinklab.serve.protocol import ApiError
from sinklab.serve.sessions import Session, SessionStore
from sinklab.stream.cache import CacheConfig, SinkCache
from sinklab.stream.chat import ChatConfig, ChatSession, Opened
from sinklab.stream.generation import RowsRead, StreamBatch, TextStream, read_rows
from sinklab.stream.state import StreamState

Emit = Callable[[tuple[str, Any]], None]  # ("text", str) | ("done", dict) | ("error", ApiError)


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
    ) -> None:
        self.model, self.tok, self.config = model, tokenizer, config
        self.store, self.metrics, self.log = store, metrics, log
        self.cache_config = CacheConfig("sink", config.n_sink, config.window)
        self.chat_config = ChatConfig(
            config.n_sink, config.window, prompt_chunk=config.prompt_chunk
        )
        self.make_chat()  # refuses a tokenizer without a chat template, before serving
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()  # guards ``sessions`` and each session's ``busy``
        self.queue: queue.Queue[Job] = queue.Queue()
        self.batch = StreamBatch(model, self.cache_config)
        self.active: list[Job] = []
        self._stop = threading.Event()
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
        for s in self.store.load_all(self.make_chat):
            self.sessions[s.id] = s
        return len(self.sessions)

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)

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

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._admit()
                self._expire()
                if self.active:
                    self._step()
            except Exception as err:  # never lose the thread: fail what is in flight
                self.log(f"engine error: {type(err).__name__}: {err}")
                for job in list(self.active):
                    self._fail(job, ApiError(500, "the server failed to decode", "server_error"))
                self.active.clear()
                self.batch = StreamBatch(self.model, self.cache_config)
            self.metrics.set_batch(len(self.active))

    def _admit(self) -> None:
        """Take the turns waiting, as many as the batch has room for, and read them together."""
        jobs: list[Job] = []
        while len(self.active) + len(jobs) < self.config.max_batch:
            try:
                wait = 0.05 if not self.active and not jobs else 0
                jobs.append(self.queue.get(timeout=wait) if wait else self.queue.get_nowait())
            except queue.Empty:
                break
        if jobs:
            self._prefill(jobs)

    @torch.inference_mode()
    def _prefill(self, jobs: list[Job]) -> None:
        """Read the turns' new texts, every session's in one left-padded forward a piece
        (:func:`~sinklab.stream.generation.read_rows`: each row as ``sinklab chat`` reads it
        alone), sample each reply's first token; the replies that go on join the decode batch."""
        ready: list[tuple[Job, list[dict[str, str]], str, list[int]]] = []
        for job in jobs:
            if job.cancelled.is_set() or time.monotonic() > job.deadline:
                self._fail(job, _timeout() if not job.cancelled.is_set() else None)
                continue
            chat = job.session.chat
            job.snapshot = (chat.record(), chat.gen.get_state())
            job.started = time.perf_counter()
            try:
                if job.seed is not None:
                    chat.gen.manual_seed(job.seed)
                messages, full, ids = chat.to_read(job.new)
                if not ids:
                    raise SinklabError("nothing to read for this turn")
            except SinklabError as err:
                self._fail(job, ApiError(400, str(err), code="invalid_conversation"))
                continue
            except Exception as err:  # the job is not in the batch yet: answer it here
                self._prefill_failed(job, err)
                continue
            ready.append((job, messages, full, ids))
        if not ready:
            return
        try:
            cache = SinkCache.from_state(self.model, [job.session.state for job, *_ in ready])
            read = read_rows(
                self.model, cache, [ids for *_, ids in ready], self.config.prompt_chunk, fit=True
            )
        except Exception as err:
            for job, *_ in ready:
                self._prefill_failed(job, err)
            return
        self.metrics.set_prefill(len(ready))
        for b, (job, messages, full, ids) in enumerate(ready):
            try:  # one turn's failure here is that turn's: the others read with it go on
                self._opened(job, Opened(messages, full, len(ids), read.logits[b]), cache, b, read)
            except Exception as err:
                self._prefill_failed(job, err)

    def _opened(self, job: Job, opened: Opened, cache: SinkCache, b: int, read: RowsRead) -> None:
        """Turn ``job``, read as row ``b`` of ``cache``: sample its first token; it is over, or it
        joins the decode batch."""
        chat = job.session.chat
        chat.watched(read.top_position[b], read.most_kept[b])
        job.opened = opened
        self.metrics.add_prompt(opened.prompt_tokens)
        job.detok = TextStream(self.tok)
        done = self._take(job, chat.sample(opened.logits, job.temperature))
        if done is not None:
            self._complete(job, cache.state(b), done)
            return
        job.stream = self.batch.add(cache.state(b))
        self.active.append(job)

    def _prefill_failed(self, job: Job, err: Exception) -> None:
        self.log(f"session {job.session.id}: prefill failed: {type(err).__name__}: {err}")
        self._fail(job, ApiError(500, "the server failed to read the turn", "server_error"))

    @torch.inference_mode()
    def _step(self) -> None:
        """One decode step for every session in the batch."""
        out = self.batch.feed({j.stream: [j.tokens[-1]] for j in self.active}, last_only=True)
        for job in list(self.active):
            tok = job.session.chat.sample(out[job.stream][0], job.temperature)
            done = self._take(job, tok)
            if done is not None:
                state = self.batch.state(job.stream)
                self._leave(job)
                self._complete(job, state, done)

    def _take(self, job: Job, tok: int) -> str | None:
        """Add a sampled token to the reply; -> the finish reason when the reply is over."""
        assert job.detok is not None
        finish = None
        if tok in job.session.chat.stops:
            job.ended, finish = True, "stop"
        else:
            job.tokens.append(tok)
            self.metrics.add_tokens(1)
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
        if upto > job.sent:
            job.emit(("text", job.text[job.sent : upto]))
            job.sent = upto

    def _leave(self, job: Job) -> None:
        self.batch.remove(job.stream)
        self.active.remove(job)
        job.stream = None

    def _expire(self) -> None:
        now = time.monotonic()
        for job in list(self.active):
            if job.cancelled.is_set() or now > job.deadline:
                self._leave(job)
                self._fail(job, None if job.cancelled.is_set() else _timeout())

    def _complete(self, job: Job, state: StreamState, finish: str) -> None:
        """The reply is over: commit the turn, write it, then report it done."""
        session, chat = job.session, job.session.chat
        assert job.opened is not None
        cut = job.text if job.cut else None  # the session keeps the reply the client gets
        chat.finish(job.opened, job.tokens, job.ended, time.perf_counter() - job.started, cut)
        try:
            if self.store is not None:
                self.store.save(session, state)
        except OSError as err:
            self.log(f"session {session.id}: turn {chat.turns} not saved ({err.strerror or err})")
            self._fail(
                job,
                ApiError(
                    507,
                    f"the session could not be saved ({err.strerror or err}); the turn was "
                    "not applied, the session is as before it",
                    type="server_error",
                    code="insufficient_storage",
                ),
            )
            return
        except Exception as err:
            self.log(f"session {session.id}: turn {chat.turns} not saved ({err})")
            self._fail(job, ApiError(500, "the turn could not be saved", "server_error"))
            return
        session.state = state
        with self.lock:
            session.busy = False
        prompt = job.opened.prompt_tokens
        job.emit(
            (
                "done",
                {
                    "finish_reason": finish,
                    "reply": job.text,
                    "usage": {
                        "prompt_tokens": prompt,
                        "completion_tokens": len(job.tokens),
                        "total_tokens": prompt + len(job.tokens),
                    },
                    "session": session.summary(),
                },
            )
        )

    def _fail(self, job: Job, error: ApiError | None) -> None:
        """Undo the turn (the session is as before it) and report ``error``."""
        session, chat = job.session, job.session.chat
        if job.snapshot is not None:
            record, gen = job.snapshot
            chat.load_record(record)
            chat.gen.set_state(gen)
        chat.cache = None  # type: ignore[assignment]
        with self.lock:
            session.busy = False
            if job.created and self.sessions.get(session.id) is session:
                del self.sessions[session.id]
        if error is not None:
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
