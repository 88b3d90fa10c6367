"""Keep, drop or replace the first token of the input ids (the first-token experiment).

:func:`first_token` edits the *input ids* and records exactly what it did; it never touches the
model. Re-exported by :mod:`sinklab.seam.interventions`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from sinklab.corpus import resolve_token
from sinklab.errors import SinklabError

FIRST_TOKEN_MODES = ("keep", "drop", "bos", "newline", "token", "word")
# Frequent English words; "word" mode draws one (seeded) among those that are a single token.
COMMON_WORDS = ("the", "and", "of", "to", "in", "that", "it", "is", "was", "for", "with", "as")


# --------------------------------------------------------------------------- first token
@dataclass(frozen=True)
class FirstTokenEdit:
    """What :func:`first_token` did. ``ids`` (B, T') is the edited batch.

    ``shift`` maps positions: the original token at position ``j >= 1`` sits at ``j + shift`` in
    ``ids`` (``-1`` for drop, ``0`` otherwise): the same target tokens are scored in every mode.
    """

    mode: str
    ids: Tensor
    original: tuple[int, ...]  # first token id of each row before the edit
    replacement: int | None  # the id put first (None for keep / drop)
    replacement_text: str | None
    shift: int

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "original": list(self.original),
            "replacement": self.replacement,
            "replacement_text": self.replacement_text,
            "shift": self.shift,
            "length": int(self.ids.shape[-1]),
        }


def _word_token(tokenizer: Any, seed: int) -> tuple[int, str]:
    single = []
    for word in COMMON_WORDS:
        ids = tokenizer(word, add_special_tokens=False).input_ids
        if len(ids) == 1:
            single.append((int(ids[0]), word))
    if not single:
        raise SinklabError(
            "no common English word is a single token for this tokenizer; "
            "use mode 'token' with an explicit token id"
        )
    return random.Random(seed).choice(single)


def first_token(
    ids: Tensor,
    mode: str,
    tokenizer: Any = None,
    *,
    token: str | int | None = None,
    seed: int = 0,
) -> FirstTokenEdit:
    """Keep, drop or replace the first token of ``ids`` ((T,) or (B, T)); returns the edit.

    Modes: ``keep``; ``drop`` (T' = T - 1); ``bos`` / ``newline`` (replace with the tokenizer's
    BOS / the single token for "\\n"); ``token`` (replace with ``token``: an id, "bos", "eos" or a
    one-token string); ``word`` (replace with a seeded random common word that is one token).
    """
    if mode not in FIRST_TOKEN_MODES:
        raise SinklabError(
            f"unknown first-token mode {mode!r}; use one of: {', '.join(FIRST_TOKEN_MODES)}"
        )
    batch = ids if ids.ndim == 2 else ids[None]  # (B, T)
    if batch.shape[-1] < 3:
        raise SinklabError(f"first_token needs at least 3 tokens, got {batch.shape[-1]}")
    original = tuple(int(x) for x in batch[:, 0])
    if mode == "keep":
        return FirstTokenEdit(mode, batch.clone(), original, None, None, 0)
    if mode == "drop":
        return FirstTokenEdit(mode, batch[:, 1:].clone(), original, None, None, -1)
    if tokenizer is None and not (mode == "token" and isinstance(token, int)):
        raise SinklabError(f"first-token mode {mode!r} needs a tokenizer")
    if mode == "word":
        tid, text = _word_token(tokenizer, seed)
    else:
        spec = {"bos": "bos", "newline": "\\n"}.get(mode, token)
        if spec is None:
            raise SinklabError("first-token mode 'token' needs token=ID or a one-token string")
        tid = resolve_token(tokenizer, spec) if tokenizer is not None else int(spec)
        text = tokenizer.decode([tid]) if tokenizer is not None else None
    edited = batch.clone()
    edited[:, 0] = tid
    return FirstTokenEdit(mode, edited, original, tid, text, 0)
