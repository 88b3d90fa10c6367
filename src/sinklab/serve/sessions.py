"""Sessions and their files.

A :class:`Session` is one conversation: its :class:`~sinklab.stream.chat.ChatSession` (messages,
the text its cache has read, the sampling generator) and, between turns, its cache as a
:class:`~sinklab.stream.state.StreamState`. It belongs to the tenant (API key) that created it.

:class:`SessionStore` writes a session after each completed turn, so that a crash loses at most
the turn in flight: ``DIR/ID.T.safetensors`` (the cache tensors and the generator state of turn
``T``, written to a temporary file, flushed and renamed), then ``DIR/ID.json`` (the conversation,
the stream's bookkeeping, the server's config and the tensors file's sha256; written the same
way, the commit point), then the previous turn's tensors file is removed. A crash at any point
leaves the JSON naming a complete tensors file. At start-up every ``*.json`` is read through
:mod:`sinklab.safeio` (a regular file, bounded in size and JSON nesting: a FIFO cannot block
start-up); one that is corrupt, truncated, of another model or cache config, or whose tensors do
not match its hash is refused with one log line and left on disk; the others are served.
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


class SessionStore:
    """The ``--sessions`` folder: :meth:`save` after a turn, :meth:`load_all` at start-up,
    :meth:`delete`. ``server``: what a file must have been written by (model and cache)."""

    def __init__(self, folder: Path, server: dict[str, Any], log) -> None:
        self.folder = Path(folder)
        self.server = server
        self.log = log
        self._lock = threading.Lock()

    def save(self, session: Session, state: StreamState) -> Path:
        """Write ``session`` (its conversation as it stands) with cache ``state``; raises
        OSError when the folder cannot take it (nothing of the previous turn's files is lost)."""
        tensors = dict(state.tensors)
        tensors[_GEN] = session.chat.gen.get_state()
        data = save({k: v.contiguous().cpu() for k, v in tensors.items()})
        name = f"{session.id}.{session.chat.turns}.safetensors"
        record = {
            "version": VERSION,
            "id": session.id,
            "tenant": session.tenant,
            "server": self.server,
            "chat": session.chat.record(),
            "stream": state.to_json(),
            "tensors": name,
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        with self._lock:
            self.folder.mkdir(parents=True, exist_ok=True)
            _fsync_write(self.folder / name, data)
            try:
                write_json_atomic(self.folder / f"{session.id}.json", record)
            except BaseException:
                (self.folder / name).unlink(missing_ok=True)
                raise
            for old in session.files:
                if old.name != name:
                    old.unlink(missing_ok=True)
            session.files = [self.folder / name]
        return self.folder / name

    def delete(self, session: Session) -> None:
        with self._lock:
            (self.folder / f"{session.id}.json").unlink(missing_ok=True)
            for old in session.files:
                old.unlink(missing_ok=True)

    def load_all(self, make_chat) -> list[Session]:
        """Every session in the folder that can be served (``make_chat()``: a fresh
        ChatSession); the others refused one by one with a log line."""
        if not self.folder.is_dir():
            return []
        sessions = []
        for path in sorted(self.folder.glob("*.json")):
            try:
                sessions.append(self._load(path, make_chat))
            except SinklabError as err:
                self.log(f"session file {path.name} refused: {err}")
        return sessions

    def _load(self, path: Path, make_chat) -> Session:
        record = read_json(path, "session file", "session")  # a FIFO, a bomb: one line
        if not isinstance(record, dict) or record.get("version") != VERSION:
            raise SinklabError(f"not a version-{VERSION} sinklab session file")
        if record.get("server") != self.server:
            raise SinklabError(
                f"written for {record.get('server')}, this server is {self.server} (stale)"
            )
        sid, name = record.get("id"), record.get("tensors")
        if (
            not isinstance(sid, str)
            or sid != path.stem
            or not isinstance(name, str)
            or not re.fullmatch(rf"{re.escape(sid)}\.\d+\.safetensors", name)
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
        return Session(sid, str(record.get("tenant", "")), chat, state, files=[self.folder / name])
