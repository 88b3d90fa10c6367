"""The handler protocol: what a handler sees of one block of query rows, and what it may do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor, nn

if TYPE_CHECKING:
    from sinklab.seam.observe import LayerView, Route


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
    """Base class: override :meth:`transform` (change weights) and/or :meth:`observe` (read);
    a handler that can read a layer from its log-sum-exp also sets :attr:`fused_needs` and
    overrides :meth:`observe_layer` (the observation path, :mod:`sinklab.seam.observe`)."""

    #: layers this handler acts on; None = all
    layers: frozenset[int] | None = None
    #: opt-in: this handler copes with chunks whose keys stop at the last key a row of the chunk
    #: can see (``Tk`` of the chunk = ``q_offset + q_start + c``). Under a plain causal mask the
    #: block path then skips the all-masked key columns (about half the work) when every active
    #: handler opts in.
    causal_trim: bool = False
    #: opt-in: this handler only observes and can read a layer from a
    #: :class:`~sinklab.seam.observe.LayerView` (no weights); the set names what it reads beyond
    #: a few columns (:data:`sinklab.seam.observe.NEEDS`). None: it needs the block path. A layer
    #: takes the observation path only when every active handler opts in.
    fused_needs: frozenset[str] | None = None

    def active(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def transform(self, chunk: AttentionChunk) -> None:
        """Replace ``chunk.weights`` (rows must stay causal: use ``chunk.mask``)."""

    def observe(self, chunk: AttentionChunk) -> None:
        """Read ``chunk.weights`` / ``chunk.output``; must not modify them."""

    def observe_layer(self, view: LayerView) -> None:
        """Read one whole layer on the observation path (only when :attr:`fused_needs` is set)."""
        raise NotImplementedError(f"{type(self).__name__} sets fused_needs but reads no layer")

    def slot_order_reason(self, fixed: frozenset[int]) -> str | None:
        """Why this handler cannot run on keys held out of text order, or None when it can.

        A StreamingLLM cache (:class:`sinklab.stream.SinkCache`) writes its window in ring order,
        so a key index means a stream position only for the sinks that sit at their own slot
        (``fixed``). A handler whose weights depend on which key is which beyond those (a
        position to mask, each query's own key) says why here, and the cache refuses it."""
        return None

    def routed(self, layer: int, route: Route) -> None:
        """Told which path ``layer``'s attention takes (before it runs)."""
