"""The bigram-backcopy task (Guo et al. 2024, "Active-Dormant Attention Heads", arXiv 2410.13835).

Tokens are the characters of a text (the embedded plays by default), ids ``3 + i`` in code-point
order after ``<pad>`` = 0, ``<s>`` (BOS) = 1, ``</s>`` = 2. A sequence is

* ``[BOS]`` (data ``bos``; nothing for ``no-bos``), then a first character drawn from the unigram
  distribution of the non-trigger characters;
* then, position by position: after a **trigger** (the ``n_triggers`` most frequent characters,
  default ``' '``, ``'e'``, ``'t'``) the next token **copies the token before the trigger**;
  everywhere else the next token is drawn from the text's bigram table ``P(next | current)``.

The bigram table used for sampling never puts a trigger right after a trigger (those entries are
zeroed and the row renormalised), so a copied token is never a trigger and copies never chain.
A head must attend to the previous token at trigger queries and "do nothing" everywhere else:
the "nothing" is where a sink forms. Batches are drawn online from a generator seeded by
``(seed, step)``, so a run is deterministic for a seed and any slice of a step's batch can be
rebuilt anywhere (one rank of a DDP run).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sinklab.errors import SinklabError
from sinklab.lab.data import BOS_ID, SPECIAL_TOKENS
from sinklab.seeds import derive_seed

BACKCOPY_DATA = ("bos", "no-bos")
N_SPECIAL = len(SPECIAL_TOKENS)
_EVAL_STREAM = 1_000_003  # generator stream for held-out sequences (training uses step >= 0)


@dataclass(frozen=True)
class BigramTable:
    """Character vocabulary, unigram and (trigger-free after a trigger) bigram probabilities.

    ``unigram`` (V,), ``transition`` (V, V) with ``transition[a, b] = P(b | a)``, indexed by token
    id (special tokens get zero mass); ``triggers`` are token ids.
    """

    chars: tuple[str, ...]
    unigram: Tensor
    transition: Tensor
    triggers: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return N_SPECIAL + len(self.chars)

    def is_trigger(self, ids: Tensor) -> Tensor:
        """Bool mask of ``ids`` (any shape) that are triggers."""
        return torch.isin(ids, torch.tensor(self.triggers, device=ids.device))

    def token(self, token_id: int) -> str:
        if token_id < N_SPECIAL:
            return SPECIAL_TOKENS[token_id]
        return self.chars[token_id - N_SPECIAL]

    def first_probs(self) -> Tensor:
        """Distribution of the first character: the unigram without triggers, (V,)."""
        p = self.unigram.clone()
        p[list(self.triggers)] = 0.0
        return p / p.sum()


@functools.lru_cache(maxsize=8)
def _char_counts(text_spec: str | None) -> tuple[tuple[str, ...], Tensor, Tensor]:
    from sinklab.corpus import load_text

    text = load_text(text_spec).text
    points = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
    uniq, codes = torch.unique(points, sorted=True, return_inverse=True)  # code point order
    chars = tuple(chr(int(c)) for c in uniq)
    if len(chars) < 5:
        raise SinklabError(f"the text has {len(chars)} distinct characters; pass a longer text")
    n = len(chars)
    uni = torch.bincount(codes, minlength=n).double()
    pairs = torch.bincount(codes[:-1] * n + codes[1:], minlength=n * n).double().view(n, n)
    return chars, uni, pairs


def bigram_table(text_spec: str | None = None, n_triggers: int = 3) -> BigramTable:
    """The table of ``text_spec`` (None = the embedded plays); triggers = most frequent chars."""
    chars, uni, pairs = _char_counts(text_spec)
    n = len(chars)
    if not 1 <= n_triggers <= n // 2:
        raise SinklabError(f"--n-triggers must be in 1..{n // 2} for this text, got {n_triggers}")
    order = sorted(range(n), key=lambda i: (-float(uni[i]), i))
    trig_chars = order[:n_triggers]
    pairs = pairs.clone()
    for a in trig_chars:
        pairs[a, trig_chars] = 0.0  # never a trigger right after a trigger
    rows = pairs.sum(dim=1, keepdim=True)
    fallback = uni.clone()
    fallback[trig_chars] = 0.0  # a row with no successors (the last character) -> unigram
    trans_c = torch.where(rows > 0, pairs / rows.clamp_min(1.0), fallback / fallback.sum())
    v = N_SPECIAL + n
    unigram = torch.zeros(v, dtype=torch.float64)
    unigram[N_SPECIAL:] = uni / uni.sum()
    transition = torch.zeros(v, v, dtype=torch.float64)
    transition[N_SPECIAL:, N_SPECIAL:] = trans_c
    triggers = tuple(N_SPECIAL + i for i in trig_chars)
    return BigramTable(chars, unigram.float(), transition.float(), triggers)


def _cdf(probs: Tensor) -> Tensor:
    """Row-wise cumulative distribution (float64), each non-empty row ending at exactly 1."""
    c = probs.double().cumsum(-1)
    return c / c[..., -1:].clamp_min(1e-300)


def _draw(cdf: Tensor, generator: torch.Generator) -> Tensor:
    """One index per row of ``cdf`` (n, V) by inverse transform: the first index whose
    cumulative probability exceeds a uniform draw (a zero-probability index is never chosen).
    A row with no probability mass (all zero, or NaN) has nothing to draw: ValueError (the
    tables never hold one; a silent pick of the last index would hide the bug that made it)."""
    empty = ~(cdf[:, -1] > 0)  # (n,): _cdf's non-empty rows end at exactly 1
    if empty.any():
        rows = empty.nonzero()[:, 0].tolist()
        raise ValueError(
            f"no probability mass to draw from in row(s) {rows[:5]} of {cdf.shape[0]} "
            "(all zero or NaN)"
        )
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=torch.float64)
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_max(cdf.shape[-1] - 1)


def sample(table: BigramTable, n: int, seq_len: int, bos: bool, generator: torch.Generator):
    """``n`` sequences ``(ids, copied)``, each (n, seq_len); ``copied`` marks copied tokens.

    Each draw is one uniform number per row through the table's cumulative distribution (one
    vectorised lookup per position, not a multinomial call per row)."""
    v = table.vocab_size
    ids = torch.zeros(n, seq_len, dtype=torch.long)
    start = 1 if bos else 0
    if bos:
        ids[:, 0] = BOS_ID
    ids[:, start] = _draw(_cdf(table.first_probs()).expand(n, v).contiguous(), generator)
    trans_cdf = _cdf(table.transition)  # (V, V)
    is_trig = torch.zeros(v, dtype=torch.bool)
    is_trig[list(table.triggers)] = True
    copied = torch.zeros(n, seq_len, dtype=torch.bool)
    for t in range(start + 1, seq_len):
        prev = ids[:, t - 1]
        drawn = _draw(trans_cdf[prev], generator)
        copy = is_trig[prev] & (t - 2 >= start)  # a trigger always has a token before it
        ids[:, t] = torch.where(copy, ids[:, t - 2], drawn)
        copied[:, t] = copy
    return ids, copied


def char_tokenizer(table: BigramTable) -> Any:
    """A character-level ``PreTrainedTokenizerFast`` for the table (saved with checkpoints)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: N_SPECIAL + i for i, c in enumerate(table.chars)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


@dataclass(frozen=True)
class BackcopyConfig:
    """What to sample: sequence length, BOS or not, how many triggers, from which text."""

    seq_len: int = 128
    bos: bool = True
    n_triggers: int = 3
    text: str | None = None  # None = the embedded plays

    def __post_init__(self) -> None:
        if not 8 <= self.seq_len <= 8192:
            raise SinklabError(f"seq_len must be in 8..8192, got {self.seq_len}")
        if self.n_triggers < 1:
            raise SinklabError(f"--n-triggers must be >= 1, got {self.n_triggers}")


class BackcopyData:
    """Online backcopy batches (``batch(step, ...)``) and fixed held-out sequences."""

    def __init__(self, config: BackcopyConfig) -> None:
        self.config = config
        self.table = bigram_table(config.text, config.n_triggers)
        self.tokenizer = char_tokenizer(self.table)

    def _generator(self, seed: int, stream: int) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(seed, 2_000_003, stream))

    def batch(
        self, step: int, batch_size: int, seed: int, rows: slice | None = None
    ) -> dict[str, Tensor]:
        """Step ``step``'s batch (every row drawn from the step's own generator); ``rows`` keeps
        a slice of it (a DDP rank's share). ``input_ids``/``labels`` (b, T)."""
        g = self._generator(seed, step)
        ids, _ = sample(self.table, batch_size, self.config.seq_len, self.config.bos, g)
        ids = ids if rows is None else ids[rows]
        return {"input_ids": ids, "labels": ids.clone()}

    def held_out(self, n: int, seed: int) -> tuple[Tensor, Tensor]:
        """``n`` held-out sequences ``(ids, copied)`` (n, T), never a training batch."""
        return sample(
            self.table, n, self.config.seq_len, self.config.bos, self._generator(seed, -1)
        )


@torch.no_grad()
def backcopy_validation(
    model: torch.nn.Module, data: BackcopyData, n: int, seed: int, device: str
) -> dict[str, float]:
    """Held-out loss with and without the first token (BOS, or the first character).

    Both inputs are scored on the same targets, ``ids[:, 2:]``, except a copy whose source is the
    removed first token (possible without BOS only). ``damage`` = ``ppl_without_first /
    ppl_with_first - 1``; ``backcopy_loss_*``: mean NLL (nats) of the copied targets only;
    ``backcopy_loss_median``: the median over the sequences (with the first token) of each
    sequence's mean copy NLL, the robust statistic the copy-loss floor reads
    (docs/claims.md#lab-validity: one odd sequence can carry most of a mean), over the
    ``n_sequences`` sequences that hold a copy.
    """
    ids, copied = data.held_out(n, seed + _EVAL_STREAM)
    ids, copied = ids.to(device), copied.to(device)
    target, is_copy = ids[:, 2:], copied[:, 2:]  # (N, T - 2)
    keep = torch.ones_like(target, dtype=torch.bool)
    keep[:, 0] &= ~is_copy[:, 0]  # ids[:, 2] copied from ids[:, 0]: unknowable without it
    out: dict[str, float] = {}
    for name, inputs, skip in (("with_first", ids, 1), ("without_first", ids[:, 1:], 0)):
        nll = []
        for i in range(0, ids.shape[0], 32):
            logits = model(inputs[i : i + 32]).logits[:, skip:-1]  # (b, T - 2, V)
            nll.append(
                F.cross_entropy(logits.transpose(1, 2), target[i : i + 32], reduction="none")
            )
        per = torch.cat(nll)  # (N, T - 2)
        out[f"nll_{name}"] = float(per[keep].mean())
        out[f"backcopy_loss_{name}"] = float(per[keep & is_copy].mean())
        if name == "with_first":
            mask = (keep & is_copy).double()  # (N, T - 2)
            has = mask.sum(1) > 0
            seq = (per.double() * mask).sum(1)[has] / mask.sum(1)[has]  # (N',) per sequence
            out["median"] = float(seq.median()) if seq.numel() else float("nan")
            out["n_sequences"] = int(has.sum())
    ppl_w, ppl_wo = math.exp(out["nll_with_first"]), math.exp(out["nll_without_first"])
    return {
        "ppl_with_first": ppl_w,
        "ppl_without_first": ppl_wo,
        "damage": ppl_wo / ppl_w - 1,
        "backcopy_loss_with_first": out["backcopy_loss_with_first"],
        "backcopy_loss_without_first": out["backcopy_loss_without_first"],
        "backcopy_loss_median": out["median"],
        "n_sequences": out["n_sequences"],
    }
