"""A naive StreamingLLM reference for any transformers decoder, independent of sinklab.stream.cache.

:class:`NaiveStreamingCache` keeps every kept token's key and value exactly as the model produced
them (rotated at the token's own stream position) and, at every step, hands the model the kept
tokens in text order followed by the new ones, each kept key rotated from its own position to its
cache-relative one by the model's own rotary module and ``apply_rotary_pos_emb``. Layers read from
the config alone:

* a NoPE layer (SmolLM3's ``no_rope_layers`` 0) gets its keys unrotated;
* a sliding layer of a hybrid model (``layer_types``) keeps the model's own last ``window - 1``
  tokens at their own positions, as transformers' sliding-window cache does;
* every other layer keeps the sinks and the ``recent`` most recent other tokens.

Evictions happen after each forward (:meth:`NaiveStreamingCache.advance`), O(kept) work per step.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def _layer_facts(config: Any) -> list[tuple[bool, int | None]]:
    """(rotary, own sliding window or None) per layer, from the config only."""
    n = config.num_hidden_layers
    flags = getattr(config, "no_rope_layers", None)
    rotary = [bool(f) for f in flags] if flags is not None else [True] * n
    types = getattr(config, "layer_types", None)
    hybrid = types is not None and "sliding_attention" in types and "full_attention" in types
    window = getattr(config, "sliding_window", None)
    sliding = [window if hybrid and t == "sliding_attention" else None for t in (types or [""] * n)]
    return list(zip(rotary, sliding, strict=True))


class _Layer(CacheLayerMixin):
    is_compileable = False

    def __init__(self, owner: NaiveStreamingCache, rotary: bool, window: int | None) -> None:
        super().__init__()
        self.owner, self.rotary, self.window = owner, rotary, window
        self.is_sliding = window is not None
        self.store: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def kept(self) -> list[int]:
        t = self.owner.seen
        if self.window is not None:
            return list(range(max(0, t - self.window + 1), t))
        return self.owner.kept

    def update(self, key_states, value_states, *args, **kwargs):
        t, q = self.owner.seen, key_states.shape[-2]
        for j in range(q):
            self.store[t + j] = (key_states[:, :, j], value_states[:, :, j])
        kept = self.kept()
        keys = [self.store[p][0] for p in kept]
        if kept and self.rotary and self.window is None:
            # kept token p goes to cache-relative r; the new tokens sit at len(kept) + j but are
            # rotated at t + j, so every distance is right when p moves to r + t - len(kept)
            stacked = torch.stack(keys, dim=2)
            delta = torch.tensor([r + t - len(kept) - p for r, p in enumerate(kept)])
            keys = list(self.owner.rotate(stacked, delta).unbind(2))
        k = torch.cat([torch.stack(keys, 2), key_states], 2) if kept else key_states
        vals = [self.store[p][1] for p in kept]
        v = torch.cat([torch.stack(vals, 2), value_states], 2) if kept else value_states
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        n = len(self.kept())
        return n + query_length, self.owner.seen - n

    def get_seq_length(self) -> int:
        return self.owner.seen

    def get_max_length(self) -> int:
        return -1


class NaiveStreamingCache(Cache):
    """``sinks`` kept forever, plus the ``recent`` most recent other tokens (None: all)."""

    def __init__(self, model: Any, sinks: set[int], recent: int | None) -> None:
        self.model, self.sinks, self.recent = model, sinks, recent
        self.seen = 0
        self.kept: list[int] = []
        cfg = model.config
        super().__init__(layers=[_Layer(self, r, w) for r, w in _layer_facts(cfg)])
        self._rotary = next(
            (m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None
        )
        self._apply = getattr(sys.modules[type(model).__module__], "apply_rotary_pos_emb", None)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``keys`` (B, H, S, D) moved by ``delta`` (S,) positions, the model's own way."""
        rot = self._rotary
        args = (keys, delta[None])
        if hasattr(rot, "full_attention_inv_freq"):  # one RoPE per layer type
            cos, sin = rot(*args, "full_attention")
            scale = getattr(rot, "full_attention_attention_scaling", 1.0)
        else:
            cos, sin = rot(*args)
            scale = getattr(rot, "attention_scaling", 1.0)
        cos, sin = cos / scale, sin / scale  # the key was scaled once already
        try:
            return self._apply(keys, keys, cos, sin)[1]
        except RuntimeError:  # partial rotary done by the attention module: rotate the slice
            r = cos.shape[-1]
            head = self._apply(keys[..., :r], keys[..., :r], cos, sin)[1]
            return torch.cat([head, keys[..., r:]], -1)

    def advance(self, q: int) -> None:
        """After a forward of ``q`` new tokens: count them, then evict."""
        ctx = self.kept + list(range(self.seen, self.seen + q))
        self.seen += q
        if self.recent is None:
            self.kept = ctx
            return
        others = [p for p in ctx if p not in self.sinks]
        drop = set(others[: max(0, len(others) - self.recent)])
        self.kept = [p for p in ctx if p not in drop]


@torch.no_grad()
def naive_logits(model, ids: list[int], sinks: set[int], recent: int | None) -> torch.Tensor:
    """Token-by-token logits (T, V) under the naive reference."""
    cache = NaiveStreamingCache(model, sinks, recent)
    out = []
    for t, tok in enumerate(ids):
        pos = torch.tensor([[t]])
        out.append(model(torch.tensor([[tok]]), cache=cache, position_ids=pos).logits[0])
        cache.advance(1)
    return torch.cat(out)
