"""Causal interventions on attention, and Jacobian sensitivity (input-id edits such as the
first-token experiment live in :mod:`sinklab.ablate.first_token`).

* :class:`MaskSink`, :class:`AttentionMix`, :class:`AttentionTemperature`,
  :class:`AttentionReplace` and :class:`SinkLogit` are
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
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from sinklab.attention import sink_softmax, softmax
from sinklab.errors import SinklabError
from sinklab.models.arch import input_device, model_shape
from sinklab.progress import Progress, quiet
from sinklab.seam import AttentionChunk, AttentionHandler, sinklab_attention

log = logging.getLogger(__name__)


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
        n_layers, n_heads = model_shape(model)
        for name, chosen, n in (("layer", self.layers, n_layers), ("head", self.heads, n_heads)):
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

    def slot_order_reason(self, fixed: frozenset[int]) -> str | None:
        extra = sorted(self.positions - fixed)
        if not extra:
            return None
        return (
            f"mask_sink positions {extra} are not sinks of this cache, which holds its window in "
            f"ring order, so a window position has no fixed key slot; mask sink positions "
            f"({sorted(fixed) or 'none here'}) or stream with the dense policy"
        )

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


def _check_lam(lam: float, meaning: str) -> None:
    if not 0.0 <= float(lam) <= 1.0:
        raise SinklabError(
            f"lam must be in [0, 1] ({meaning}), got {lam}; pass e.g. --lams 0,0.5,1"
        )


def _uniform_causal(chunk: AttentionChunk) -> Tensor:
    """Uniform weights over each query's visible keys: (B, H, c, Tk)."""
    vis = chunk.mask.expand_as(chunk.weights).to(chunk.weights.dtype)
    return vis / vis.sum(-1, keepdim=True).clamp_min(1.0)


def _select(heads: frozenset[int] | None, out: Tensor, w: Tensor) -> Tensor:
    sel = _head_select(heads, w.shape[1], w.device)
    return out if sel is None else torch.where(sel, out, w)


@dataclass(frozen=True, eq=False)
class AttentionMix(_Intervention):
    """Make a trained model's attention denser: ``(1 - lam) * w_model + lam * uniform-causal``.

    ``lam = 0`` is the model itself (bitwise: the weights are not touched); ``lam = 1`` the causal
    running mean. The density protocol ``mix`` (docs/experiments.md).
    """

    lam: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_lam(self.lam, "0 = the model's own attention, 1 = uniform causal")

    def transform(self, chunk: AttentionChunk) -> None:
        if self.lam == 0.0:
            return
        w = chunk.weights  # (B, H, c, Tk)
        out = (1.0 - self.lam) * w + self.lam * _uniform_causal(chunk)
        chunk.weights = _select(self.heads, out, w)


@dataclass(frozen=True, eq=False)
class AttentionTemperature(_Intervention):
    """Weights ``softmax(s / tau)`` over the visible keys: ``tau < 1`` sharper, ``> 1`` denser.

    ``tau = 1`` is the model itself. Softmax attention only (a lab model's softmax1 / sink / gated
    variant is an error). The density protocol ``temperature`` (docs/experiments.md).
    """

    tau: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(float(self.tau)) and float(self.tau) > 0.0):
            raise SinklabError(
                f"temperature must be a finite number > 0 (< 1 sharper, > 1 denser), got "
                f"{self.tau}; pass e.g. --temperatures 0.5,1,2"
            )

    def transform(self, chunk: AttentionChunk) -> None:
        variant = getattr(chunk.module, "attention_variant", "softmax")
        if variant != "softmax":
            raise SinklabError(
                f"the temperature protocol needs softmax attention; layer {chunk.layer} uses "
                f"{variant!r}: use --protocol mix"
            )
        w = chunk.weights
        out = softmax(
            chunk.scores.to(torch.promote_types(w.dtype, torch.float32)) / self.tau, chunk.mask
        ).to(w.dtype)
        chunk.weights = _select(self.heads, out, w)


@dataclass(frozen=True, eq=False)
class AttentionReplace(_Intervention):
    """Replace the weights by ``(1 - lam) * identity + lam * uniform-causal``.

    ``lam = 0``: each query attends only to itself (diagonal); ``lam = 1``: the causal running mean.
    Confound: at small ``lam`` every token behaves as a first token (it attends to itself only),
    and first tokens carry a trained model's massive activations.
    """

    lam: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_lam(self.lam, "0 = diagonal, 1 = uniform causal")

    def slot_order_reason(self, fixed: frozenset[int]) -> str | None:
        return (
            "attention_replace reads each query's own key, which a sink cache holds at a ring "
            "slot, not the last one; run it on a full forward or stream with the dense policy"
        )

    def transform(self, chunk: AttentionChunk) -> None:
        w = chunk.weights  # (B, H, c, Tk)
        keys = torch.arange(w.shape[-1], device=w.device)
        vis = chunk.mask.expand_as(w).to(w.dtype)
        eye = (keys[None, :] == _query_positions(chunk)[:, None]).to(w.dtype) * vis  # diagonal
        out = (1.0 - self.lam) * eye + self.lam * _uniform_causal(chunk)
        chunk.weights = _select(self.heads, out, w)


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


def attention_temperature(
    model: nn.Module,
    tau: float,
    layers: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
) -> Any:
    """Context manager: :class:`AttentionTemperature` with ``tau > 0`` on ``layers``."""
    handler = AttentionTemperature(layers=_opt(layers), heads=_opt(heads), tau=float(tau))
    return intervene(model, handler)


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
    progress: Progress = quiet,
) -> Tensor:
    """``S[a, b] = ||d h[t_a] / d x[i_b]||_F`` for ``t`` in ``query_pos``, ``i`` in ``key_pos``.

    ``h`` = ``hidden_states[layer]`` (default -1: the final representation the LM head reads),
    ``x`` = the input embeddings; the norm is the Frobenius norm of the ``d x d`` Jacobian block
    (0 where ``i > t``: causal). ``ids`` (T,) or (1, T). ``handlers`` (e.g. a :class:`MaskSink`)
    are active during the forward. ``probes=None`` is exact (``d`` vector-Jacobian products per
    query, batched ``batch`` at a time); ``probes=k`` estimates the squared norm without bias with
    ``k`` Rademacher probes (Hutchinson), ``k`` VJPs per query. Each query runs a forward over its
    prefix only (causality makes that exact). ``progress(done, total, note)``
    (:data:`~sinklab.progress.Progress`) counts queries. Returns float64
    ``(len(query_pos), len(key_pos))``.
    """
    ids = ids if ids.ndim == 2 else ids[None]  # (1, T)
    t_max = ids.shape[-1] - 1
    for name, pos in (("query_pos", query_pos), ("key_pos", key_pos)):
        if not pos or min(pos) < 0 or max(pos) > t_max:
            raise SinklabError(f"{name} must be non-empty positions in 0..{t_max}, got {pos}")
    emb = model.get_input_embeddings()(ids.to(input_device(model))).detach()  # (1, T, d)
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
                    cot = torch.zeros(k, d, dtype=h.dtype, device=h.device)
                    cot[torch.arange(k), torch.arange(s, s + k)] = 1.0
                else:
                    cot = (torch.randint(0, 2, (k, d), generator=gen) * 2 - 1).to(h)
                (g,) = torch.autograd.grad(
                    h, x, grad_outputs=cot, is_grads_batched=True, retain_graph=True
                )  # (k, 1, n, d)
                sq += g.double().pow(2).sum(dim=(0, 1, 3)).cpu()
            if probes is not None:
                sq /= float(probes)
            valid = keys <= t
            result[a, valid] = sq[keys[valid]].sqrt()
            progress(a + 1, len(query_pos), f"query {t}")
    return result
