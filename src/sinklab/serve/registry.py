"""The sessions a server holds and their lifecycle (README, "Serving": sessions).

A session lives in memory while it is in use; it is *idle* between turns. When a new session needs
a slot and the server (or the key) holds its most, the least recently used idle session leaves
memory: with ``--sessions`` its saved files stay on disk (*parked*) and a request naming it loads
it back; without, it is gone. A session idle past ``--session-ttl`` is removed, in memory and on
disk. A request is refused with 429 only when every slot it could take is busy answering a turn
now. Session ids are each key's own: key B naming ``bob`` never reaches key A's ``bob``, and an
unknown id and another key's id are answered alike. The clock is injectable (tests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sinklab.errors import SinklabError
from sinklab.serve.config import ServeConfig
from sinklab.serve.protocol import ApiError
from sinklab.serve.sessions import Session, SessionStore
from sinklab.serve.tools import seen_as

Key = tuple[str, str]  # (tenant, session id)


@dataclass
class Parked:
    """A session out of memory whose files are on disk (loaded back when a request names it)."""

    tenant: str
    id: str
    turns: int
    kept: int
    used: float
    files: list[Path] = field(default_factory=list)


def not_found(sid: str) -> ApiError:
    """The one answer for an id this key does not hold (absent, or another key's)."""
    return ApiError(404, f"no session {sid!r} for this key", code="session_not_found")


def _busy(what: str) -> ApiError:
    return ApiError(
        429,
        f"{what}; retry shortly",
        type="rate_limit_error",
        code="too_many_sessions",
        headers={"Retry-After": "1"},
    )


def _extends(messages: list[dict[str, Any]], known: list[dict[str, Any]]) -> bool:
    """Whether ``messages`` start with the session's ``known`` ones as its client has them."""
    return len(messages) >= len(known) and all(
        m == seen_as(k) for m, k in zip(messages, known, strict=False)
    )


class Registry:
    """The sessions in memory (``live``) and on disk only (``parked``), keyed by (tenant, id);
    ``lock`` guards both and every session's ``busy``."""

    def __init__(
        self,
        config: ServeConfig,
        store: SessionStore | None,
        new_session: Callable[[str, str], Session],
        make_chat: Callable[[], Any],
        log: Callable[[str], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config, self.store, self.log, self.clock = config, store, log, clock
        self._new, self._make_chat = new_session, make_chat
        self.lock = threading.RLock()
        self.live: dict[Key, Session] = {}
        self.parked: dict[Key, Parked] = {}

    # ---------------------------------------------------------------- start-up
    def restore(self, sessions: list[Session]) -> int:
        """Take the sessions read from disk: the expired removed, the most recently used in
        memory up to ``--max-sessions``, the others parked. -> how many were taken."""
        now = self.clock()
        fresh = []
        for s in sessions:
            if now - s.used > self.config.session_ttl_s and self.store is not None:
                self._remove_files(s.tenant, s.id, s.files)
            else:
                fresh.append(s)
        fresh.sort(key=lambda s: s.used, reverse=True)
        with self.lock:
            for i, s in enumerate(fresh):
                if i < self.config.max_sessions:
                    self.live[(s.tenant, s.id)] = s
                else:
                    self._park(s)
            self._bound_parked()
        if self.store is not None:
            self.store.tidy(fresh)
        return len(fresh)

    # ---------------------------------------------------------------- lookups
    def find(self, tenant: str, sid: str) -> Session | None:
        """The key's session ``sid`` in memory (loaded back when parked), else None."""
        with self.lock:
            self.sweep()
            s = self.live.get((tenant, sid))
            if s is None and (tenant, sid) in self.parked:
                s = self._unpark(tenant, sid)
            return s

    def listing(self, tenant: str) -> list[dict[str, Any]]:
        """The key's sessions, most recently used first (``GET /v1/sessions``)."""
        with self.lock:
            self.sweep()
            rows = [
                {"id": s.id, "turns": s.chat.turns, "kept": s.state.kept, "last_used": s.used,
                 "in_memory": True, "busy": s.busy}
                for (t, _), s in self.live.items() if t == tenant
            ] + [
                {"id": p.id, "turns": p.turns, "kept": p.kept, "last_used": p.used,
                 "in_memory": False, "busy": False}
                for (t, _), p in self.parked.items() if t == tenant
            ]  # fmt: skip
        rows.sort(key=lambda r: r["last_used"], reverse=True)
        return rows

    def acquire(
        self,
        tenant: str,
        sid: str | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[Session, list[dict[str, Any]], bool]:
        """The session a request continues, the messages it adds, whether it is new; marks it
        busy. With ``sid``: the key's session of that id (created if it holds none). Without:
        the key's idle session whose conversation the messages extend the furthest (the most
        recently used of equals), else a new one. Never another key's session, never one that
        is answering a turn for someone else. ``tools``: rendered once, at a session's start; a
        session continues only with the same tools."""
        with self.lock:
            self.sweep()
            busy_now = sum(1 for (t, _), s in self.live.items() if t == tenant and s.busy)
            if busy_now >= self.config.max_requests_per_key:
                raise _busy(
                    f"this key has {busy_now} turns in flight, its most "
                    f"(--max-requests-per-key {self.config.max_requests_per_key})"
                )
            session, created = None, False
            if sid is not None:
                session = self.find(tenant, sid)
            else:
                best: tuple[int, float] = (0, 0.0)
                for (t, _), s in self.live.items():
                    known = s.chat.messages
                    rank = (len(known), s.used)
                    if (
                        t == tenant
                        and not s.busy
                        and 0 < len(known) < len(messages)
                        and rank > best
                        and s.chat.tools == tools
                        and _extends(messages, known)
                    ):
                        session, best = s, rank
            if session is None:
                self._room(tenant)
                session, created = self._new(sid or self._fresh_id(tenant), tenant), True
                session.used = self.clock()
                session.chat.tools = tools
                self.live[(tenant, session.id)] = session
            if session.chat.tools != tools:
                raise ApiError(
                    400,
                    f"session {session.id!r} was started with other tools (a session's tools are "
                    "read once, at its start); send its tools, or start another session",
                    code="invalid_value",
                    param="tools",
                )
            if session.busy:
                raise ApiError(
                    409,
                    f"session {session.id!r} is answering another turn; wait for it",
                    code="session_busy",
                    headers={"Retry-After": "1"},
                )
            known = session.chat.messages
            if not _extends(messages, known) and any(m["role"] == "assistant" for m in messages):
                if created:
                    del self.live[(tenant, session.id)]
                raise ApiError(  # appended, the session would hold the conversation twice
                    400,
                    f"the messages hold a conversation that session {session.id!r} does not "
                    f"(it holds {len(known)} messages: GET /v1/sessions/{session.id}); send only "
                    "the new messages, the session's conversation and the new ones, or no "
                    "session_id",
                    code="history_mismatch",
                    param="messages",
                )
            new = messages[len(known) :] if _extends(messages, known) else messages
            if not new or new[-1]["role"] not in ("user", "tool"):
                if created:
                    del self.live[(tenant, session.id)]
                raise ApiError(
                    400,
                    "the messages must end with a new user message (or tool results)",
                    code="invalid_messages",
                    param="messages",
                )
            session.busy = True
            session.used = self.clock()
        return session, new, created

    def release(self, session: Session, created: bool) -> None:
        """The turn is over (done or failed): the session is idle; one made for a failed turn
        is dropped."""
        with self.lock:
            session.busy = False
            session.used = self.clock()
            key = (session.tenant, session.id)
            if created and self.live.get(key) is session:
                del self.live[key]

    def delete(self, tenant: str, sid: str) -> None:
        """Remove the key's session ``sid`` from memory and disk, or refuse (404, 409, 503) with
        nothing changed: the files go first, the memory only once they are gone."""
        with self.lock:
            key = (tenant, sid)
            s, p = self.live.get(key), self.parked.get(key)
            if s is None and p is None:
                raise not_found(sid)
            if s is not None and s.busy:
                raise ApiError(409, f"session {sid!r} is answering a turn", code="session_busy")
            if self.store is not None:
                try:
                    self.store.remove(tenant, sid, s.files if s is not None else p.files)
                except OSError as err:
                    self.log(f"session {sid}: not deleted ({err.strerror or err})")
                    raise ApiError(
                        503,
                        f"the session's file could not be removed ({err.strerror or err}); it "
                        "was not deleted, retry when the sessions folder is writable",
                        type="server_error",
                        code="delete_failed",
                    ) from None
            self.live.pop(key, None)
            self.parked.pop(key, None)

    # ---------------------------------------------------------------- expiry and room
    def sweep(self) -> None:
        """Remove every idle session past its TTL, in memory and on disk."""
        now, ttl = self.clock(), self.config.session_ttl_s
        with self.lock:
            for key, s in list(self.live.items()):
                if not s.busy and now - s.used > ttl:
                    del self.live[key]
                    self._remove_files(s.tenant, s.id, s.files)
            for key, p in list(self.parked.items()):
                if now - p.used > ttl:
                    del self.parked[key]
                    self._remove_files(p.tenant, p.id, p.files)

    def _room(self, tenant: str) -> None:
        """Make a slot for a new session of ``tenant``: evict the least recently used idle one
        (of the key at its own cap, else of the server), or 429 when every slot is busy."""
        cfg = self.config
        mine = [s for (t, _), s in self.live.items() if t == tenant]
        if len(mine) >= cfg.max_sessions_per_key and not self._evict(mine):
            raise _busy(f"all {len(mine)} of this key's sessions are answering a turn now")
        if len(self.live) >= cfg.max_sessions and not self._evict(list(self.live.values())):
            raise _busy(f"all {len(self.live)} session slots are answering a turn now")

    def _evict(self, candidates: list[Session]) -> bool:
        idle = [s for s in candidates if not s.busy]
        if not idle:
            return False
        s = min(idle, key=lambda s: s.used)
        del self.live[(s.tenant, s.id)]
        self._park(s)
        self._bound_parked()
        return True

    def _park(self, s: Session) -> None:
        if self.store is not None and s.files:
            self.parked[(s.tenant, s.id)] = Parked(
                s.tenant, s.id, s.chat.turns, s.state.kept, s.used, list(s.files)
            )

    def _bound_parked(self) -> None:
        """At most ``--max-saved-sessions`` parked: the least recently used go, files too."""
        extra = len(self.parked) - self.config.max_saved_sessions
        if extra > 0:
            for key, p in sorted(self.parked.items(), key=lambda kv: kv[1].used)[:extra]:
                del self.parked[key]
                self._remove_files(p.tenant, p.id, p.files)

    def _unpark(self, tenant: str, sid: str) -> Session | None:
        assert self.store is not None
        self._room(tenant)
        p = self.parked.pop((tenant, sid))
        try:
            s = self.store.load_one(tenant, sid, self._make_chat)
        except SinklabError as err:
            self.log(f"session {sid}: not loaded back ({err})")
            return None
        self.live[(tenant, sid)] = s
        s.used = p.used
        return s

    def _remove_files(self, tenant: str, sid: str, files: list[Path]) -> None:
        if self.store is None:
            return
        try:
            self.store.remove(tenant, sid, files)
        except OSError as err:
            self.log(f"session {sid}: expired files not removed ({err.strerror or err})")

    def _fresh_id(self, tenant: str) -> str:
        import secrets

        while True:
            sid = "s-" + secrets.token_urlsafe(12)
            if (tenant, sid) not in self.live and (tenant, sid) not in self.parked:
                return sid
