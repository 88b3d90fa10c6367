"""Collectors: an attention handler and decoder-layer forward hooks that only accumulate.

:class:`ProbeCapture` only observes, so each layer takes the observation path of
:mod:`sinklab.seam.observe` where it can (one fused kernel with its log-sum-exp, no weights
formed: it adds the layer's partial sums from its :class:`~sinklab.seam.observe.LayerView`), and
the block path otherwise (an intervention changes the weights, a sliding window, softcapping...):
there it adds each chunk's partial sums, never holding more than one ``(B, H, c, Tk)`` block.
Both sums are declared per metric in :mod:`sinklab.probe.spec`; the route of every layer is kept
(:attr:`ProbeCapture.routes`).
:class:`HiddenCapture` computes the per-layer hidden-state metrics from each decoder layer's output
as it is produced and keeps one float per metric and layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from sinklab.probe.spec import BY_NAME, Accumulator, Block, Rows, fused_needs, measured, names
from sinklab.seam import AttentionChunk, AttentionHandler
from sinklab.seam.observe import LayerView, Route

LayerCallback = Callable[[int], None]


class ProbeCapture(AttentionHandler):
    """Accumulate the attention metrics of every layer (batch size 1): a whole layer at once on
    the observation path, chunk by chunk on the block path.

    ``metrics``: a metric set of :data:`sinklab.probe.spec.METRIC_SETS` (``fast`` leaves out
    entropy and received attention). ``on_layer(layer)`` is called when a layer has been observed.
    """

    causal_trim = True  # copes with chunks whose key axis stops at the last visible key

    def __init__(
        self,
        n_heads: int,
        n_tokens: int,
        q0: int = 0,
        key: int = 0,
        on_layer: LayerCallback | None = None,
        metrics: str = "all",
    ) -> None:
        self.n_heads, self.n_tokens, self.q0, self.key = n_heads, n_tokens, q0, key
        self.on_layer = on_layer
        self.wanted = measured(metrics)
        self.fused_needs = fused_needs(metrics)
        self.sums: dict[int, Accumulator] = {}
        #: layer -> the path its attention took (and why not the fused one)
        self.routes: dict[int, Route] = {}

    def routed(self, layer: int, route: Route) -> None:
        self.routes[layer] = route

    def observe_layer(self, view: LayerView) -> None:
        if view.query.shape[0] != 1:
            raise ValueError("ProbeCapture expects batch size 1")
        rows = Rows(view, self.q0, self.key)
        self.sums.setdefault(view.layer, Accumulator(self.wanted)).add_rows(rows)
        if self.on_layer is not None:
            self.on_layer(view.layer)

    def observe(self, chunk: AttentionChunk) -> None:
        w = chunk.weights
        if w.shape[0] != 1:
            raise ValueError("ProbeCapture expects batch size 1")
        w = w if w.dtype in (torch.float32, torch.float64) else w.float()
        block = Block(
            weights=w,
            value=chunk.value,
            output=chunk.output,
            pos0=chunk.q_offset + chunk.q_start,  # key position of the chunk's first row
            first=chunk.q_start == 0,
            q0=self.q0,
            key=self.key,
        )
        self.sums.setdefault(chunk.layer, Accumulator(self.wanted)).add(block)
        if self.on_layer is not None and chunk.q_start + w.shape[-2] >= chunk.n_queries:
            self.on_layer(chunk.layer)

    def layer_metrics(self, layer: int) -> dict[str, Tensor]:
        """Final per-head metrics of one layer: (H,) tensors and ``received`` (H, T)."""
        return self.sums[layer].result()


class HiddenCapture:
    """Forward hooks on decoder blocks: per-layer hidden-state metrics computed on the fly."""

    def __init__(self, blocks: list[nn.Module], on_layer: LayerCallback | None = None) -> None:
        self.blocks = blocks
        self.on_layer = on_layer
        #: each declared hidden-state metric: one float per layer (NaN until the layer ran)
        self.values = {name: [float("nan")] * len(blocks) for name in names("hidden")}
        self._handles: list[RemovableHandle] = []

    def _hook(self, layer: int) -> Callable:
        def hook(module: nn.Module, args: object, output: object) -> None:
            h = output[0] if isinstance(output, tuple) else output
            h = h[0] if h.dim() == 3 else h  # (T, d)
            h = h.detach().double()  # once: every hidden metric computes in float64
            for name, values in self.values.items():
                values[layer] = BY_NAME[name].hidden(h)
            if self.on_layer is not None:
                self.on_layer(layer)

        return hook

    def __enter__(self) -> HiddenCapture:
        for i, blk in enumerate(self.blocks):
            self._handles.append(blk.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for hd in self._handles:
            hd.remove()
        self._handles.clear()
