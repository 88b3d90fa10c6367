"""Moving a cached key to another position: the plugin's RoPE re-rotation (docs/vllm.md#rope).

vLLM caches keys after RoPE. A key rotated at position ``p`` is moved to ``p'`` by rotating it
once more by ``p' - p``, because RoPE rotations in the same planes compose:
``R(p') k = R(p' - p) R(p) k``. :class:`KeyMover` does that for the rotary embedding of one of
vLLM's models, with the same arithmetic as ``sinklab.models.rotary.Rope.shift`` (angles in
float64 from the model's ``inv_freq``, then ``x * cos + rotate_half(x) * sin`` in the key's dtype),
so that the plugin and sinklab's ``SinkCache`` move a key to the same bits.

Only vLLM's neox-style layout (pairs ``(i, i + rotary_dim / 2)``, Llama's and Qwen2's) of the
plain, linear-scaled and llama3-scaled embeddings is accepted; anything else is refused, since a
wrong layout would give wrong scores silently."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sinklab_vllm.options import SinklabVllmError

# vLLM's rotary classes whose frequencies do not depend on the length
MOVABLE = ("RotaryEmbedding", "LinearScalingRotaryEmbedding", "Llama3RotaryEmbedding")


@dataclass(frozen=True)
class KeyMover:
    """A rotation by any number of positions in one model's RoPE: ``inv_freq`` (rotary_dim / 2,)
    float64, applied to the first ``rotary_dim`` dims of a ``head_size`` head."""

    inv_freq: Tensor
    rotary_dim: int
    head_size: int

    def cos_sin(self, delta: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin (S, head_size) for a rotation by ``delta`` (S,) positions: angles in
        float64, cast to ``dtype``; dims past ``rotary_dim`` get cos 1, sin 0 (left alone)."""
        ang = delta.to(torch.float64)[:, None] * self.inv_freq[None, :]
        ang = torch.cat((ang, ang), dim=-1)
        cos, sin = ang.cos(), ang.sin()
        if self.head_size > self.rotary_dim:
            pad = (0, self.head_size - self.rotary_dim)
            cos, sin = F.pad(cos, pad, value=1.0), F.pad(sin, pad, value=0.0)
        return cos.to(dtype), sin.to(dtype)

    def rotate_half(self, x: Tensor) -> Tensor:
        """(..., head_size) -> neox rotate_half over the first ``rotary_dim`` dims, zeros after."""
        r, half = self.rotary_dim, self.rotary_dim // 2
        rot = torch.cat((-x[..., half:r], x[..., :half]), dim=-1)
        return rot if r == x.shape[-1] else F.pad(rot, (0, x.shape[-1] - r))

    def move(self, keys: Tensor, delta: Tensor) -> Tensor:
        """``keys`` (S, num_kv_heads, head_size), as vLLM lays them out, each rotated by its
        ``delta`` (S,) positions: a key cached at ``p`` comes out as if rotated at ``p + delta``."""
        if keys.dim() != 3 or keys.shape[-1] != self.head_size or delta.shape != keys.shape[:1]:
            raise ValueError(
                f"keys must be (S, heads, {self.head_size}) with delta (S,), got "
                f"{tuple(keys.shape)} and {tuple(delta.shape)}"
            )
        cos, sin = self.cos_sin(delta.to(keys.device), keys.dtype)
        return self.turn(keys, cos[:, None, :], sin[:, None, :])

    def turn(self, keys: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``keys`` rotated by precomputed :meth:`cos_sin` (broadcast over the heads): the
        arithmetic of :meth:`move`, for a rotation computed once and applied in every layer."""
        return keys * cos + self.rotate_half(keys) * sin


def mover_of(rotary_emb: Any) -> KeyMover:
    """The :class:`KeyMover` of one of vLLM's rotary embeddings (a layer's ``rotary_emb``), or
    :class:`SinklabVllmError` naming why its rotation cannot be moved here."""
    name = type(rotary_emb).__name__
    if name not in MOVABLE:
        raise SinklabVllmError(
            f"sinklab: rotary embedding {name} is not supported (supported: {', '.join(MOVABLE)})"
        )
    if not rotary_emb.is_neox_style:
        raise SinklabVllmError(f"sinklab: {name} is not neox-style; only that layout is moved")
    with torch.no_grad():
        inv = rotary_emb._compute_inv_freq(rotary_emb.base)
    if name == "LinearScalingRotaryEmbedding":  # positions are divided by the factor
        factors = getattr(rotary_emb, "scaling_factors", None) or []
        if len(factors) != 1:
            raise SinklabVllmError(f"sinklab: {name} with {len(factors)} factors is not supported")
        inv = inv / float(factors[0])
    return KeyMover(
        inv_freq=inv.detach().to("cpu", torch.float64),
        rotary_dim=int(rotary_emb.rotary_dim),
        head_size=int(rotary_emb.head_size),
    )
