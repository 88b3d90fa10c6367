"""``SinkCache``: StreamingLLM's attention-sink KV cache on transformers 5's cache-layer API.

The cache keeps the KV of ``n_sink`` sink positions plus the ``window`` most recent ones; every
other position is evicted. Positions are **cache-relative**, as in StreamingLLM: with a cache
holding tokens [0, 1, 2, 3, 6, 7, 8], decoding token 9 scores the cached keys as if they sat at
positions 0..6 and the new token at 7.

Design: keys stay as the model rotated them; only detached sinks are re-rotated
-----------------------------------------------------------------------------------
The model applies RoPE *before* ``cache.update()``; ``generate`` computes positions itself
(the token's index in the sequence) and slices its inputs with ``get_seq_length()``. So the cache
reports the tokens **seen** (like transformers' sliding-window layer) and the model rotates token
``t`` at ``t``. A RoPE score depends only on the *difference* of query and key positions, so
cache-relative positions only need the right differences:

* the recent window is a contiguous run of the text ending just before the query: its keys,
  rotated at their own positions, already have exactly the cache-relative differences. They are
  **never touched again** (no re-rotation, no float drift from rotating the same key 20,000 times);
* the ``n_sink`` sinks sit before a gap, so each step they are rotated (from their original keys,
  angle computed in float64) to the positions just before the window: ``O(n_sink)`` work per
  step and layer instead of ``O(window)`` for "re-rotate the window on eviction" or
  "un-rotated keys, rotate on use".

Storage is a preallocated ring of ``n_sink + window + 1`` slots per layer; the extra slot takes
the incoming token, which attends to the kept positions plus itself (StreamingLLM's step). A
decode step writes one slot and rewrites the sink slots: no KV tensor is concatenated, unlike
``DynamicCache``. One query needs no mask (positions live in the keys); multi-token chunks get
the kept keys then the chunk, under the causal mask built from :meth:`SinkCache.get_mask_sizes`.

The price: the model sees positions up to the stream length, so float32 angles carry an error of
about ``position * 6e-8`` rad (1e-3 rad at 20k tokens), as in any long-context use of a model.
What cannot be moved is refused by :func:`sinklab.rotary.rope_of`, naming the reason. No padding:
one stream per batch row, all rows the same length.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from sinklab.errors import SinklabError
from sinklab.policy import CACHE_POLICIES, POLICIES, CacheConfig, kept_positions
from sinklab.rotary import rope_of, text_config

__all__ = [
    "CACHE_POLICIES",
    "POLICIES",
    "CacheConfig",
    "SinkCache",
    "SinkLayer",
    "kept_positions",
]


@dataclass
class _Step:
    """What every layer does for one forward: planned once (on layer 0), shared by all layers."""

    slot: int | None = None  # ring path (one token): the slot it is written to ...
    n_view: int = 0  # ... and the keys returned are keys[..., :n_view, :]
    gather: Tensor | None = None  # chunk path: kept slots in stream order, (L,)
    keep_after: Tensor | None = None  # chunk path: rows of cat(gathered, chunk) kept afterwards
    new_sinks: list[int] = field(default_factory=list)  # indices of new tokens that are sinks
    rewrite_idx: list[int] = field(default_factory=list)  # sinks to re-rotate ...
    rewrite_at: Tensor | slice | None = None  # ... into these slots (ring) / gathered rows (chunk)
    delta: Tensor | None = None  # ... by these many positions (S,)


class SinkLayer(CacheLayerMixin):
    """One layer's ring of ``capacity + 1`` KV slots (``keys``/``values``: (B, H_kv, slots, D));
    unbounded (``dense``) layers grow by concatenation like ``DynamicLayer``."""

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, owner: SinkCache) -> None:
        super().__init__()
        self.owner = owner
        self.sink_keys: Tensor | None = None  # (B, H_kv, S, D) as rotated at their own positions
        self.sink_half: Tensor | None = None  # rotate_half(sink_keys), precomputed

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        b, h, _, d = key_states.shape
        slots = 0 if self.owner.capacity is None else self.owner.capacity + 1
        self.keys = key_states.new_zeros(b, h, slots, d)
        self.values = value_states.new_zeros(b, h, slots, value_states.shape[-1])
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Add ``key_states``/``value_states`` (B, H_kv, q, D); return the keys and values the new
        queries attend to (kept positions, then the new ones)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        step = self.owner._step
        if step.new_sinks:
            idx = torch.tensor(step.new_sinks, device=self.device)
            new = key_states.index_select(-2, idx)
            half = self.owner.rope.rotate_half(new)
            if self.sink_keys is None or self.sink_half is None:
                self.sink_keys, self.sink_half = new, half
            else:
                self.sink_keys = torch.cat((self.sink_keys, new), -2)
                self.sink_half = torch.cat((self.sink_half, half), -2)
        if self.owner.capacity is None:  # dense
            self.keys = torch.cat((self.keys, key_states), dim=-2)
            self.values = torch.cat((self.values, value_states), dim=-2)
            return self.keys, self.values
        if (slot := step.slot) is not None:  # ring path, one token
            self.keys[:, :, slot] = key_states[:, :, 0]
            self.values[:, :, slot] = value_states[:, :, 0]
            if step.rewrite_idx:
                self._rewrite(step, self.keys)
            return self.keys[:, :, : step.n_view], self.values[:, :, : step.n_view]
        # chunk path: kept keys in stream order, then the chunk; then re-pack the ring
        assert step.gather is not None and step.keep_after is not None
        gather, keep = step.gather.to(self.device), step.keep_after.to(self.device)
        old_k = self.keys.index_select(-2, gather)
        if step.rewrite_idx:
            self._rewrite(step, old_k)
        full_k = torch.cat((old_k, key_states), dim=-2)
        full_v = torch.cat((self.values.index_select(-2, gather), value_states), dim=-2)
        n = keep.numel()
        self.keys[:, :, :n] = full_k.index_select(-2, keep)
        self.values[:, :, :n] = full_v.index_select(-2, keep)
        return full_k, full_v

    def _rewrite(self, step: _Step, target: Tensor) -> None:
        """Rotate the sinks in ``step.rewrite_idx`` from their original keys into their slots:
        ``k cos + rotate_half(k) sin``, written in place when the slots are a slice."""
        assert self.sink_keys is not None and self.sink_half is not None
        assert step.rewrite_at is not None and step.delta is not None
        idx, n = step.rewrite_idx, len(step.rewrite_idx)
        if idx == list(range(n)):
            src, half = self.sink_keys[:, :, :n], self.sink_half[:, :, :n]
        else:
            src, half = self.sink_keys[:, :, idx], self.sink_half[:, :, idx]
        cos, sin = self.owner._cast(step.delta, src.dtype, self.device, src.shape[-1])
        if isinstance(step.rewrite_at, slice):
            dst = target[:, :, step.rewrite_at]
            torch.mul(src, cos, out=dst)
            dst.addcmul_(half, sin)
        else:
            at = step.rewrite_at.to(self.device)
            target[:, :, at] = torch.addcmul(src * cos, half, sin)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_mask_sizes(query_length, 0)

    def get_seq_length(self) -> int:
        return self.owner.seen

    def get_max_length(self) -> int:
        return -1 if self.owner.capacity is None else self.owner.capacity

    def reset(self) -> None:
        self.keys = self.values = self.sink_keys = self.sink_half = None
        self.is_initialized = False

    def _map(self, fn) -> None:
        for name in ("keys", "values", "sink_keys", "sink_half"):
            if (t := getattr(self, name)) is not None:
                setattr(self, name, fn(t))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._map(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        raise SinklabError("SinkCache cannot be cropped (assisted decoding is not supported)")


class SinkCache(Cache):
    """A transformers 5 ``Cache`` keeping sinks + a recent window, at cache-relative positions.

    ``SinkCache(model, CacheConfig(policy="sink", n_sink=4, window=508))``; pass it as ``cache=``
    (or ``past_key_values=``) to ``model(...)`` or ``model.generate(...)``, and keep passing the
    same object to continue the stream (several ``generate`` calls: pass the whole conversation,
    as with any transformers cache). ``get_seq_length()`` is the number of tokens seen;
    :meth:`kept_length` is what is cached.
    """

    def __init__(self, model: Any, config: CacheConfig | None = None) -> None:
        self.config = config or CacheConfig()
        self.rope = rope_of(model)
        text_cfg = text_config(model)
        max_pos = getattr(text_cfg, "max_position_embeddings", None)
        cap = self.config.capacity
        if cap is not None and max_pos and cap >= max_pos:
            raise SinklabError(
                f"n_sink + window = {cap} is not below the model's {max_pos} max positions; "
                f"make the window smaller (at most {max_pos - 1 - self.config.n_sink})"
            )
        self.capacity = cap
        self.sinks = self.config.sinks
        self.recent = self.config.recent
        super().__init__(layers=[SinkLayer(self) for _ in range(text_cfg.num_hidden_layers)])
        self._reset_state()

    # -------------------------------------------------------------------- public read-outs
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (what ``generate`` slices its inputs with)."""
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(kv_length, kv_offset): the kept keys then the queries; kv index ``i`` sits at position
        ``seen - kept + i``, so relative distances are cache-relative."""
        kept = self.kept_length()
        return kept + query_length, self.seen - kept

    def kept_length(self) -> int:
        """Positions cached between steps (at most ``n_sink + window``)."""
        return self.seen if self.capacity is None else len(self.sink_pos) + len(self.ring)

    def kept_positions(self) -> list[int]:
        """The stream positions cached now, in stream order."""
        if self.capacity is None:
            return list(range(self.seen))
        return sorted(p for p in self.slot_pos[: self.n_used] if p >= 0)

    def relative_keys(self, layer_idx: int) -> tuple[Tensor, Tensor]:
        """Kept keys and values of a layer in stream order, keys rotated to their cache-relative
        positions 0..kept-1: (B, H_kv, kept, D) each. For inspection and tests, O(kept)."""
        layer = self.layers[layer_idx]
        if self.capacity is None:
            return layer.keys, layer.values
        order = sorted((p, s) for s, p in enumerate(self.slot_pos[: self.n_used]) if p >= 0)
        slots = torch.tensor([s for _, s in order], device=layer.device, dtype=torch.long)
        rot = {s: self.sink_rot[i] for i, s in enumerate(self.sink_slots)}
        current = torch.tensor([rot.get(s, p) for p, s in order])
        keys = layer.keys.index_select(-2, slots)
        delta = torch.arange(len(order)) - current
        return self.rope.shift(keys, delta), layer.values.index_select(-2, slots)

    # ----------------------------------------------------------------------- the step
    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        if layer_idx == 0:
            inner = kwargs.get("kwargs") or {}
            self._begin(key_states.shape[-2], inner.get("position_ids", kwargs.get("position_ids")))
        return self.layers[layer_idx].update(key_states, value_states)

    def reset(self) -> None:
        super().reset()  # each layer drops its tensors
        self._reset_state()

    def _reset_state(self) -> None:
        slots = 0 if self.capacity is None else self.capacity + 1
        self.seen = 0
        self.slot_pos: list[int] = [-1] * slots
        self.n_used = 0
        self.free: list[int] = []
        self.ring: deque[int] = deque()  # non-sink slots, oldest first
        self.sink_pos: list[int] = []
        self.sink_slots: list[int] = []
        self.sink_rot: list[int] = []  # position each sink slot is rotated at now
        self._sink_set = set(self.sinks)
        self._cast_cache: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = {}
        self._step: _Step | None = None

    def _cast(self, cs: tuple[Tensor, Tensor], dtype: torch.dtype, device: Any, dim: int):
        """The step's sink rotation (float64 angles) as cos, sin (S, dim), once per dtype."""
        key = (dtype, device, dim)
        if key not in self._cast_cache:
            cos, sin = self.rope.cos_sin(cs, dtype, dim)
            self._cast_cache[key] = (cos.to(device), sin.to(device))
        return self._cast_cache[key]

    def _begin(self, q: int, position_ids: Tensor | None) -> None:
        """Plan one forward of ``q`` new tokens for all layers (called on layer 0)."""
        t = self.seen
        if position_ids is not None and int(position_ids.reshape(-1)[0]) != t:
            raise SinklabError(
                f"the model was given positions from {int(position_ids.reshape(-1)[0])} but this "
                f"SinkCache has seen {t} tokens; pass the whole sequence (or its full attention "
                "mask) to generate, or let the model compute positions"
            )
        self._cast_cache = {}
        new_sinks = [i for i in range(q) if t + i in self._sink_set]
        if self.capacity is None:
            self._step = _Step(new_sinks=new_sinks)
            self.seen += q
            return
        n_kept = self.kept_length()
        offset = t - n_kept
        tail_min = self.slot_pos[self.ring[0]] if self.ring else t
        targets = [offset + i if p < tail_min else p for i, p in enumerate(self.sink_pos)]
        rewrite = [i for i, tg in enumerate(targets) if tg != self.sink_rot[i]]
        delta = None
        if rewrite:
            delta = torch.tensor([targets[i] - self.sink_pos[i] for i in rewrite])
        for i in rewrite:
            self.sink_rot[i] = targets[i]
        if q == 1:
            self._ring_step(t, new_sinks, rewrite, delta)
        else:
            self._chunk_step(t, q, new_sinks, rewrite, delta)
        self.seen += q

    def _ring_step(self, t, new_sinks, rewrite, delta) -> None:
        assert len(self.free) <= 1, "ring invariant: at most one free slot between steps"
        if self.free:
            slot = self.free.pop()
        else:
            slot, self.n_used = self.n_used, self.n_used + 1
        self.slot_pos[slot] = t
        if new_sinks:
            self.sink_pos.append(t)
            self.sink_slots.append(slot)
            self.sink_rot.append(t)
        else:
            self.ring.append(slot)
        slots = [self.sink_slots[i] for i in rewrite]
        where: Tensor | slice | None = torch.tensor(slots) if slots else None
        if slots and slots == list(range(slots[0], slots[0] + len(slots))):  # the usual case
            where = slice(slots[0], slots[0] + len(slots))
        self._step = _Step(slot, self.n_used, None, None, new_sinks, rewrite, where, delta)
        while len(self.ring) > self.recent:
            old = self.ring.popleft()
            self.slot_pos[old] = -1
            self.free.append(old)

    def _chunk_step(self, t, q, new_sinks, rewrite, delta) -> None:
        order = sorted((p, s) for s, p in enumerate(self.slot_pos[: self.n_used]) if p >= 0)
        positions = [p for p, _ in order] + list(range(t, t + q))
        row_of_sink = {p: r for r, (p, _) in enumerate(order)}
        rows = torch.tensor([row_of_sink[self.sink_pos[i]] for i in rewrite], dtype=torch.long)
        keep = kept_positions(t + q, self.sinks, self.recent)
        row = {p: r for r, p in enumerate(positions)}
        keep_rows = torch.tensor([row[p] for p in keep], dtype=torch.long)
        gather = torch.tensor([s for _, s in order], dtype=torch.long)
        at = rows if rewrite else None
        self._step = _Step(None, 0, gather, keep_rows, new_sinks, rewrite, at, delta)
        # the re-packed ring: slot i holds keep[i]
        self.slot_pos = keep + [-1] * (self.capacity + 1 - len(keep))
        self.n_used, self.free = len(keep), []
        rot = dict(zip(self.sink_pos, self.sink_rot, strict=True))
        self.sink_pos = [p for p in keep if p in self._sink_set]
        self.sink_slots = [i for i, p in enumerate(keep) if p in self._sink_set]
        self.sink_rot = [rot.get(p, p) for p in self.sink_pos]
        self.ring = deque(i for i, p in enumerate(keep) if p not in self._sink_set)
