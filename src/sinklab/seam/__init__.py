"""The attention seam: one registered attention function through which sinklab sees and changes
attention.

transformers 5 dispatches attention by name (``AttentionInterface``). sinklab registers its own
function under :data:`ATTN_NAME`; :func:`sinklab_attention` switches a model to it for the span of
a ``with`` block and back afterwards (no model forward is monkeypatched). Inside, attention runs

* **fused** (SDPA, or :func:`sinklab.attention.fused_attention` for softmax1 / sink variants) when
  no handler is active on this layer: the model computes what it computes with SDPA;
* **observation path** (:mod:`~sinklab.seam.observe`) when every active handler only observes
  and can read a layer from the fused kernel's log-sum-exp (``fused_needs``; the probe): one
  fused kernel gives the output and ``lse``, handlers read the few weights they need from it, and
  no block of weights is formed (memory linear in T);
* **block path** otherwise (a handler changes weights, or the layer has softcapping, a sliding
  window, a variant without a log-sum-exp form: :func:`sinklab.seam.observe.route` says why):
  for each block of query rows it materialises the ``(B, H, c, Tk)`` weights, lets handlers
  *transform* them (interventions: mask a sink, mix in uniform attention, ...), forms the output,
  then lets handlers *observe* the final weights. Only one layer's ``c x Tk`` block exists at a
  time, never all layers' ``T x T`` matrices.

Handlers are bound to one model, applied in the order they were entered, and always removed on
exit (even on error). A module may declare its own weight function through attributes that
sinklab's lab models set: ``attention_variant`` (one of :data:`sinklab.attention.VARIANTS`) and
``sink_logit`` (``(H,)`` tensor). gpt-oss style ``s_aux`` sink logits are honoured too.

Modules: :mod:`~sinklab.seam.handlers` (the protocol: :class:`AttentionChunk`,
:class:`AttentionHandler`), :mod:`~sinklab.seam.binding` (which handlers a model's modules see),
:mod:`~sinklab.seam.blocks` (the block path), :mod:`~sinklab.seam.observe` (the observation
path and the route), :mod:`~sinklab.seam.function` (the
registered function, its fused path, and :func:`sinklab_attention`).
"""

from sinklab.seam.binding import binding_generation, bound_handlers
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
    "binding_generation",
    "bound_handlers",
    "check_supported",
    "register",
    "sinklab_attention",
    "sinklab_attention_forward",
]
