"""Training data for the lab: documents, a tiny tokenizer, and the four data strategies.

Documents are scenes of the embedded plays (a play without scene headings stays one document),
in corpus order; every ``val_every``-th document is held out for validation. The tokenizer is a
byte-level BPE trained on the training documents (so nothing is ever out of vocabulary) and is
saved with every checkpoint: checkpoints are self-contained.

Strategies (docs/science.md#bos), each giving ``ids`` and ``doc`` (document index per
token), both ``(N, seq_len)``:

* ``bos``: each sequence is ``[BOS] + seq_len - 1`` tokens of one document; causal mask.
* ``packed``: all documents back to back, cut every ``seq_len`` tokens; no BOS anywhere.
* ``packed-bos``: ``[BOS] + document`` back to back, cut every ``seq_len``; attention crosses
  documents.
* ``doc-mask``: as ``packed-bos``, attention restricted to the query's own document
  (:func:`document_mask`, a bool ``(B, 1, T, T)`` mask the lab model takes as ``attention_mask``).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sinklab.corpus import documents
from sinklab.errors import SinklabError

DATA_STRATEGIES = ("bos", "packed", "packed-bos", "doc-mask")
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2 (pad, BOS, EOS)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_SCENE = re.compile(r"^[ \t]*SCENE[ \t]+[IVXLC]+\b", re.M | re.I)


def scene_documents(text_spec: str | None = None) -> list[str]:
    """The corpus as documents: one scene each (one play when it has no scene headings)."""
    out: list[str] = []
    for doc in documents(text_spec):
        starts = [m.start() for m in _SCENE.finditer(doc.text)]
        if len(starts) < 2:
            out.append(doc.text.strip())
            continue
        bounds = [0, *starts[1:], len(doc.text)]  # the preamble joins the first scene
        out.extend(doc.text[a:b].strip() for a, b in itertools.pairwise(bounds))
    return [d for d in out if d]


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) with <pad>=0, <s>=1, </s>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise SinklabError(f"vocab_size must be >= 300 (256 bytes + merges), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def document_mask(doc: Tensor) -> Tensor:
    """Causal mask restricted to each query's document: ``doc`` (B, T) -> bool (B, 1, T, T)."""
    t = doc.shape[-1]
    same = doc[:, :, None] == doc[:, None, :]  # (B, T, T), query x key
    causal = torch.ones(t, t, dtype=torch.bool, device=doc.device).tril()
    return (same & causal)[:, None]  # (B, 1, T, T)


@dataclass(frozen=True)
class DataConfig:
    """What to train on and how to cut it."""

    strategy: str = "bos"
    seq_len: int = 128
    vocab_size: int = 2048
    val_every: int = 20  # every 20th document is held out (5 %)
    max_docs: int | None = None  # keep the first N documents (tests); None = all
    text: str | None = None  # None = the embedded plays

    def __post_init__(self) -> None:
        if self.strategy not in DATA_STRATEGIES:
            raise SinklabError(
                f"unknown data strategy {self.strategy!r}; use one of: {', '.join(DATA_STRATEGIES)}"
            )
        if not 8 <= self.seq_len <= 8192:
            raise SinklabError(f"seq_len must be in 8..8192, got {self.seq_len}")
        if self.val_every < 2:
            raise SinklabError(f"val_every must be >= 2, got {self.val_every}")
        if self.max_docs is not None and self.max_docs < 2:
            raise SinklabError(f"max_docs must be >= 2 (train + validation), got {self.max_docs}")

    @property
    def uses_bos(self) -> bool:
        return self.strategy != "packed"

    @property
    def masks_documents(self) -> bool:
        return self.strategy == "doc-mask"


def _windows(stream: Tensor, doc: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len), doc[: n * seq_len].view(n, seq_len)


def make_sequences(docs: list[Tensor], strategy: str, seq_len: int) -> tuple[Tensor, Tensor]:
    """Cut tokenized documents into ``(ids, doc)``, each LongTensor ``(N, seq_len)``."""
    bos = torch.tensor([BOS_ID])
    if strategy == "bos":
        ids, doc, body = [], [], seq_len - 1
        for i, d in enumerate(docs):
            for s in range(0, d.numel() - body + 1, body):
                ids.append(torch.cat([bos, d[s : s + body]]))
                doc.append(torch.full((seq_len,), i))
        if not ids:
            raise SinklabError(f"no document has {body} tokens; pass a smaller seq_len")
        return torch.stack(ids), torch.stack(doc)
    pieces = [torch.cat([bos, d]) if strategy != "packed" else d for d in docs]
    stream = torch.cat(pieces)
    doc = torch.cat([torch.full((p.numel(),), i) for i, p in enumerate(pieces)])
    if stream.numel() < seq_len:
        raise SinklabError(f"the documents hold {stream.numel()} tokens, fewer than seq_len")
    return _windows(stream, doc, seq_len)


class LabData:
    """Tokenized train/validation documents and deterministic batches for one strategy."""

    def __init__(self, config: DataConfig, tokenizer: Any | None = None) -> None:
        self.config = config
        texts = scene_documents(config.text)
        if config.max_docs is not None:
            texts = texts[: config.max_docs]
        if len(texts) < 2:
            raise SinklabError("the text has fewer than 2 documents; pass a longer text")
        val_idx = set(range(config.val_every - 1, len(texts), config.val_every)) or {len(texts) - 1}
        train_texts = [t for i, t in enumerate(texts) if i not in val_idx]
        val_texts = [t for i, t in enumerate(texts) if i in val_idx]
        self.tokenizer = tokenizer or train_tokenizer(train_texts, config.vocab_size)

        def encode(ts: list[str]) -> list[Tensor]:
            enc = self.tokenizer(ts, add_special_tokens=False).input_ids
            return [torch.tensor(e, dtype=torch.long) for e in enc]

        self.train_docs, self.val_docs = encode(train_texts), encode(val_texts)
        self.ids, self.doc = make_sequences(self.train_docs, config.strategy, config.seq_len)
        self.n_train_tokens = sum(d.numel() for d in self.train_docs)

    def batch_order(self, n_batches: int, batch_size: int, seed: int) -> Tensor:
        """Row indices ``(n_batches, batch_size)``: epochs of seeded permutations, in order."""
        g = torch.Generator().manual_seed(seed)
        need, rows = n_batches * batch_size, []
        while sum(r.numel() for r in rows) < need:
            rows.append(torch.randperm(self.ids.shape[0], generator=g))
        return torch.cat(rows)[:need].view(n_batches, batch_size)

    def batch(self, rows: Tensor) -> dict[str, Tensor]:
        """``input_ids``/``labels`` (B, T), and ``attention_mask`` (B, 1, T, T) for doc-mask."""
        ids = self.ids[rows]  # (B, T)
        out = {"input_ids": ids, "labels": ids.clone()}
        if self.config.masks_documents:
            out["attention_mask"] = document_mask(self.doc[rows])
        return out

    def eval_windows(self, n: int) -> tuple[Tensor, Tensor]:
        """Validation ``(prefix (N,), text (N, seq_len - 1))`` from held-out documents.

        ``text`` never crosses a document. ``prefix`` is what the model saw first in training:
        BOS for BOS strategies, else the document token just before the window. The model input
        "with the first token" is ``[prefix] + text``, "without" is ``text``; both are scored on
        ``text[1:]``, so the two perplexities cover the same tokens.
        """
        body = self.config.seq_len - 1
        prefix, text = [], []
        for d in self.val_docs:
            for s in range(1, d.numel() - body + 1, body):
                prefix.append(BOS_ID if self.config.uses_bos else int(d[s - 1]))
                text.append(d[s : s + body])
                if len(text) == n:
                    return torch.tensor(prefix), torch.stack(text)
        if not text:
            raise SinklabError(f"no validation document has {body + 1} tokens; lower seq_len")
        return torch.tensor(prefix), torch.stack(text)
