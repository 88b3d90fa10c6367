"""Collectors: an attention handler and decoder-layer forward hooks that only accumulate.

:class:`ProbeCapture` observes every chunk of query rows the registered attention function
produces and adds the chunk's partial sums (:mod:`sinklab.probe.metrics`) into per-layer
accumulators, so the probe never holds more than one ``(B, H, c, Tk)`` block.
:class:`HiddenCapture` computes the per-layer hidden-state metrics from each decoder layer's output
as it is produced and keeps only three floats per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from sinklab.probe import metrics as M
from sinklab.seam import AttentionChunk, AttentionHandler

LayerCallback = Callable[[int], None]


@dataclass
class LayerSums:
    """Running sums and counts of one layer (shapes (H,) unless noted)."""

    sink: Tensor
    diagonal: Tensor
    prev: Tensor
    entropy: Tensor
    share_part: Tensor
    share_total: Tensor
    received: Tensor  # (H, T) float64
    received_n: Tensor  # (T,) int64
    value_norm_ratio: Tensor
    n: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("s", "d", "p", "e"), 0))

    @classmethod
    def zeros(cls, n_heads: int, n_tokens: int) -> LayerSums:
        def z() -> Tensor:
            return torch.zeros(n_heads, dtype=torch.float64)

        return cls(
            z(),
            z(),
            z(),
            z(),
            z(),
            z(),
            torch.zeros(n_heads, n_tokens, dtype=torch.float64),
            torch.zeros(n_tokens, dtype=torch.int64),
            torch.full((n_heads,), float("nan")),
        )


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
        self.sums: dict[int, LayerSums] = {}

    def observe(self, chunk: AttentionChunk) -> None:
        w = chunk.weights
        if w.shape[0] != 1:
            raise ValueError("ProbeCapture expects batch size 1")
        if chunk.layer not in self.sums:
            self.sums[chunk.layer] = LayerSums.zeros(self.n_heads, self.n_tokens)
        acc = self.sums[chunk.layer]
        pos0 = chunk.q_offset + chunk.q_start  # key position of the chunk's first row
        q0, key = self.q0, self.key
        w = w if w.dtype in (torch.float32, torch.float64) else w.float()
        if chunk.q_start == 0:
            acc.value_norm_ratio = M.value_norm_ratio(chunk.value, key)[0]
        for name, tag, fn in (
            ("sink", "s", lambda: M.sink_mass_partial(w, key, q0, pos0)),
            ("diagonal", "d", lambda: M.diagonal_partial(w, q0, pos0)),
            ("prev", "p", lambda: M.prev_token_partial(w, q0, pos0)),
            ("entropy", "e", lambda: M.entropy_partial(w, q0, pos0)),
        ):
            total, count = fn()
            getattr(acc, name).add_(total[0])
            acc.n[tag] += count
        sums, counts = M.received_partial(w, q0, pos0)
        tk = sums.shape[-1]
        acc.received[:, :tk] += sums[0]
        acc.received_n[:tk] += counts
        vnorm = torch.linalg.vector_norm(chunk.value[:, :, key].double(), dim=-1)  # (B, H)
        part, total = M.sink_output_partial(w, vnorm, chunk.output, key, q0, pos0)
        acc.share_part += part[0]
        acc.share_total += total[0]
        if self.on_layer is not None and chunk.q_start + w.shape[-2] >= chunk.n_queries:
            self.on_layer(chunk.layer)

    def layer_metrics(self, layer: int) -> dict[str, Tensor]:
        """Final per-head metrics of one layer: (H,) tensors and ``received`` (H, T)."""
        a = self.sums[layer]

        def mean(total: Tensor, n: int) -> Tensor:
            return (total / n).float() if n else torch.full_like(total, float("nan")).float()

        received = (a.received / a.received_n.clamp_min(1)).float()
        return {
            "sink_mass": mean(a.sink, a.n["s"]),
            "diagonal_mass": mean(a.diagonal, a.n["d"]),
            "prev_token_mass": mean(a.prev, a.n["p"]),
            "entropy": mean(a.entropy, a.n["e"]),
            "value_norm_ratio": a.value_norm_ratio.float(),
            "sink_output_share": (a.share_part / a.share_total).float(),
            "received": received.masked_fill(a.received_n == 0, float("nan")),
        }


def decoder_layers(model: nn.Module, n_layers: int) -> list[nn.Module] | None:
    """The model's decoder blocks in order: the ModuleList of ``n_layers`` blocks holding the
    attention modules (``layer_idx`` 0..n-1); None if there is no such list."""
    for mod in model.modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) != n_layers:
            continue
        idx = [
            next((int(m.layer_idx) for m in blk.modules() if hasattr(m, "layer_idx")), None)
            for blk in mod
        ]
        if idx == list(range(n_layers)):
            return list(mod)
    return None


class HiddenCapture:
    """Forward hooks on decoder blocks: per-layer hidden-state metrics computed on the fly."""

    def __init__(self, blocks: list[nn.Module], on_layer: LayerCallback | None = None) -> None:
        self.blocks = blocks
        self.on_layer = on_layer
        n = len(blocks)
        self.first_token_cosine = [float("nan")] * n
        self.token_similarity = [float("nan")] * n
        self.first_token_norm_ratio = [float("nan")] * n
        self._handles: list[RemovableHandle] = []

    def _hook(self, layer: int) -> Callable:
        def hook(module: nn.Module, args: object, output: object) -> None:
            h = output[0] if isinstance(output, tuple) else output
            h = h[0] if h.dim() == 3 else h  # (T, d)
            self.first_token_cosine[layer] = M.first_token_cosine(h)
            self.token_similarity[layer] = M.token_similarity(h)
            self.first_token_norm_ratio[layer] = M.first_token_norm_ratio(h)
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
