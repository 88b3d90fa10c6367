"""Attention as pure tensor functions: scores, masks, weight variants, reference and fused paths.

Shape glossary (every function below uses it):
- ``q``: ``(B, H, Tq, D)``; ``k``, ``v``: ``(B, Hkv, Tk, D)`` with ``H % Hkv == 0`` (GQA when
  ``Hkv < H``; query head ``h`` reads key/value head ``h // (H // Hkv)``).
- scores and weights: ``(B, H, Tq, Tk)``; ``weights[b, h, i, j]`` is the attention mass that query
  ``i`` gives key ``j``.
- query ``i`` sits at absolute position ``Tk - Tq + i`` (the queries are the *last* ``Tq``
  positions): one code path for prefill (``Tq == Tk``) and decoding with a cache (``Tq < Tk``).
- boolean masks: ``True`` = may attend; any shape that broadcasts to ``(B, H, Tq, Tk)``.

Weight variants (``VARIANTS``): ``softmax``; ``softmax1`` (an invisible extra slot with logit 0, so
rows may sum to less than 1: docs/science.md#softmax-plus-one); ``sink`` (the same slot with a
learned logit per head, gpt-oss style); ``clipped`` (Bondarenko et al. 2023); ``sigmoid``
(unnormalised, Gu et al. 2025); ``relu`` (``relu(s) / n_keys``, Guo et al. 2024: weights are
unbounded above, rows need not sum to 1). Every weight function computes in float32 (float64
stays float64), returns the scores' dtype, gives exact zeros on a fully masked row and stays finite
for scores of +-1e4 in float32/16/bfloat16.
This module knows nothing about models or files.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from sinklab.errors import SinklabError

VARIANTS = ("softmax", "softmax1", "sink", "clipped", "sigmoid", "relu")
# Variants that fused_attention runs through SDPA's fused kernels; the others fall back.
FUSED_VARIANTS = ("softmax", "softmax1", "sink")


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Repeat key/value heads for grouped-query attention.

    ``x``: ``(B, Hkv, T, D)`` -> ``(B, Hkv * n_rep, T, D)``; output head ``h`` is input head
    ``h // n_rep`` (the transformers / SDPA ``enable_gqa`` convention).
    """
    if n_rep < 1:
        raise SinklabError(f"n_rep must be >= 1, got {n_rep}; pass query heads // key heads.")
    if n_rep == 1:
        return x
    b, hkv, t, d = x.shape
    x = x[:, :, None].expand(b, hkv, n_rep, t, d)  # (B, Hkv, n_rep, T, D)
    return x.reshape(b, hkv * n_rep, t, d)  # (B, Hkv * n_rep, T, D)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor | None = None) -> int:
    """Validate shapes and return ``n_rep = H // Hkv``."""
    shapes = [tuple(t.shape) for t in ((q, k) if v is None else (q, k, v))]
    if any(len(shape) != 4 for shape in shapes):
        raise SinklabError(f"q, k, v must be 4-D (B, H, T, D), got {shapes}.")
    if k.shape[-1] != q.shape[-1]:
        raise SinklabError(f"q and k head dims differ ({q.shape[-1]} vs {k.shape[-1]}).")
    if v is not None and (v.shape[:3] != k.shape[:3]):
        raise SinklabError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree on (B, H, T).")
    h, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or h % hkv:
        raise SinklabError(f"query heads ({h}) must be a multiple of key/value heads ({hkv}).")
    return h // hkv


def scaled_scores(q: Tensor, k: Tensor, scale: float | None = None) -> Tensor:
    """Attention logits ``scale * q @ k^T``: ``(B, H, Tq, D), (B, Hkv, Tk, D) -> (B, H, Tq, Tk)``.

    ``scale`` defaults to ``1 / sqrt(D)``; key heads are repeated when ``Hkv < H``.
    """
    n_rep = _check_qkv(q, k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return (q @ repeat_kv(k, n_rep).transpose(-2, -1)) * scale  # (B, H, Tq, Tk)


def _rel_pos(tq: int, tk: int, device: torch.device | str | None) -> Tensor:
    """``query_pos - key_pos`` for every pair: ``(tq, tk)``, query ``i`` at ``tk - tq + i``."""
    if tq < 0 or tk < 0:
        raise SinklabError(f"mask sizes must be >= 0, got tq={tq}, tk={tk}.")
    query_pos = torch.arange(tq, device=device) + (tk - tq)
    key_pos = torch.arange(tk, device=device)
    return query_pos[:, None] - key_pos[None, :]  # (tq, tk)


def causal_mask(tq: int, tk: int, device: torch.device | str | None = None) -> Tensor:
    """Bool ``(tq, tk)``: query ``i`` (at ``tk - tq + i``) may see keys at positions ``<=`` its own.

    With ``tq > tk`` the first ``tq - tk`` rows are fully masked.
    """
    return _rel_pos(tq, tk, device) >= 0


def window_mask(tq: int, tk: int, window: int, device: torch.device | str | None = None) -> Tensor:
    """Bool ``(tq, tk)``: causal and the key is among the ``window`` most recent positions
    (the query's own position included), i.e. ``0 <= query_pos - key_pos < window``."""
    if window < 1:
        raise SinklabError(f"window must be >= 1, got {window}; it counts the query itself.")
    rel = _rel_pos(tq, tk, device)
    return (rel >= 0) & (rel < window)


def sink_window_mask(
    tq: int, tk: int, n_sink: int, window: int, device: torch.device | str | None = None
) -> Tensor:
    """Bool ``(tq, tk)``: StreamingLLM's pattern, ``window_mask`` OR key position ``< n_sink``,
    still causal (a sink key after the query stays hidden)."""
    if n_sink < 0:
        raise SinklabError(f"n_sink must be >= 0, got {n_sink}.")
    rel = _rel_pos(tq, tk, device)
    is_sink = torch.arange(tk, device=device)[None, :] < n_sink  # (1, tk)
    return window_mask(tq, tk, window, device) | (is_sink & (rel >= 0))


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def _per_head(value: Tensor | float, scores: Tensor, name: str) -> Tensor:
    """A scalar or per-head ``(H,)`` parameter as a tensor broadcastable to ``(B, H, Tq, Tk)``."""
    dtype = _work_dtype(scores.dtype)
    t = torch.as_tensor(value, device=scores.device).to(dtype)  # differentiable for tensors
    if t.ndim == 1:
        if scores.ndim < 3 or t.shape[0] != scores.shape[-3]:
            raise SinklabError(
                f"{name} has {t.shape[0]} entries but the scores {tuple(scores.shape)} have "
                f"{scores.shape[-3] if scores.ndim >= 3 else 'no'} heads; pass one per head."
            )
        return t.view(-1, 1, 1)  # (H, 1, 1)
    return t


def _check_mask(mask: Tensor | None) -> None:
    if mask is not None and mask.dtype != torch.bool:
        raise SinklabError(f"masks must be bool (True = may attend), got {mask.dtype}.")


def _exp_normalise(scores: Tensor, mask: Tensor | None, extra_logit: Tensor | None) -> Tensor:
    """Stable ``exp(s_j) / (exp(extra) + sum_k exp(s_k))`` over allowed keys, in work precision.

    Without ``extra_logit`` this is softmax. The row maximum includes the extra slot and is
    detached (the result does not depend on it); a fully masked row gives zeros, never NaN.
    """
    _check_mask(mask)
    s = scores.to(_work_dtype(scores.dtype))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)  # (B, H, Tq, 1)
    if extra_logit is not None:
        m = torch.maximum(m, extra_logit)
    m = m.detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    if extra_logit is not None:
        denom = denom + torch.exp(extra_logit - m)
    return e / denom.clamp_min(torch.finfo(e.dtype).tiny)


def softmax(scores: Tensor, mask: Tensor | None = None) -> Tensor:
    """Softmax over keys: ``(B, H, Tq, Tk) -> (B, H, Tq, Tk)``; fully masked rows are zeros."""
    return _exp_normalise(scores, mask, None).to(scores.dtype)


def sink_softmax(
    scores: Tensor, mask: Tensor | None = None, sink_logit: Tensor | float = 0.0
) -> Tensor:
    """Softmax with an invisible extra slot of logit ``sink_logit`` (scalar or ``(H,)``).

    ``w_j = exp(s_j) / (exp(sink_logit) + sum_k exp(s_k))``: ``(B, H, Tq, Tk) -> (B, H, Tq, Tk)``.
    Rows are positive and sum to less than 1 (in floating point they round to 1 once the largest
    score exceeds ``sink_logit`` by about 17 in float32); a fully masked row is all zeros.
    """
    extra = _per_head(sink_logit, scores, "sink_logit")
    return _exp_normalise(scores, mask, extra).to(scores.dtype)


def softmax1(scores: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax + 1 ("attention is off by one"): ``exp(s_j) / (1 + sum_k exp(s_k))``.

    ``(B, H, Tq, Tk) -> (B, H, Tq, Tk)``; equals ``sink_softmax(..., sink_logit=0.0)``.
    """
    return sink_softmax(scores, mask, 0.0)


def clipped_softmax(
    scores: Tensor, mask: Tensor | None = None, zeta: float = 1.0, gamma: float = -0.03
) -> Tensor:
    """Clipped softmax (Bondarenko et al. 2023): ``clip((zeta - gamma) * softmax + gamma, 0, 1)``.

    ``(B, H, Tq, Tk) -> (B, H, Tq, Tk)``; ``gamma <= 0`` lets a weight reach exactly 0,
    ``zeta >= 1`` exactly 1. Masked entries are 0.
    """
    if not (gamma <= 0.0 and zeta >= 1.0):
        raise SinklabError(f"clipped softmax needs gamma <= 0 <= 1 <= zeta, got {gamma=}, {zeta=}.")
    p = _exp_normalise(scores, mask, None)
    w = ((zeta - gamma) * p + gamma).clamp(0.0, 1.0)
    if mask is not None:
        w = w.masked_fill(~mask, 0.0)
    return w.to(scores.dtype)


def sigmoid_attention(
    scores: Tensor, mask: Tensor | None = None, bias: Tensor | float = 0.0
) -> Tensor:
    """Unnormalised sigmoid weights ``sigmoid(s + bias)``, masked entries 0 (Gu et al. 2025).

    ``(B, H, Tq, Tk) -> (B, H, Tq, Tk)``; ``bias`` is a scalar or one value per head ``(H,)``
    (a common choice is ``-log(Tk)``). Rows need not sum to 1, so no sink is needed.
    """
    _check_mask(mask)
    s = scores.to(_work_dtype(scores.dtype))
    w = torch.sigmoid(s + _per_head(bias, scores, "sigmoid bias"))
    if mask is not None:
        w = w.masked_fill(~mask, 0.0)
    return w.to(scores.dtype)


def relu_attention(scores: Tensor, mask: Tensor | None = None) -> Tensor:
    """ReLU attention normalised by the number of keys (Guo et al. 2024, arXiv 2410.13835).

    ``w_ij = relu(s_ij) / n_i`` with ``n_i`` the number of keys query ``i`` may attend to:
    ``(B, H, Tq, Tk) -> (B, H, Tq, Tk)``. Masked entries and fully masked rows are 0. Weights are
    not bounded by 1 and rows need not sum to 1: a head "does nothing" with all scores <= 0.
    """
    _check_mask(mask)
    s = scores.to(_work_dtype(scores.dtype))
    if mask is None:
        n = torch.full_like(s[..., :1], float(s.shape[-1]))
        w = torch.relu(s)
    else:
        w = torch.relu(s).masked_fill(~mask, 0.0)
        n = torch.broadcast_to(mask, s.shape).sum(dim=-1, keepdim=True).to(s.dtype)
    w = w / n.clamp_min(1.0)
    if scores.dtype in (torch.float16, torch.bfloat16):  # keep a huge score finite when cast
        w = w.clamp_max(torch.finfo(scores.dtype).max)
    return w.to(scores.dtype)


def output_gate(out: Tensor, gate_logits: Tensor) -> Tensor:
    """Gated attention output ``out * sigmoid(gate_logits)``.

    ``out``: ``(B, H, Tq, D)``; ``gate_logits``: ``(B, H, Tq)`` (one gate per head and query,
    broadcast over ``D``) or anything 4-D that broadcasts to ``out`` (e.g. ``(B, H, Tq, D)``
    for elementwise gates). Returns ``(B, H, Tq, D)`` in ``out``'s dtype.
    """
    g = gate_logits if gate_logits.ndim == out.ndim else gate_logits.unsqueeze(-1)
    gate = torch.sigmoid(g.to(_work_dtype(out.dtype)))
    return (out.to(gate.dtype) * gate).to(out.dtype)


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise SinklabError(
            f"unknown attention variant {variant!r}; use one of: {', '.join(VARIANTS)}."
        )


def attention_weights(
    variant: str,
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    sink_logit: Tensor | float | None = None,
    sigmoid_bias: Tensor | float = 0.0,
) -> Tensor:
    """Dispatch to a weight variant: ``(B, H, Tq, Tk) -> (B, H, Tq, Tk)``.

    ``sink_logit`` is read by ``"sink"`` only (``None`` means 0, i.e. softmax1), ``sigmoid_bias``
    by ``"sigmoid"`` only; other variants ignore them. ``"clipped"`` uses the default zeta/gamma
    (call ``clipped_softmax`` for others).
    """
    _check_variant(variant)
    if variant == "sink":
        return sink_softmax(scores, mask, 0.0 if sink_logit is None else sink_logit)
    if variant == "sigmoid":
        return sigmoid_attention(scores, mask, sigmoid_bias)
    if variant == "clipped":
        return clipped_softmax(scores, mask)
    if variant == "relu":
        return relu_attention(scores, mask)
    return softmax1(scores, mask) if variant == "softmax1" else softmax(scores, mask)


def _combined_mask(
    mask: Tensor | None, is_causal: bool, tq: int, tk: int, device: torch.device
) -> Tensor | None:
    """``mask AND causal_mask`` (either may be absent); broadcastable to ``(B, H, tq, tk)``."""
    _check_mask(mask)
    if not is_causal:
        return mask
    causal = causal_mask(tq, tk, device)
    return causal if mask is None else mask & causal


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    is_causal: bool = False,
    variant: str = "softmax",
    sink_logit: Tensor | float | None = None,
    scale: float | None = None,
    gate_logits: Tensor | None = None,
    sigmoid_bias: Tensor | float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Materialised attention: returns ``(out (B, H, Tq, D), weights (B, H, Tq, Tk))``.

    ``mask`` and ``is_causal`` combine with AND (causal = bottom-right aligned, see the module
    docstring); key/value heads are repeated for GQA; ``gate_logits`` (see ``output_gate``)
    gates the output after the value mix. Costs O(Tq * Tk) memory per head.
    """
    _check_variant(variant)
    n_rep = _check_qkv(q, k, v)
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, Tk, D)
    scores = scaled_scores(q, k, scale)  # (B, H, Tq, Tk)
    full = _combined_mask(mask, is_causal, q.shape[-2], k.shape[-2], q.device)
    weights = attention_weights(
        variant, scores, full, sink_logit=sink_logit, sigmoid_bias=sigmoid_bias
    )
    out = weights @ v  # (B, H, Tq, D)
    if gate_logits is not None:
        out = output_gate(out, gate_logits)
    return out, weights


def _zero_padded(x: Tensor, width: int, before: int, after: int) -> Tensor:
    """``(B, H, T, D) -> (B, H, before + T + after, width)``, new entries 0. Like ``F.pad`` but
    one full-size pass (a copy) instead of two (fill, then copy): half the memory traffic."""
    b, h, t, d = x.shape
    out = x.new_empty(b, h, before + t + after, width)
    out[:, :, :before].zero_()
    out[:, :, before + t :].zero_()
    out[:, :, before : before + t, d:].zero_()
    out[:, :, before : before + t, :d] = x  # differentiable copy
    return out


def _with_sink_key(
    q: Tensor, k: Tensor, v: Tensor, sink_logit: Tensor | float, scale: float, prepend: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Add one key with value 0 whose logit is ``sink_logit`` (per query head) for every query.

    Logit 0 needs only a zero key. Otherwise ``p`` head dims are added: queries carry
    ``sink_logit[h] / scale`` in the first, real keys 0 and the sink key 1, so the sink logit is
    exact up to one rounding and real logits are unchanged, at O(T * D) cost. In a half type
    (bfloat16 keeps 8 bits) that one rounding would move the logit by up to 0.4 % (0.01 for a
    logit of 3): ``sink_logit / scale`` is computed in float32 and carried as two half numbers,
    ``hi + lo`` (two dims, the sink key 1 in both), which the kernels add in float32, so the sink
    logit is the float32 one to about 2^-16, as the block path's (it upcasts it). An additive float
    mask column would be q-independent too, but must be materialised as ``(B, H, Tq, Tk + 1)``
    and excludes ``is_causal``, which loses SDPA's fastest kernel (an explicit causal mask was
    1.6x slower at T=2048 on CPU).
    ``prepend``: sink key first plus a dummy query row 0 (drop it afterwards), so SDPA's top-left
    ``is_causal`` lets query ``i`` see the sink and keys ``0..i``; else the sink key goes last.
    Returns q ``(B, H, Tq (+1), D + p)``, k/v ``(B, Hkv, Tk + 1, D + p)``.
    """
    d, tk, dv = q.shape[-1], k.shape[-2], v.shape[-1]
    zero = not isinstance(sink_logit, Tensor) and float(sink_logit) == 0.0
    split = q.dtype in (torch.bfloat16, torch.float16)  # the logit as hi + lo (docstring)
    need = 0 if zero else 2 if split else 1  # head dims for the sink logit
    # accelerator kernels want D % 8 == 0
    p = need if q.device.type == "cpu" or zero else need + (-(max(d, dv) + need)) % 8
    width = max(d, dv) + p
    rows = (1, 0) if prepend else (0, 1)  # zero rows (before, after) along T for k and v
    sink = 0 if prepend else tk  # the sink key's row
    # equal q/k/v head dims keep the fused kernel
    q2 = _zero_padded(q, width, rows[0], 0)  # (B, H, Tq (+1), D + p), dummy query row 0
    k2 = _zero_padded(k, width, *rows)  # (B, Hkv, Tk + 1, D + p), sink key of zeros so far
    v2 = _zero_padded(v, width, *rows)  # (B, Hkv, Tk + 1, D + p), the sink's value is 0
    if not zero:
        work = torch.promote_types(q.dtype, torch.float32)
        lam = torch.as_tensor(sink_logit, device=q.device).to(work)  # differentiable
        # +-1e3 is beyond float32 exp range: same weights, and no inf * 0 = NaN in q @ k^T
        lam = lam.clamp(-1e3, 1e3)
        lam = lam.view(1, -1, 1) if lam.ndim == 1 else lam  # (1, H, 1) or scalar
        x = lam / scale
        hi = x.to(q.dtype)
        parts = (hi, (x - hi.to(work)).to(q.dtype)) if split else (hi,)  # hi + lo = x
        for i, part in enumerate(parts):
            q2[:, :, rows[0] :, max(d, dv) + i] = part
            k2[:, :, sink, max(d, dv) + i] = 1.0
    return q2, k2, v2


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    is_causal: bool = False,
    variant: str = "softmax",
    sink_logit: Tensor | float | None = None,
    scale: float | None = None,
    gate_logits: Tensor | None = None,
    sigmoid_bias: Tensor | float = 0.0,
) -> Tensor:
    """Attention output ``(B, H, Tq, D)`` through ``F.scaled_dot_product_attention``, without
    materialising the ``Tq x Tk`` weights; same semantics as ``reference_attention``.

    softmax1 and sink add one zero-value key whose logit is the sink logit (``_with_sink_key``).
    The fastest path is ``is_causal`` with ``Tq == Tk`` and no mask; other cases pass an explicit
    bool mask of ``(Tq, Tk)`` (``Tq < Tk``: decoding). ``clipped`` and ``sigmoid`` have no fused
    form (nor does ``relu``) and fall back to ``reference_attention`` (materialised weights,
    O(Tq * Tk) memory).
    """
    _check_variant(variant)
    if variant not in FUSED_VARIANTS:  # no fused form: materialise the weights
        kw = {"mask": mask, "is_causal": is_causal, "scale": scale, "gate_logits": gate_logits}
        return reference_attention(q, k, v, variant=variant, sigmoid_bias=sigmoid_bias, **kw)[0]
    n_rep = _check_qkv(q, k, v)
    tq, tk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    simple_causal = is_causal and mask is None and tq == tk
    full = None if simple_causal else _combined_mask(mask, is_causal, tq, tk, q.device)
    if variant != "softmax":
        lam = 0.0 if variant == "softmax1" or sink_logit is None else sink_logit
        q, k, v = _with_sink_key(q, k, v, lam, scale, prepend=simple_causal)
        if full is not None:  # the sink key (last) is visible to every query
            full = torch.broadcast_to(full, (*full.shape[:-2], tq, tk))
            full = torch.cat([full, full.new_ones(*full.shape[:-1], 1)], dim=-1)  # (.., Tq, Tk+1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=full, is_causal=simple_causal, scale=scale, enable_gqa=n_rep > 1
    )
    if simple_causal and variant != "softmax":
        out = out[:, :, 1:]  # drop the dummy query row: (B, H, Tq, D + p)
    out = out[..., :dv]  # (B, H, Tq, D)
    if variant == "softmax" and full is not None:  # fully masked rows: zeros, not NaN, any backend
        out = out.masked_fill(~full.any(dim=-1, keepdim=True), 0.0)
    if gate_logits is not None:
        out = output_gate(out, gate_logits)
    return out
