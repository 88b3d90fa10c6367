"""The attention seam: one registered attention function through which sinklab sees and changes
attention.

transformers 5 dispatches attention by name (``AttentionInterface``). sinklab registers its own
function under :data:`ATTN_NAME`; :func:`sinklab_attention` switches a model to it for the span of
a ``with`` block and back afterwards (no model forward is monkeypatched). Inside, attention runs

* **fused** (SDPA, or :func:`sinklab.attention.fused_attention` for softmax1 / sink variants) when
  no active handler needs the weights of this layer: the model computes what it computes with SDPA;
* **block path** otherwise: for each block of query rows it materialises the ``(B, H, c, Tk)``
  weights,
  lets handlers *transform* them (interventions: mask a sink, mix in uniform attention, ...), forms
  the output, then lets handlers *observe* the final weights (the probe's metric accumulators).
  Only one layer's ``c x Tk`` block exists at a time, never all layers' ``T x T`` matrices.

Handlers are bound to one model, applied in the order they were entered, and always removed on
exit (even on error). A module may declare its own weight function through attributes that
sinklab's lab models set: ``attention_variant`` (one of :data:`sinklab.attention.VARIANTS`) and
``sink_logit`` (``(H,)`` tensor). gpt-oss style ``s_aux`` sink logits are honoured too.

Modules: :mod:`~sinklab.seam.handlers` (the protocol: :class:`AttentionChunk`,
:class:`AttentionHandler`), :mod:`~sinklab.seam.binding` (which handlers a model's modules see),
:mod:`~sinklab.seam.blocks` (the block path), :mod:`~sinklab.seam.function` (the
registered function, its fused path, and :func:`sinklab_attention`).
"""

from sinklab.seam.binding import bound_handlers
from sinklab.seam.function import (
    ATTN_NAME,
    check_supported,
    register,
    sinklab_attention,
    sinklab_attention_forward,
)
from sinklab.seam.handlers import AttentionChunk, AttentionHandler

__all__ = [
    "ATTN_NAME",
    "AttentionChunk",
    "AttentionHandler",
    "bound_handlers",
    "check_supported",
    "register",
    "sinklab_attention",
    "sinklab_attention_forward",
]
