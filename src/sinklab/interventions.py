"""Causal interventions on attention and inputs, and Jacobian sensitivity.

* :func:`first_token` edits the *input ids* (keep / drop / replace the first token) and records
  exactly what it did; it never touches the model.
* :class:`MaskSink`, :class:`AttentionMix` and :class:`SinkLogit` are
  :class:`~sinklab.seam.AttentionHandler` s: they replace each chunk's weights inside sinklab's one
  registered attention function, so they compose with the probe and with perplexity evaluation.
  :func:`mask_sink`, :func:`attention_mix` and :func:`sink_logit` are context managers that check
  the handler against the model and enter :func:`~sinklab.seam.sinklab_attention`; on exit the
  model computes exactly (bitwise) what it computed before.
* :func:`jacobian_sensitivity` computes ``||d h_L[t] / d x_i||_F`` by autograd on
  ``inputs_embeds``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from sinklab.attention import sink_softmax, softmax
from sinklab.corpus import resolve_token
from sinklab.errors import SinklabError
from sinklab.seam import AttentionChunk, AttentionHandler, sinklab_attention

log = logging.getLogger(__name__)

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


# --------------------------------------------------------------------------- attention handlers
def _index_set(values: Iterable[int] | None, name: str) -> frozenset[int] | None:
    if values is None:
        return None
    out = frozenset(int(v) for v in values)
    if not out:
        raise SinklabError(f"{name} is empty; pass at least one index or None for all")
    if min(out) < 0:
        raise SinklabError(f"{name} must be >= 0, got {sorted(out)}")
    return out


def _query_positions(chunk: AttentionChunk) -> Tensor:
    c = chunk.weights.shape[-2]
    start = chunk.q_offset + chunk.q_start
    return torch.arange(start, start + c, device=chunk.weights.device)  # (c,)


def _head_select(heads: frozenset[int] | None, n_heads: int, device) -> Tensor | None:
    if heads is None:
        return None
    sel = torch.zeros(n_heads, dtype=torch.bool, device=device)
    sel[sorted(heads)] = True
    return sel.view(1, -1, 1, 1)  # (1, H, 1, 1)


@dataclass(frozen=True, eq=False)
class _Intervention(AttentionHandler):
    """Common validation: ``layers`` / ``heads`` (None = all) checked against a model."""

    layers: frozenset[int] | None = None
    heads: frozenset[int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", _index_set(self.layers, "layers"))
        object.__setattr__(self, "heads", _index_set(self.heads, "heads"))

    def check(self, model: nn.Module) -> None:
        """Raise SinklabError if a layer or head is out of the model's range (say the range)."""
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
        cfg = cfg or model.config
        for name, chosen, n in (
            ("layer", self.layers, int(cfg.num_hidden_layers)),
            ("head", self.heads, int(cfg.num_attention_heads)),
        ):
            bad = sorted(x for x in (chosen or ()) if x >= n)
            if bad:
                raise SinklabError(
                    f"{name} {bad[0]} is out of range: this model has {name}s 0..{n - 1}; "
                    f"pass {name}s in that range"
                )


@dataclass(frozen=True, eq=False)
class MaskSink(_Intervention):
    """Zero the attention to key ``positions`` and renormalise each row over the other keys.

    Queries whose every visible key is a masked position (the sink tokens themselves, e.g. query 0
    when masking position 0) are left unchanged; masking *every* key position of an input is an
    error. Rows that send no attention to the positions are returned bitwise unchanged.
    """

    positions: frozenset[int] = frozenset({0})

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "positions", _index_set(self.positions, "positions"))

    def transform(self, chunk: AttentionChunk) -> None:
        w = chunk.weights  # (B, H, c, Tk)
        tk = w.shape[-1]
        if set(range(tk)) <= self.positions:
            raise SinklabError(
                f"mask_sink positions {sorted(self.positions)} cover every key position "
                f"0..{tk - 1} of this input, so no query has a key left to attend to; "
                "mask fewer positions or pass a longer input"
            )
        cols = torch.zeros(tk, dtype=torch.bool, device=w.device)
        cols[[p for p in self.positions if p < tk]] = True
        if not cols.any():
            return
        keep = chunk.mask & ~cols  # (B|1, 1|H, c, Tk)
        has_other = keep.any(-1, keepdim=True)
        zeroed = w.masked_fill(cols, 0.0)
        removed = (w * cols).sum(-1, keepdim=True)
        total = zeroed.sum(-1, keepdim=True)
        renorm = zeroed / total.clamp_min(torch.finfo(w.dtype).tiny)
        if bool(((total <= 0) & has_other).any()):  # all mass was on the sink: re-softmax
            renorm = torch.where(total > 0, renorm, softmax(chunk.scores, keep).to(w.dtype))
        out = torch.where(has_other & (removed != 0), renorm, w)
        sel = _head_select(self.heads, w.shape[1], w.device)
        chunk.weights = out if sel is None else torch.where(sel, out, w)


@dataclass(frozen=True, eq=False)
class AttentionMix(_Intervention):
    """Weights ``(1 - lam) * identity + lam * uniform-causal`` (uniform over visible keys).

    ``lam = 0``: each query attends only to itself (diagonal); ``lam = 1``: the causal running mean.
    """

    lam: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= float(self.lam) <= 1.0:
            raise SinklabError(
                f"lam must be in [0, 1] (0 = diagonal, 1 = uniform causal), got {self.lam}"
            )

    def transform(self, chunk: AttentionChunk) -> None:
        w = chunk.weights  # (B, H, c, Tk)
        vis = chunk.mask.expand_as(w).to(w.dtype)
        uniform = vis / vis.sum(-1, keepdim=True).clamp_min(1.0)
        keys = torch.arange(w.shape[-1], device=w.device)
        eye = (keys[None, :] == _query_positions(chunk)[:, None]).to(w.dtype) * vis  # diagonal
        out = (1.0 - self.lam) * eye + self.lam * uniform
        sel = _head_select(self.heads, w.shape[1], w.device)
        chunk.weights = out if sel is None else torch.where(sel, out, w)


@dataclass(frozen=True, eq=False)
class SinkLogit(_Intervention):
    """Give each query a virtual zero-value key with logit ``value`` (0 = softmax + 1).

    The weights become :func:`sinklab.attention.sink_softmax` of the scores; they sum to < 1.
    """

    value: float = 0.0

    def transform(self, chunk: AttentionChunk) -> None:
        w = chunk.weights
        out = sink_softmax(chunk.scores, chunk.mask, float(self.value)).to(w.dtype)
        sel = _head_select(self.heads, w.shape[1], w.device)
        chunk.weights = out if sel is None else torch.where(sel, out, w)


@contextmanager
def intervene(model: nn.Module, *handlers: _Intervention) -> Iterator[nn.Module]:
    """Check ``handlers`` against ``model`` and route attention through them; restore on exit."""
    for h in handlers:
        h.check(model)
    with sinklab_attention(model, *handlers):
        yield model


def _opt(values: Iterable[int] | None) -> frozenset[int] | None:
    return None if values is None else frozenset(int(v) for v in values)


def mask_sink(
    model: nn.Module,
    positions: Iterable[int] = (0,),
    layers: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
) -> Any:
    """Context manager: :class:`MaskSink` on ``layers`` / ``heads`` (None = all)."""
    return intervene(
        model, MaskSink(layers=_opt(layers), heads=_opt(heads), positions=frozenset(positions))
    )


def attention_mix(
    model: nn.Module,
    lam: float,
    layers: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
) -> Any:
    """Context manager: :class:`AttentionMix` with ``lam`` in [0, 1] on ``layers`` (None = all)."""
    return intervene(model, AttentionMix(layers=_opt(layers), heads=_opt(heads), lam=float(lam)))


def sink_logit(
    model: nn.Module,
    value: float = 0.0,
    layers: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
) -> Any:
    """Context manager: :class:`SinkLogit` with logit ``value`` on ``layers`` (None = all)."""
    return intervene(model, SinkLogit(layers=_opt(layers), heads=_opt(heads), value=float(value)))


# --------------------------------------------------------------------------- sensitivity
def _final_hidden(model: nn.Module, x: Tensor, layer: int) -> Tensor:
    out = model(inputs_embeds=x, output_hidden_states=True, use_cache=False)
    return out.hidden_states[layer]  # (1, T, d)


def jacobian_sensitivity(
    model: nn.Module,
    ids: Tensor,
    query_pos: Sequence[int],
    key_pos: Sequence[int],
    *,
    handlers: Sequence[AttentionHandler] = (),
    layer: int = -1,
    probes: int | None = None,
    batch: int = 64,
    seed: int = 0,
    callback: Callable[[int, int], None] | None = None,
) -> Tensor:
    """``S[a, b] = ||d h[t_a] / d x[i_b]||_F`` for ``t`` in ``query_pos``, ``i`` in ``key_pos``.

    ``h`` = ``hidden_states[layer]`` (default -1: the final representation the LM head reads),
    ``x`` = the input embeddings; the norm is the Frobenius norm of the ``d x d`` Jacobian block
    (0 where ``i > t``: causal). ``ids`` (T,) or (1, T). ``handlers`` (e.g. a :class:`MaskSink`)
    are active during the forward. ``probes=None`` is exact (``d`` vector-Jacobian products per
    query, batched ``batch`` at a time); ``probes=k`` estimates the squared norm without bias with
    ``k`` Rademacher probes (Hutchinson), ``k`` VJPs per query. Each query runs a forward over its
    prefix only (causality makes that exact). Returns float64 ``(len(query_pos), len(key_pos))``.
    """
    ids = ids if ids.ndim == 2 else ids[None]  # (1, T)
    t_max = ids.shape[-1] - 1
    for name, pos in (("query_pos", query_pos), ("key_pos", key_pos)):
        if not pos or min(pos) < 0 or max(pos) > t_max:
            raise SinklabError(f"{name} must be non-empty positions in 0..{t_max}, got {pos}")
    emb = model.get_input_embeddings()(ids).detach()  # (1, T, d)
    d = emb.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    keys = torch.tensor(list(key_pos))
    result = torch.zeros(len(query_pos), len(key_pos), dtype=torch.float64)
    masked = set().union(*(h.positions for h in handlers if isinstance(h, MaskSink)))
    with sinklab_attention(model, *handlers), torch.enable_grad():
        for a, t in enumerate(query_pos):
            n = t + 1  # a prefix suffices (causal), but not one made only of masked positions
            while n < ids.shape[-1] and set(range(n)) <= masked:
                n += 1
            x = emb[:, :n].clone().requires_grad_(True)
            h = _final_hidden(model, x, layer)[0, t]  # (d,)
            sq = torch.zeros(n, dtype=torch.float64)
            n_vec = d if probes is None else int(probes)
            for s in range(0, n_vec, batch):
                k = min(batch, n_vec - s)
                if probes is None:  # rows s..s+k of the identity
                    cot = torch.zeros(k, d, dtype=h.dtype)
                    cot[torch.arange(k), torch.arange(s, s + k)] = 1.0
                else:
                    cot = (torch.randint(0, 2, (k, d), generator=gen) * 2 - 1).to(h.dtype)
                (g,) = torch.autograd.grad(
                    h, x, grad_outputs=cot, is_grads_batched=True, retain_graph=True
                )  # (k, 1, n, d)
                sq += g.double().pow(2).sum(dim=(0, 1, 3))
            if probes is not None:
                sq /= float(probes)
            valid = keys <= t
            result[a, valid] = sq[keys[valid]].sqrt()
            if callback is not None:
                callback(a + 1, len(query_pos))
    return result
