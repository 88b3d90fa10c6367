"""Collectors: an attention handler and decoder-layer forward hooks that only accumulate.

:class:`ProbeCapture` observes every chunk of query rows the registered attention function
produces and adds the chunk's partial sums (declared in :mod:`sinklab.probe.spec`) into
per-layer accumulators, so the probe never holds more than one ``(B, H, c, Tk)`` block.
:class:`HiddenCapture` computes the per-layer hidden-state metrics from each decoder layer's output
as it is produced and keeps one float per metric and layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from sinklab.probe.spec import BY_NAME, Accumulator, Block, names
from sinklab.seam import AttentionChunk, AttentionHandler

LayerCallback = Callable[[int], None]


class ProbeCapture(AttentionHandler):
    """Accumulate the attention metrics of every layer, chunk by chunk (batch size 1).

    ``on_layer(layer)`` is called when a layer's last chunk has been observed.
    """

    causal_trim = True  # copes with chunks whose key axis stops at the last visible key

    def __init__(
        self,
        n_heads: int,
        n_tokens: int,
        q0: int = 0,
        key: int = 0,
        on_layer: LayerCallback | None = None,
    ) -> None:
        self.n_heads, self.n_tokens, self.q0, self.key = n_heads, n_tokens, q0, key
        self.on_layer = on_layer
        self.sums: dict[int, Accumulator] = {}

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
        self.sums.setdefault(chunk.layer, Accumulator()).add(block)
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
