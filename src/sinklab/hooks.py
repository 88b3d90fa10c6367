"""One registered attention function through which sinklab sees and changes attention.

transformers 5 dispatches attention by name (``AttentionInterface``). sinklab registers its own
function under :data:`ATTN_NAME`; :func:`sinklab_attention` switches a model to it for the span of
a ``with`` block and back afterwards (no model forward is monkeypatched). Inside, attention runs

* **fused** (SDPA, or :func:`sinklab.attention.fused_attention` for softmax1 / sink variants) when
  no active handler needs the weights of this layer: the model computes what it computes with SDPA;
* **chunked** otherwise: for each block of query rows it materialises the ``(B, H, c, Tk)`` weights,
  lets handlers *transform* them (interventions: mask a sink, mix in uniform attention, ...), forms
  the output, then lets handlers *observe* the final weights (the probe's metric accumulators).
  Only one layer's ``c x Tk`` block exists at a time, never all layers' ``T x T`` matrices.

Handlers are bound to one model, applied in the order they were entered, and always removed on
exit (even on error). A module may declare its own weight function through attributes that
sinklab's lab models set: ``attention_variant`` (one of :data:`sinklab.attention.VARIANTS`) and
``sink_logit`` (``(H,)`` tensor). gpt-oss style ``s_aux`` sink logits are honoured too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sinklab.attention import attention_weights, causal_mask, fused_attention, repeat_kv
from sinklab.errors import SinklabError

ATTN_NAME = "sinklab"
# Bytes one materialised weight block may take; the chunk size in query rows follows from it.
CHUNK_BYTES = 32 * 1024 * 1024


@dataclass
class AttentionChunk:
    """One block of query rows of one layer, as handlers see it.

    Shapes: ``scores``/``weights`` (B, H, c, Tk); ``mask`` bool, broadcastable to (B, H, c, Tk),
    True = may attend; ``query`` (B, H, c, D); ``key``/``value`` (B, H, Tk, D), KV heads already
    repeated to H; ``output`` (B, H, c, D), set before :meth:`AttentionHandler.observe`.
    Query row ``i`` of the chunk is query ``q_start + i`` of the call, at key position
    ``q_offset + q_start + i`` (``q_offset = Tk - Tq``: the queries are the last Tq positions).
    When every active handler sets ``causal_trim`` and the mask is plain causal, the key axis
    stops at ``q_offset + q_start + c`` (the last key a row of the chunk can see), and masked
    entries of ``scores`` hold ``-inf`` (they were masked in place, saving a copy).
    """

    layer: int
    module: nn.Module
    q_start: int
    q_offset: int
    n_queries: int  # Tq of the whole call
    query: Tensor
    key: Tensor
    value: Tensor
    scores: Tensor
    mask: Tensor
    weights: Tensor
    output: Tensor | None = None


class AttentionHandler:
    """Base class: override :meth:`transform` (change weights) and/or :meth:`observe` (read)."""

    #: layers this handler acts on; None = all
    layers: frozenset[int] | None = None
    #: opt-in: this handler copes with chunks whose keys stop at the last key a row of the chunk
    #: can see (``Tk`` of the chunk = ``q_offset + q_start + c``). Under a plain causal mask the
    #: chunked path then skips the all-masked key columns (about half the work) when every active
    #: handler opts in.
    causal_trim: bool = False

    def active(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def transform(self, chunk: AttentionChunk) -> None:
        """Replace ``chunk.weights`` (rows must stay causal: use ``chunk.mask``)."""

    def observe(self, chunk: AttentionChunk) -> None:
        """Read ``chunk.weights`` / ``chunk.output``; must not modify them."""


@dataclass
class _Binding:
    handler: AttentionHandler
    modules: frozenset[int]  # id() of every submodule of the bound model


_BINDINGS: list[_Binding] = []


def _chunk_rows(b: int, h: int, tk: int, itemsize: int) -> int:
    return max(1, CHUNK_BYTES // max(1, b * h * tk * itemsize))


def _bool_mask(attention_mask: Tensor | None, tq: int, tk: int, device) -> Tensor:
    """transformers' mask (bool True=attend, or additive float) -> bool (B|1, 1, Tq, Tk)."""
    if attention_mask is None:  # sdpa-style skip: a plain causal pattern, queries at the end
        return causal_mask(tq, tk, device)[None, None]
    mask = attention_mask[..., -tk:]
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask


@functools.lru_cache(maxsize=128)
def _causal_block(c: int, kend: int, device: torch.device) -> Tensor:
    """Causal mask of the last ``c`` queries over ``kend`` keys: bool (1, 1, c, kend), cached
    because every layer of a forward asks for the same blocks."""
    return torch.ones(c, kend, dtype=torch.bool, device=device).tril_(kend - c)[None, None]


@functools.lru_cache(maxsize=16)
def _future_block(c: int, device: torch.device) -> Tensor:
    """The keys a row of a ``c``-row causal block must not see, among its last c keys: (c, c)."""
    return torch.ones(c, c, dtype=torch.bool, device=device).triu_(1)


def _module_variant(module: nn.Module, kwargs: dict[str, Any]) -> tuple[str, Tensor | None]:
    if (s_aux := kwargs.get("s_aux")) is not None:
        return "sink", s_aux
    return getattr(module, "attention_variant", "softmax"), getattr(module, "sink_logit", None)


def sinklab_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The registered attention function: returns ``(output (B, Tq, H, D), None)``."""
    b, h, tq, d = query.shape
    n_rep = h // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)  # (B, H, Tk, D)
    tk = key.shape[2]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    variant, sink_logit = _module_variant(module, kwargs)
    softcap = kwargs.get("softcap")
    layer = int(getattr(module, "layer_idx", -1))
    mid = id(module)
    handlers = [x.handler for x in _BINDINGS if mid in x.modules and x.handler.active(layer)]
    causal = attention_mask is None and tk >= tq  # queries at the end: every row sees a key
    # plain causal mask: skip the all-masked key columns if every handler copes (causal_trim)
    trim = causal and bool(handlers) and all(hd.causal_trim for hd in handlers)
    mask = None if trim else _bool_mask(attention_mask, tq, tk, query.device)

    if not handlers and softcap is None and variant in ("softmax", "softmax1", "sink"):
        if variant == "softmax":
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
        else:
            out = fused_attention(
                query, key, value, mask=mask, variant=variant, sink_logit=sink_logit, scale=scale
            )
        return out.transpose(1, 2).contiguous(), None

    out = torch.empty_like(query)
    step = _chunk_rows(b, h, tk, 4)
    for q0 in range(0, tq, step):
        q1 = min(tq, q0 + step)
        qc = query[:, :, q0:q1]
        kend = tk - tq + q1 if trim else tk  # keys any row of this chunk can see
        kc, vc = (key[:, :, :kend], value[:, :, :kend]) if trim else (key, value)
        scores = torch.matmul(qc * scale, kc.transpose(-1, -2))  # (B, H, c, kend); scale on q
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        c = q1 - q0
        # trimmed: causal (c, kend), only the last c key columns hold masked entries
        mc = _causal_block(c, kend, query.device) if trim else mask[..., q0:q1, :]
        if variant == "softmax" and causal:  # fused softmax; no fully masked row can occur
            work = torch.promote_types(scores.dtype, torch.float32)
            if trim:  # only opted-in observers see this chunk: mask the scores in place
                masked = scores
                masked[..., kend - c :].masked_fill_(_future_block(c, query.device), float("-inf"))
            else:
                masked = scores.masked_fill(~mc, float("-inf"))
            weights = torch.softmax(masked, dim=-1, dtype=work).to(scores.dtype)
        else:
            weights = attention_weights(variant, scores, mc, sink_logit=sink_logit)
        chunk = AttentionChunk(layer, module, q0, tk - tq, tq, qc, kc, vc, scores, mc, weights)
        for handler in handlers:
            handler.transform(chunk)
        chunk.output = torch.matmul(chunk.weights.to(value.dtype), vc)  # (B, H, c, D)
        for handler in handlers:
            handler.observe(chunk)
        out[:, :, q0:q1] = chunk.output
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :data:`ATTN_NAME` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, sinklab_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")]


def check_supported(model: nn.Module) -> None:
    """Raise SinklabError when a model's attention can't go through the registered function."""
    if not getattr(type(model), "_supports_attention_backend", False):
        raise SinklabError(
            f"{type(model).__name__} does not dispatch attention through transformers' "
            "AttentionInterface, so sinklab cannot capture or change its attention; "
            "use a model with a modern transformers implementation (Llama, Mistral, Qwen2, ...)"
        )


@contextmanager
def sinklab_attention(model: nn.Module, *handlers: AttentionHandler) -> Iterator[nn.Module]:
    """Route ``model``'s attention through sinklab with ``handlers`` active; restore on exit.

    Nested blocks compose: handlers of an outer block stay active inside an inner one, and run
    before the inner block's handlers.
    """
    register()
    check_supported(model)
    config = model.config
    previous = config._attn_implementation
    modules = frozenset(id(m) for m in model.modules())
    bindings = [_Binding(hd, modules) for hd in handlers]
    _BINDINGS.extend(bindings)
    switched = previous != ATTN_NAME
    try:
        if switched:
            model.set_attn_implementation(ATTN_NAME)
        yield model
    finally:
        for bd in bindings:
            _BINDINGS.remove(bd)
        if switched:
            model.set_attn_implementation(previous)
