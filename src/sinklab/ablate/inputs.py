"""The token ids an experiment reads, built once for ``sinklab ablate`` and the report."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sinklab.corpus import DEFAULT_TEXT, Text, documents, token_stream


def experiment_ids(
    text_spec: str | None, text: Text, tokenizer: Any, n_tokens: int, n_rows: int = 1
) -> Tensor:
    """(B, T) ids, B = ``n_rows`` texts (an experiment whose record reads several texts): the
    first T tokens of B plays of the default corpus, else B consecutive windows of ``text``."""
    docs = documents(text_spec) if text_spec in (None, DEFAULT_TEXT) else [text]
    if len(docs) >= n_rows:
        return torch.stack([token_stream(d, tokenizer, n_tokens) for d in docs[:n_rows]])
    return token_stream(text, tokenizer, n_tokens * n_rows).view(n_rows, n_tokens)
