"""The tensor side of :class:`~sinklab.stream.cache.SinkCache`: one layer's KV slots
(:class:`SinkLayer`, and :class:`SlidingLayer`, a hybrid model's own window) and a forward's plan
as index tensors (:class:`Step`), shared by every layer. What to write where is decided in
:mod:`sinklab.stream.slots`; here it is done, batched over the rows.

Each layer owns its tensors, as transformers' own layers do: it is built with what it needs
(capacity, number of sinks, the rotation), is handed each forward's :class:`Step`, and moves its
own keys (:meth:`SinkLayer.rebase`); the cache plans and never touches a layer's tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer

from sinklab.errors import SinklabError
from sinklab.stream.slots import Plan


class Step:
    """A :class:`~sinklab.stream.slots.Plan` as index tensors, built once per forward (layer 0)."""

    def __init__(self, plan: Plan, rope: Any) -> None:
        self.plan, self.rope = plan, rope
        b = len(plan.real)
        self.slot: int | None = None
        self.slots: Tensor | None = None
        if plan.slots is not None:
            if len(set(plan.slots)) == 1:
                self.slot = plan.slots[0]
            else:
                self.slots = torch.tensor(plan.slots)
        self.rows = torch.arange(b)
        if plan.gather is not None:
            self.gather = torch.tensor(plan.gather, dtype=torch.long).reshape(b, -1)
            self.keep = torch.tensor(plan.keep, dtype=torch.long).reshape(b, -1)
            self.keep_valid = torch.tensor(plan.keep_valid, dtype=torch.bool).reshape(b, -1)
        cap = plan.captures
        self.cap = (
            [torch.tensor(x, dtype=torch.long) for x in zip(*cap, strict=True)] if cap else []
        )
        self._cs: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = {}
        # rewrites: shared by every row (lockstep streams, B = 1) -> broadcast, else per row
        rw = plan.rewrites
        self.rw_shared: list[tuple[int, int, int]] | None = None
        if rw:
            per_row = [[(i, d, k) for r, i, d, k in rw if r == row] for row in range(b)]
            if all(p == per_row[0] for p in per_row):
                self.rw_shared = per_row[0]
                idx, dst, delta = zip(*per_row[0], strict=True)
                self.rw_i, self.rw_dst = list(idx), list(dst)
            else:
                r, idx, dst, delta = zip(*rw, strict=True)
                self.rw_b, self.rw_i = torch.tensor(r), torch.tensor(idx)
                self.rw_dst = torch.tensor(dst)
            self.delta = torch.tensor(delta)

    def cos_sin(self, dtype: torch.dtype, device: Any, dim: int) -> tuple[Tensor, Tensor]:
        """The sinks' rotation (float64 angles) as cos, sin (N, dim), once per dtype."""
        key = (dtype, device, dim)
        if key not in self._cs:
            cos, sin = self.rope.cos_sin(self.delta, dtype, dim)
            self._cs[key] = (cos.to(device), sin.to(device))
        return self._cs[key]


class SinkLayer(CacheLayerMixin):
    """One layer's ring of ``capacity + 1`` KV slots per row (``keys``/``values``:
    (B, H_kv, slots, D)); unbounded (``dense``) layers grow by concatenation like ``DynamicLayer``.
    ``sink_keys`` (B, H_kv, n_sinks, D): each sink's key as the model rotated it when read."""

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(
        self, capacity: int | None, n_sinks: int, rope: Any = None, rotary: bool = True
    ) -> None:
        super().__init__()
        self.capacity = capacity  # None: dense (unbounded)
        self.n_sinks = n_sinks
        self.rope = rope  # sinklab.models.rotary's rotation (None: nothing is ever rotated)
        self.rotary = rotary  # False: a NoPE layer (SmolLM3), whose keys are never re-rotated
        self.seen = 0  # columns read
        self.sink_keys: Tensor | None = None
        self.sink_half: Tensor | None = None  # rotate_half(sink_keys), precomputed

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        b, h, _, d = key_states.shape
        slots = 0 if self.capacity is None else self.capacity + 1
        self.keys = key_states.new_zeros(b, h, slots, d)
        self.values = value_states.new_zeros(b, h, slots, value_states.shape[-1])
        self.sink_keys = key_states.new_zeros(b, h, self.n_sinks, d)
        self.sink_half = torch.zeros_like(self.sink_keys)
        self.is_initialized = True

    def update(
        self,
        key_states: Tensor,
        value_states: Tensor,
        cache_kwargs: Any = None,
        *,
        step: Step | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Add ``key_states``/``value_states`` (B, H_kv, q, D) as this forward's ``step`` plans;
        return the keys and values the new queries attend to (kept positions, then the new
        ones)."""
        if step is None:
            raise SinklabError("a SinkLayer is updated by its SinkCache, which passes the step")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.sink_keys is not None and self.sink_half is not None
        self.seen += key_states.shape[-2]
        dev = self.device
        if step.cap:  # sinks read now: keep their keys as rotated at their own positions
            rows, idx, col = (t.to(dev) for t in step.cap)
            new = key_states[rows, :, col]  # (N, H_kv, D)
            self.sink_keys[rows, :, idx] = new
            if self.rotary:
                self.sink_half[rows, :, idx] = self.rope.rotate_half(new)
        if self.capacity is None:  # dense
            self.keys = torch.cat((self.keys, key_states), dim=-2)
            self.values = torch.cat((self.values, value_states), dim=-2)
            return self.keys, self.values
        plan = step.plan
        if plan.slots is not None:  # ring path, one token per row
            if step.slot is not None:
                self.keys[:, :, step.slot] = key_states[:, :, 0]
                self.values[:, :, step.slot] = value_states[:, :, 0]
            else:
                rows, slots = step.rows.to(dev), step.slots.to(dev)  # type: ignore[union-attr]
                self.keys[rows, :, slots] = key_states[:, :, 0]
                self.values[rows, :, slots] = value_states[:, :, 0]
            if plan.rewrites and self.rotary:
                self._rewrite(step, self.keys)
            n = plan.kv_len
            return self.keys[:, :, :n], self.values[:, :, :n]
        # columns path: kept keys right-aligned per row, then the new columns; re-pack the ring
        b, h, _, d = self.keys.shape
        gather = step.gather.to(dev)[:, None, :, None]
        old_k = self.keys.gather(2, gather.expand(b, h, -1, d))
        old_v = self.values.gather(2, gather.expand(b, h, -1, self.values.shape[-1]))
        if plan.rewrites and self.rotary:
            self._rewrite(step, old_k)
        full_k = torch.cat((old_k, key_states), dim=-2)
        full_v = torch.cat((old_v, value_states), dim=-2)
        keep = step.keep.to(dev)[:, None, :, None]
        valid = step.keep_valid.to(dev)[:, None, :, None]
        n = keep.shape[2]
        kept_k = full_k.gather(2, keep.expand(b, h, -1, d)).masked_fill(~valid, 0.0)
        kept_v = full_v.gather(2, keep.expand(b, h, -1, full_v.shape[-1])).masked_fill(~valid, 0.0)
        self.keys[:, :, :n] = kept_k
        self.values[:, :, :n] = kept_v
        return full_k, full_v

    def _rewrite(self, step: Step, target: Tensor) -> None:
        """Rotate the planned sinks from their original keys into ``target`` (the ring, or the
        gathered old keys): ``k cos + rotate_half(k) sin``, in place when the slots are a run."""
        assert self.sink_keys is not None and self.sink_half is not None
        cos, sin = step.cos_sin(self.sink_keys.dtype, self.device, self.sink_keys.shape[-1])
        if step.rw_shared is not None:  # the same for every row: broadcast over the batch
            idx, dst = step.rw_i, step.rw_dst
            n = len(idx)
            if idx == list(range(n)):
                src, half = self.sink_keys[:, :, :n], self.sink_half[:, :, :n]
            else:
                src, half = self.sink_keys[:, :, idx], self.sink_half[:, :, idx]
            if dst == list(range(dst[0], dst[0] + n)) and not torch.is_grad_enabled():
                out = target[:, :, dst[0] : dst[0] + n]
                torch.mul(src, cos, out=out)
                out.addcmul_(half, sin)
            else:
                target[:, :, dst] = torch.addcmul(src * cos, half, sin)
            return
        rows, idx, dst = (t.to(self.device) for t in (step.rw_b, step.rw_i, step.rw_dst))
        src, half = self.sink_keys[rows, :, idx], self.sink_half[rows, :, idx]  # (N, H_kv, D)
        target[rows, :, dst] = torch.addcmul(src * cos[:, None], half, sin[:, None])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) for one stream read without padding: what it keeps, then the
        new columns. (Its :class:`~sinklab.stream.cache.SinkCache` answers for every row.)"""
        kept = self.seen if self.capacity is None else min(self.seen, self.capacity)
        return kept + query_length, self.seen - kept

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1 if self.capacity is None else self.capacity

    def reset(self) -> None:
        self.keys = self.values = self.sink_keys = self.sink_half = None
        self.seen = 0
        self.is_initialized = False

    def rebase(self, row: int, slots: Sequence[int], shift: int) -> None:
        """Positions of ``row`` restart ``shift`` lower: rotate its keys in ``slots`` back by
        ``shift`` (O(kept), once). A NoPE layer has nothing to move."""
        if not self.rotary or not self.is_initialized or not slots:
            return
        idx = torch.tensor(list(slots), device=self.device)
        delta = torch.full((len(idx),), -shift, dtype=torch.long)
        keys = self.keys[row].index_select(-2, idx)  # (H_kv, kept, D)
        self.keys[row, :, idx] = self.rope.shift(keys, delta)

    def row_kv(self, row: int, slots: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Keys and values of ``row`` at ``slots`` (in that order), as stored: (1, H_kv, n, D)."""
        idx = torch.tensor(list(slots), device=self.device, dtype=torch.long)
        return (
            self.keys[row : row + 1].index_select(-2, idx),
            self.values[row : row + 1].index_select(-2, idx),
        )

    def save_row(self, row: int, slots: Sequence[int]) -> dict[str, Tensor]:
        """Copies of ``row``'s keys and values at ``slots`` (in that order; (H_kv, n, D)) and of
        its sinks' original keys ((H_kv, n_sinks, D)): what a saved stream keeps."""
        if not self.is_initialized:
            raise SinklabError("this cache layer holds nothing; it cannot be saved")
        idx = torch.tensor(list(slots), device=self.device, dtype=torch.long)
        assert self.sink_keys is not None
        return {
            "keys": self.keys[row].index_select(-2, idx).clone(),
            "values": self.values[row].index_select(-2, idx).clone(),
            "sink_keys": self.sink_keys[row].clone(),
        }

    def restore(
        self, saved: Sequence[dict[str, Tensor] | None], n_used: int, seen: int, device: Any
    ) -> None:
        """Hold ``saved`` (one per row, :meth:`save_row`'s; None: an empty row), each row's
        kept slots right-aligned in ``[n_used - kept, n_used)``, having read ``seen`` columns."""
        like = next(s for s in saved if s is not None)
        k, v, sk = like["keys"], like["values"], like["sink_keys"]
        b, slots = len(saved), (self.capacity or 0) + 1
        self.device = device
        self.keys = k.new_zeros(b, k.shape[0], slots, k.shape[-1], device=device)
        self.values = v.new_zeros(b, v.shape[0], slots, v.shape[-1], device=device)
        self.sink_keys = sk.new_zeros(b, *sk.shape, device=device)
        for row, s in enumerate(saved):
            if s is None:
                continue
            pad = n_used - s["keys"].shape[-2]
            self.keys[row, :, pad:n_used] = s["keys"].to(device)
            self.values[row, :, pad:n_used] = s["values"].to(device)
            self.sink_keys[row] = s["sink_keys"].to(device)
        rotate = self.rotary and self.rope is not None
        self.sink_half = (
            self.rope.rotate_half(self.sink_keys) if rotate else torch.zeros_like(self.sink_keys)
        )
        self.seen = seen
        self.is_initialized = True

    def add_rows(self, n: int) -> None:
        """``n`` empty streams (zero rows) after the others."""
        if self.is_initialized:
            self._map(lambda t: torch.cat((t, t.new_zeros(n, *t.shape[1:]))))

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


class SlidingLayer(DynamicSlidingWindowLayer):
    """A hybrid model's sliding-window layer: transformers' own (it keeps exactly the model's
    window, keys never moved), which also rebases its keys and reads out a row."""

    def rebase(self, row: int, shift: int, rope: Any) -> None:
        """Positions of ``row`` restart ``shift`` lower: rotate its window's keys back."""
        if self.is_initialized and rope is not None:
            n_kv = self.keys.shape[-2]
            self.keys[row] = rope.shift(self.keys[row], torch.full((n_kv,), -shift))

    def row_kv(self, row: int) -> tuple[Tensor, Tensor]:
        """Keys and values of ``row``: (1, H_kv, window, D)."""
        return self.keys[row : row + 1], self.values[row : row + 1]

    def add_rows(self, n: int) -> None:
        if self.is_initialized:
            for name in ("keys", "values"):
                t = getattr(self, name)
                setattr(self, name, torch.cat((t, t.new_zeros(n, *t.shape[1:]))))
