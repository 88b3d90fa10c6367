"""Sessions and their files.

A :class:`Session` is one conversation: its :class:`~sinklab.stream.chat.ChatSession` (messages,
the text its cache has read, the sampling generator) and, between turns, its cache as a
:class:`~sinklab.stream.state.StreamState`. It belongs to the tenant (API key) that created it;
its id is the tenant's own (two keys may each hold a session ``bob``).

The ``--sessions`` folder is sinklab's own (:meth:`SessionStore.claim`): sinklab creates it and
marks it with :data:`MARKER`; a non-empty folder without the mark is refused at start-up. Files
are named from a hash of the tenant and the validated id (:meth:`SessionStore.stem`), never from
request text, so no id can name a user's file (``package`` is ``session-<hash>.json``).

:class:`SessionStore` writes a session after each completed turn, so that a crash loses at most
the turn in flight: ``DIR/STEM.T.safetensors`` (the cache tensors and the generator state of turn
``T``, written to a temporary file, flushed and renamed), then ``DIR/STEM.json`` (the
conversation, the stream's bookkeeping, the server's config, the last use and the tensors file's
sha256; written the same way, the commit point), then the previous turn's tensors file is
removed. A crash at any point leaves the JSON naming a complete tensors file. At start-up
every ``session-<hash>.json`` is read through :mod:`sinklab.safeio` (a regular file, bounded in
size and JSON nesting: a FIFO cannot block start-up); one that is corrupt, truncated, of another
model or cache config, or whose tensors do not match its hash is refused with one log line and
left on disk; the others are served. A file not named as sinklab names its own is never opened
(one log line says how many there are). :meth:`SessionStore.delete` removes the JSON first (the
commit point: when it cannot be removed nothing changed) and then the tensors files sinklab
wrote for it.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load, save

from sinklab.errors import SinklabError
from sinklab.meta import write_json_atomic
from sinklab.models.arch import model_shape
from sinklab.safeio import read_bytes, read_json
from sinklab.stream.chat import ChatSession
from sinklab.stream.state import StreamState

VERSION = 1
_GEN = "__generator_state__"
MARKER = ".sinklab-sessions"  # the mark of a folder sinklab made for its sessions
_MARK_TEXT = "sinklab sessions folder: sinklab reads, writes and removes its own files here\n"


@dataclass
class Session:
    """One conversation. ``state`` is its cache after its last completed turn; ``busy`` while a
    turn is in flight (one turn at a time)."""

    id: str
    tenant: str
    chat: ChatSession
    state: StreamState
    busy: bool = False
    files: list[Path] = field(default_factory=list)  # its tensors file on disk, if any
    used: float = 0.0  # wall-clock time of its last use (its idle TTL counts from here)

    def summary(self) -> dict[str, int]:
        """The ``session`` block of every response."""
        return {"turns": self.chat.turns, "tokens_seen": self.state.seen, "kept": self.state.kept}


def _fsync_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _own_file(name: str) -> bool:
    """Whether ``name`` is one sinklab writes: a turn's tensors, or a write's temporary file."""
    return bool(
        re.fullmatch(r"session-[0-9a-f]{32}\.\d+\.safetensors", name)
        or re.fullmatch(r"\.session-[0-9a-f]{32}\.\S+", name)
    )


class SessionStore:
    """The ``--sessions`` folder: :meth:`save` after a turn, :meth:`load_all` at start-up,
    :meth:`delete`. ``server``: what a file must have been written by (model and cache)."""

    def __init__(self, folder: Path, server: dict[str, Any], log) -> None:
        self.folder = Path(folder)
        self.server = server
        self.log = log
        self._lock = threading.Lock()

    @staticmethod
    def stem(tenant: str, sid: str) -> str:
        """The name of a session's files: a hash of its tenant and id (never request text)."""
        return "session-" + hashlib.sha256(f"{tenant}\0{sid}".encode()).hexdigest()[:32]

    def json_path(self, tenant: str, sid: str) -> Path:
        return self.folder / f"{self.stem(tenant, sid)}.json"

    def claim(self) -> None:
        """Make the folder sinklab's (created and marked), or refuse one that holds anything
        without the mark: sinklab never writes among a user's files."""
        folder = self.folder
        try:
            if (folder / MARKER).is_file():
                return
            if folder.is_dir() and any(folder.iterdir()):
                raise SinklabError(
                    f"--sessions {str(folder)!r} holds files sinklab did not make; pass an empty "
                    "or new folder (sinklab marks it as its own)"
                )
            folder.mkdir(parents=True, exist_ok=True)
            (folder / MARKER).write_text(_MARK_TEXT)
        except OSError as err:
            raise SinklabError(
                f"--sessions {str(folder)!r} cannot be used ({err.strerror or err}); pass a "
                "folder this user can write"
            ) from None

    def save(self, session: Session, state: StreamState) -> Path:
        """Write ``session`` (its conversation as it stands) with cache ``state``; raises
        OSError when the folder cannot take it (nothing of the previous turn's files is lost)."""
        tensors = dict(state.tensors)
        tensors[_GEN] = session.chat.gen.get_state()
        data = save({k: v.contiguous().cpu() for k, v in tensors.items()})
        stem = self.stem(session.tenant, session.id)
        name = f"{stem}.{session.chat.turns}.safetensors"
        record = {
            "version": VERSION,
            "id": session.id,
            "tenant": session.tenant,
            "server": self.server,
            "chat": session.chat.record(),
            "stream": state.to_json(),
            "tensors": name,
            "sha256": hashlib.sha256(data).hexdigest(),
            "used": session.used,
        }
        with self._lock:
            self.folder.mkdir(parents=True, exist_ok=True)
            _fsync_write(self.folder / name, data)
            try:
                write_json_atomic(self.folder / f"{stem}.json", record)
            except BaseException:
                (self.folder / name).unlink(missing_ok=True)
                raise
            for old in session.files:
                if old.name != name:
                    old.unlink(missing_ok=True)
            session.files = [self.folder / name]
        return self.folder / name

    def delete(self, session: Session) -> None:
        """Remove the session's files: its JSON first (raises OSError when it cannot: then
        nothing changed), then its tensors files (one that stays is logged, and removed with the
        orphans at the next start-up)."""
        self.remove(session.tenant, session.id, session.files)

    def remove(self, tenant: str, sid: str, files: list[Path]) -> None:
        """:meth:`delete` by tenant, id and tensors files (a session evicted from memory)."""
        with self._lock:
            self.json_path(tenant, sid).unlink(missing_ok=True)
            for old in files:
                try:
                    old.unlink(missing_ok=True)
                except OSError as err:
                    self.log(f"{old.name} not removed ({err.strerror or err})")

    def tidy(self, kept: list[Session]) -> None:
        """Remove what sinklab wrote and nothing names any more: a turn's tensors file whose
        session has no JSON on disk (a crash between the writes, a failed removal) or a newer
        one, and temporary files of an interrupted write. A refused JSON's files stay."""
        names = {p.name for s in kept for p in s.files}
        for path in self.folder.iterdir():
            own = re.fullmatch(r"(session-[0-9a-f]{32})\.\d+\.safetensors", path.name)
            temp = re.fullmatch(r"\.session-[0-9a-f]{32}\.\S+", path.name)
            orphan = (
                own is not None
                and path.name not in names
                and (
                    any(n.startswith(own.group(1) + ".") for n in names)
                    or not (self.folder / f"{own.group(1)}.json").exists()
                )
            )
            if (orphan or temp) and path.is_file() and not path.is_symlink():
                try:
                    path.unlink()
                except OSError as err:
                    self.log(f"{path.name} not removed ({err.strerror or err})")

    def load_all(self, make_chat) -> list[Session]:
        """Every session in the folder that can be served (``make_chat()``: a fresh
        ChatSession); the others refused one by one with a log line."""
        if not self.folder.is_dir():
            return []
        sessions, others = [], []
        for path in sorted(self.folder.iterdir()):
            if not re.fullmatch(r"session-[0-9a-f]{32}\.json", path.name):
                if path.name != MARKER and not _own_file(path.name):
                    others.append(path.name)
                continue  # not a session's JSON: never opened
            try:
                sessions.append(self._load(path, make_chat))
            except SinklabError as err:
                self.log(f"session file {path.name} refused: {err}")
        if others:
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            self.log(
                f"{len(others)} files in {self.folder} are not sinklab's ({shown}); "
                "not read, not touched"
            )
        return sessions

    def load_one(self, tenant: str, sid: str, make_chat) -> Session:
        """The session ``sid`` of ``tenant`` from its file (one parked out of memory)."""
        return self._load(self.json_path(tenant, sid), make_chat)

    def _load(self, path: Path, make_chat) -> Session:
        record = read_json(path, "session file", "session")  # a FIFO, a bomb: one line
        if not isinstance(record, dict) or record.get("version") != VERSION:
            raise SinklabError(f"not a version-{VERSION} sinklab session file")
        if record.get("server") != self.server:
            raise SinklabError(
                f"written for {record.get('server')}, this server is {self.server} (stale)"
            )
        sid, name = record.get("id"), record.get("tensors")
        tenant = record.get("tenant", "")
        if (
            not isinstance(sid, str)
            or not isinstance(tenant, str)
            or path.stem != self.stem(tenant, sid)
            or not isinstance(name, str)
            or not re.fullmatch(rf"{path.stem}\.\d+\.safetensors", name)
        ):
            raise SinklabError("its id or tensors file name does not match the file name")
        data = read_bytes(self.folder / name, "its tensors file", "session tensors")
        if hashlib.sha256(data).hexdigest() != record.get("sha256"):
            raise SinklabError(f"its tensors file {name} does not match its sha256")
        try:
            tensors = load(data)
        except (SafetensorError, ValueError, OSError) as err:
            raise SinklabError(f"its tensors file {name} is not safetensors ({err})") from None
        gen = tensors.pop(_GEN, None)
        chat = make_chat()
        n_layers, _ = model_shape(chat.model)  # every layer's tensors must be there
        state = StreamState.from_json(record.get("stream") or {}, tensors, n_layers)
        chat.load_record(record.get("chat") or {})
        if gen is not None:
            try:
                chat.gen.set_state(gen)
            except (RuntimeError, TypeError) as err:
                raise SinklabError(f"its generator state is broken ({err})") from None
        used = record.get("used")
        if not isinstance(used, (int, float)) or isinstance(used, bool):
            used = path.stat().st_mtime
        return Session(sid, tenant, chat, state, files=[self.folder / name], used=float(used))
