"""The token ids an experiment reads, built once for ``sinklab ablate`` and the report."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sinklab.corpus import DEFAULT_TEXT, FirstToken, Text, documents, token_stream, token_windows


def experiment_ids(
    text_spec: str | None,
    text: Text,
    tokenizer: Any,
    n_tokens: int,
    n_rows: int = 1,
    first: FirstToken | None = None,
) -> Tensor:
    """(B, T) ids, B = ``n_rows`` texts (an experiment whose record reads several texts): the
    first T tokens of B plays of the default corpus, else B consecutive windows of ``text``.
    Every row starts with the run's first token(s) (``first``; by default the tokenizer's own,
    :func:`sinklab.corpus.first_token`)."""
    docs = documents(text_spec) if text_spec in (None, DEFAULT_TEXT) else [text]
    if len(docs) >= n_rows:
        return torch.stack([token_stream(d, tokenizer, n_tokens, first) for d in docs[:n_rows]])
    return token_windows(text, tokenizer, n_tokens, n_rows, first)
