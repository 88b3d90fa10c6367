"""The handler protocol: what a handler sees of one block of query rows, and what it may do."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn


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
    #: block path then skips the all-masked key columns (about half the work) when every active
    #: handler opts in.
    causal_trim: bool = False

    def active(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def transform(self, chunk: AttentionChunk) -> None:
        """Replace ``chunk.weights`` (rows must stay causal: use ``chunk.mask``)."""

    def observe(self, chunk: AttentionChunk) -> None:
        """Read ``chunk.weights`` / ``chunk.output``; must not modify them."""
