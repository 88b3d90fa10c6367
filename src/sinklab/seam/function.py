"""The registered attention function (fused path without handlers; with handlers, the
observation path when they only observe, else the block path) and :func:`sinklab_attention`,
which routes a model through it for the span of a block."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sinklab.attention import FUSED_VARIANTS, causal_mask, fused_attention, repeat_kv
from sinklab.errors import SinklabError
from sinklab.models.arch import dispatches_attention
from sinklab.seam.binding import bind, bound_handlers
from sinklab.seam.blocks import attention_by_blocks
from sinklab.seam.handlers import AttentionHandler
from sinklab.seam.observe import FUSED, observe_attention, route

ATTN_NAME = "sinklab"


def _bool_mask(attention_mask: Tensor | None, tq: int, tk: int, device) -> Tensor:
    """transformers' mask (bool True=attend, or additive float) -> bool (B|1, 1, Tq, Tk)."""
    if attention_mask is None:  # sdpa-style skip: a plain causal pattern, queries at the end
        return causal_mask(tq, tk, device)[None, None]
    mask = attention_mask[..., -tk:]
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask


def _module_variant(module: nn.Module, kwargs: dict[str, Any]) -> tuple[str, Tensor | None]:
    if (s_aux := kwargs.get("s_aux")) is not None:
        return "sink", s_aux
    return getattr(module, "attention_variant", "softmax"), getattr(module, "sink_logit", None)


def _fused(query, key, value, mask, *, variant: str, sink_logit, scale: float) -> Tensor:
    """The fused path (no handler): SDPA for softmax, :func:`fused_attention` otherwise."""
    if variant == "softmax":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return fused_attention(
        query, key, value, mask=mask, variant=variant, sink_logit=sink_logit, scale=scale
    )


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
    _, h, tq, d = query.shape
    n_rep = h // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)  # (B, H, Tk, D)
    tk = key.shape[2]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    variant, sink_logit = _module_variant(module, kwargs)
    softcap = kwargs.get("softcap")
    layer = int(getattr(module, "layer_idx", -1))
    handlers = bound_handlers(module, layer)
    if not handlers and softcap is None and variant in FUSED_VARIANTS:
        mask = _bool_mask(attention_mask, tq, tk, query.device)
        out = _fused(query, key, value, mask, variant=variant, sink_logit=sink_logit, scale=scale)
        return out.transpose(1, 2).contiguous(), None
    path = route(
        handlers, variant=variant, softcap=softcap, masked=attention_mask is not None,
        sliding_window=kwargs.get("sliding_window"), tq=tq, tk=tk, device=query.device,
    )  # fmt: skip
    for handler in handlers:
        handler.routed(layer, path)
    if path.path == FUSED:  # every handler only observes: no block of weights is formed
        out = observe_attention(
            module, layer, handlers, query, key, value,
            scale=scale, variant=variant, sink_logit=sink_logit,
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    causal = attention_mask is None and tk >= tq  # queries at the end: every row sees a key
    # plain causal mask: skip the all-masked key columns if every handler copes (causal_trim)
    trim = causal and bool(handlers) and all(hd.causal_trim for hd in handlers)
    mask = None if trim else _bool_mask(attention_mask, tq, tk, query.device)
    out = attention_by_blocks(
        module, layer, handlers, query, key, value, mask,
        causal=causal, scale=scale, variant=variant, sink_logit=sink_logit, softcap=softcap,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :data:`ATTN_NAME` with transformers (idempotent)."""
    # deferred: importing sinklab does not pay transformers' start-up until a model needs it
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, sinklab_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def check_supported(model: nn.Module) -> None:
    """Raise SinklabError when a model's attention can't go through the registered function."""
    if not dispatches_attention(type(model)):  # StableLM dispatches without the flag
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
    previous = model.config._attn_implementation
    switched = previous != ATTN_NAME
    with bind(model, handlers):
        try:
            if switched:
                model.set_attn_implementation(ATTN_NAME)
            yield model
        finally:
            if switched:
                model.set_attn_implementation(previous)
