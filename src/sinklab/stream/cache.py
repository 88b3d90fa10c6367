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
``DynamicCache``. One query needs no mask (positions live in the keys); a forward of several
tokens gets the kept keys then the new ones, under the causal mask built from
:meth:`SinkCache.get_mask_sizes`.

Positions that never grow: with ``model.generate`` the model sees positions up to the stream
length, so float32 angles drift (about ``position * 6e-8`` rad; measured in the README). sinklab's
own loops call :meth:`SinkCache.prepare` before each forward and pass what it returns
(``position_ids``, and a mask when rows need one): positions stay below ``max_position`` (the
model's ``max_position_embeddings``); when a row would reach it, the row is *rebased* once, its
kept keys rotated back by the same amount (O(kept)), so its positions restart at 0..kept.

Many streams: each batch row is an independent stream (its own slots, sinks, positions, base; see
:mod:`sinklab.stream.slots`). ``model.generate`` with left-padded prompts works (the layout keeps
each row's invalid slots a prefix of the keys, which is what its 2D padding mask says; a row's
new tokens are told from its padding by the positions, so read a padded prompt in one forward, not
with a ``prefill_chunk_size`` shorter than the padding); sinklab's
loops add (:meth:`SinkCache.add_streams`) and remove (:meth:`SinkCache.keep_streams`) streams
between steps, feed rows different numbers of tokens (left-padded), and fit a prompt into the
cache before reading it (:meth:`SinkCache.evict_for_space`, StreamingLLM's).

What cannot be moved is refused by :func:`sinklab.models.rotary.rope_of`, naming the reason.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from sinklab.errors import SinklabError
from sinklab.models.arch import (
    check_windows,
    compute_dtype,
    decoder_config,
    input_device,
    layer_kinds,
)
from sinklab.models.rotary import rope_of
from sinklab.seam import binding_generation, bound_handlers
from sinklab.stream.layer import SinkLayer, SlidingLayer, Step
from sinklab.stream.policy import CACHE_POLICIES, CacheConfig, kept_positions
from sinklab.stream.slots import Plan, Row, plan_columns, plan_ring, real_tokens, ring_slots
from sinklab.stream.state import StreamState, check_states, fill_from_states, state_of

__all__ = [
    "CACHE_POLICIES",
    "CacheConfig",
    "SinkCache",
    "SinkLayer",
    "StreamState",
    "kept_positions",
]


def _check_handlers(model: Any, sinks: tuple[int, ...]) -> None:
    """Refuse an attention handler bound to ``model`` that needs keys in text order: the cache
    writes its window in ring order, and only a sink at its own slot keeps its index
    (docs/streaming.md#methods)."""
    fixed = frozenset(s for j, s in enumerate(sorted(sinks)) if s == j)
    handlers = {id(h): h for m in model.modules() for h in bound_handlers(m)}
    for handler in handlers.values():
        if (reason := handler.slot_order_reason(fixed)) is not None:
            raise SinklabError(reason)


class SinkCache(Cache):
    """A transformers 5 ``Cache`` keeping sinks + a recent window, at cache-relative positions.

    ``SinkCache(model, CacheConfig(policy="sink", n_sink=4, window=508))``; pass it as ``cache=``
    (or ``past_key_values=``) to ``model(...)`` or ``model.generate(...)``, and keep passing the
    same object to continue the stream (several ``generate`` calls: pass the whole conversation,
    as with any transformers cache). Each batch row is its own stream. ``get_seq_length()`` is the
    number of columns seen (what ``generate`` slices with); :meth:`kept_length` is what is cached.
    ``max_position`` (default: the model's ``max_position_embeddings``) bounds the positions
    :meth:`prepare` gives the model.
    """

    def __init__(
        self, model: Any, config: CacheConfig | None = None, max_position: int | None = None
    ) -> None:
        self.config = config or CacheConfig()
        text_cfg = decoder_config(model)
        kinds = layer_kinds(text_cfg)  # sinklab.models.arch: RoPE / NoPE, the model's own windows
        check_windows(kinds, self.config)
        self.rope = None if self.config.capacity is None else rope_of(model)  # dense moves none
        self.hybrid = self.config.capacity is not None and len({k.window for k in kinds}) > 1
        self.sliding_rope = rope_of(model, "sliding_attention") if self.hybrid else None
        max_pos = max_position or getattr(text_cfg, "max_position_embeddings", None)
        cap = self.config.capacity
        if cap is not None and max_pos and cap >= max_pos:
            raise SinklabError(
                f"n_sink + window = {cap} is not below the model's {max_pos} max positions; "
                f"make the window smaller (at most {max_pos - 1 - self.config.n_sink})"
            )
        self.capacity = cap
        self.max_position = max_pos
        self.sinks = self.config.sinks
        self._model = weakref.ref(model)  # to check handlers bound after the cache was made
        self._checked = -1  # the binding generation the handlers were last checked at
        self._check_bound()
        self.recent = self.config.recent
        self._eager = getattr(text_cfg, "_attn_implementation", None) == "eager"
        self._device, self._dtype = input_device(model), compute_dtype(model)
        super().__init__(layers=[self._layer(k) for k in kinds])
        self._reset_state()

    def _layer(self, kind: Any) -> CacheLayerMixin:
        """Hybrid models: a sliding layer keeps exactly the model's own window (transformers'
        layer, keys never moved); every other layer keeps sinks + window."""
        if self.hybrid and kind.window is not None:
            return SlidingLayer(kind.window)
        return SinkLayer(self.capacity, len(self.sinks), self.rope, kind.rotary)

    # -------------------------------------------------------------------- public read-outs
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns seen (one stream: its tokens); what ``generate`` slices its inputs with."""
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(kv_length, kv_offset) of the next forward: kv index ``i`` is column
        ``kv_offset + i``, so a left-padded 2D mask lands on each row's invalid (prefix) slots.
        A hybrid model's sliding layer answers for itself."""
        if isinstance(layer := self.layers[layer_idx], SlidingLayer):
            return layer.get_mask_sizes(query_length)
        if self._prepared is not None:
            n = self._prepared.kv_len
        elif self.capacity is None:
            n = self.seen + query_length
        elif query_length == 1 and self.rows:
            n = ring_slots(self.rows, self.n_used, self.capacity + 1)[1]
        else:
            n = max((r.kept() for r in self.rows), default=0) + query_length
        return n, self.seen - (n - query_length)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def kept_length(self, row: int | None = None) -> int:
        """Positions cached between steps (at most ``n_sink + window``): of ``row``, or the most
        of any row."""
        rows = self.rows if row is None else [self.rows[row]]
        if self.capacity is None:
            return max((r.seen for r in rows), default=0)
        return max((r.kept() for r in rows), default=0)

    def kept_positions(self, row: int = 0) -> list[int]:
        """The stream positions of ``row`` cached now, in stream order."""
        r = self.rows[row]
        return list(range(r.seen)) if self.capacity is None else r.positions()

    def stream_length(self, row: int = 0) -> int:
        """Tokens of ``row``'s stream read so far."""
        return self.rows[row].seen

    def next_position(self, row: int = 0) -> int:
        """The position the model would be given for ``row``'s next token."""
        r = self.rows[row]
        return r.seen - r.base

    def relative_keys(self, layer_idx: int, row: int = 0) -> tuple[Tensor, Tensor]:
        """Kept keys and values of a layer and row in stream order, keys rotated to their
        cache-relative positions 0..kept-1: (1, H_kv, kept, D) each. For inspection, O(kept)."""
        layer, r = self.layers[layer_idx], self.rows[row]
        if isinstance(layer, SlidingLayer):
            return layer.row_kv(row)
        if self.capacity is None:
            return layer.row_kv(row, [c for c, v in enumerate(r.dense_valid) if v])
        order = sorted((p, s) for s, p in enumerate(r.slot_pos) if p >= 0)
        keys, values = layer.row_kv(row, [s for _, s in order])
        if not layer.rotary:  # NoPE: keys carry no position
            return keys, values
        rot = {r.sink_slot[i]: r.sink_rot[i] for i in r.sink_slot}
        current = torch.tensor([rot.get(s, p) - r.base for p, s in order])
        delta = torch.arange(len(order)) - current
        return self.rope.shift(keys, delta), values

    # -------------------------------------------------------------- save and restore
    def state(self, row: int = 0) -> StreamState:
        """Stream ``row`` as a value that outlives this cache (its kept keys and values, its
        sinks and positions): save it, or rebuild a cache from it with :meth:`from_state`."""
        return state_of(self, row)

    @classmethod
    def from_state(
        cls, model: Any, states: Sequence[StreamState], max_position: int | None = None
    ) -> SinkCache:
        """A cache whose row ``b`` continues ``states[b]`` with the logits it would have given
        in the cache it came from (see :mod:`sinklab.stream.state`)."""
        return fill_from_states(cls(model, check_states(states), max_position), states)

    # ------------------------------------------------------------------ sinklab's loops
    def prepare(self, new: int | Sequence[int] = 1) -> dict[str, Tensor]:
        """Plan the next forward, in which row ``b`` reads ``new[b]`` tokens (``int``: every row;
        rows with fewer are left-padded to the most). Rebases a row whose positions would reach
        ``max_position``. Returns the model's ``position_ids`` (B, q) and, when a row has padding
        or invalid keys, an ``attention_mask`` (B, 1, q, kv); pass both: ``model(ids, cache=cache,
        **cache.prepare(q))``. (``model.generate`` does not call this: see the module docs.)"""
        if not self.rows:
            raise SinklabError("this SinkCache has no streams; add one with add_streams()")
        real = [new] * len(self.rows) if isinstance(new, int) else [int(x) for x in new]
        if len(real) != len(self.rows) or min(real) < 0 or max(real) < 1:
            raise SinklabError(
                f"prepare() takes one count >= 0 per stream ({len(self.rows)}), at least one "
                f"positive; got {new!r}"
            )
        q = max(real)
        for b, r in enumerate(real):
            self._bound(b, r)
        pos = torch.zeros(len(real), q, dtype=torch.long)
        for b, (row, r) in enumerate(zip(self.rows, real, strict=True)):
            pos[b, q - r :] = torch.arange(row.seen - row.base, row.seen - row.base + r)
        self._prepared = self._plan(q, real)
        out = {"position_ids": pos.to(self._device)}
        if self._prepared.masked:
            out["attention_mask"] = self._mask(self._prepared)
        return out

    def evict_for_space(self, n: int | Sequence[int]) -> None:
        """Before reading ``n`` tokens at once (a prompt): evict each row's oldest non-sinks so
        that what it keeps plus the ``n`` new ones fit in ``n_sink + window`` (StreamingLLM's
        ``evict_for_space``). With ``n`` above the window, every non-sink goes. ``n`` may be one
        count per row (rows reading different lengths; 0 leaves a row as it is)."""
        if self.capacity is None:
            return
        counts = [n] * len(self.rows) if isinstance(n, int) else [int(x) for x in n]
        if len(counts) != len(self.rows):
            raise SinklabError(f"evict_for_space takes one count per stream ({len(self.rows)})")
        for row, k in zip(self.rows, counts, strict=True):
            if k <= 0:
                continue
            while row.ring and row.kept() + k > self.capacity:
                row.slot_pos[row.ring.popleft()] = -1
            row.free = [s for s in row.free if row.slot_pos[s] < 0]

    def add_streams(self, n: int = 1) -> None:
        """Append ``n`` empty streams (batch rows) to read from the next step on."""
        if n < 1:
            raise SinklabError(f"add_streams takes a positive count, got {n}")
        self._one_stream_only()
        self.rows += [Row(slot_pos=[-1] * self.n_used, dense_valid=[False] * self.seen)]
        self._padded = self._padded or self.seen > 0
        self.rows += [self.rows[-1].copy() for _ in range(n - 1)]
        for layer in self.layers:
            layer.add_rows(n)

    def keep_streams(self, rows: Sequence[int]) -> None:
        """Keep only the streams ``rows`` (batch indices, in the new order); drop the others."""
        idx = [int(r) for r in rows]
        if any(not 0 <= r < len(self.rows) for r in idx):
            raise SinklabError(f"stream index out of range 0..{len(self.rows) - 1}: {list(rows)}")
        self.batch_select_indices(torch.tensor(idx, dtype=torch.long))

    # ------------------------------------------------------------------ batch reshuffles
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.rows = [self.rows[int(i)].copy() for i in beam_idx.tolist()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.rows = [r.copy() for r in self.rows for _ in range(repeats)]

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self.rows = [self.rows[int(i)].copy() for i in torch.as_tensor(indices).tolist()]

    # ----------------------------------------------------------------------- the step
    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        if layer_idx == 0:
            inner = kwargs.get("kwargs") or {}
            self._begin(key_states, inner.get("position_ids", kwargs.get("position_ids")))
        layer = self.layers[layer_idx]
        if isinstance(layer, SinkLayer):
            return layer.update(key_states, value_states, step=self._step)
        return layer.update(key_states, value_states)

    def reset(self) -> None:
        super().reset()  # each layer drops its tensors
        self._reset_state()

    def _reset_state(self) -> None:
        self.seen = 0  # columns read (for one stream: its tokens)
        self.n_used = 0  # slots in use (the same for every row)
        self.rows: list[Row] = [Row()]
        self._padded = False  # dense: some row has a padding column
        self._prepared: Plan | None = None
        self._step: Step | None = None

    def _check_bound(self) -> None:
        """Refuse the handlers bound to the model now that this cache cannot honour (at
        construction, and again at a forward whenever any binding changed since)."""
        if self.capacity is None or self._checked == (now := binding_generation()):
            return
        model = self._model()
        if model is not None:
            _check_handlers(model, self.sinks)
        self._checked = now

    def _begin(self, key_states: Tensor, position_ids: Tensor | None) -> None:
        """Plan one forward of ``q`` new columns for all layers (called on layer 0)."""
        self._check_bound()  # an intervention bound after the cache was made
        b, _, q, _ = key_states.shape
        if self._prepared is not None:
            plan, self._prepared = self._prepared, None
            if plan.q != q or len(plan.real) != b:
                raise SinklabError(
                    f"prepare() planned {len(plan.real)} x {plan.q} tokens but the model was "
                    f"given {b} x {q}"
                )
        else:
            if len(self.rows) == 1 and b > 1 and self.seen == 0:  # a fresh batch (generate)
                self.rows = [Row() for _ in range(b)]
            if b != len(self.rows):
                raise SinklabError(f"this SinkCache holds {len(self.rows)} streams, given {b}")
            if b > 1:
                self._one_stream_only()
            if position_ids is None:
                last = [self.seen + q - 1] * b
            else:
                pos = position_ids.reshape(-1, position_ids.shape[-1])
                last = pos[:, -1].expand(b).tolist() if pos.shape[0] == 1 else pos[:, -1].tolist()
            plan = self._plan(q, real_tokens(self.rows, q, last))
        self._step = Step(plan, self.rope)
        self.seen += q

    def _plan(self, q: int, real: list[int]) -> Plan:
        if self.capacity is None:
            plan = Plan(q, real, self.seen + q, [])
            self._padded = self._padded or any(r != q for r in real)
            for row, r in zip(self.rows, real, strict=True):
                row.dense_valid += [False] * (q - r) + [True] * r
                row.seen += r
                if self._padded:  # else every key is real: no mask, no O(seen) list per step
                    plan.valid.append(list(row.dense_valid))
            return plan
        if q == 1 and all(r == 1 for r in real):
            plan, self.n_used = plan_ring(
                self.rows, self.n_used, self.capacity + 1, self.sinks, self.recent
            )
        else:
            plan, self.n_used = plan_columns(self.rows, q, real, self.sinks, self.recent)
        return plan

    def _bound(self, b: int, n: int) -> None:
        """Rebase row ``b`` if reading ``n`` more tokens would reach ``max_position``: rotate its
        kept keys back by ``D`` positions (O(kept), once) so they sit at 0..kept-1."""
        row, bound = self.rows[b], self.max_position
        if self.capacity is None or not bound or row.seen - row.base + n <= bound:
            return
        kept = row.kept()
        if kept + n > bound:
            raise SinklabError(
                f"cannot read {n} tokens at once with {kept} cached below {bound} positions; "
                f"read at most {bound - kept} at a time"
            )
        shift = row.seen - kept - row.base
        slots = [s for s, p in enumerate(row.slot_pos) if p >= 0]
        if shift <= 0 or not slots:
            return
        for layer in self.layers:
            if isinstance(layer, SlidingLayer):  # the model's window, moved along
                layer.rebase(b, shift, self.sliding_rope)
            else:
                layer.rebase(b, slots, shift)
        row.base += shift

    def _one_stream_only(self) -> None:
        if self.hybrid:
            raise SinklabError(
                "this model mixes sliding-window and global layers; its SinkCache streams one "
                "row at a time (the sliding layers keep the model's own cache, shared by rows)"
            )

    def _mask(self, plan: Plan) -> Tensor:
        """(B, 1, q, kv) mask of a planned forward: valid kept keys, then the new columns causal
        (a padding query sees itself only, so no row is all -inf)."""
        valid = torch.tensor(plan.valid, dtype=torch.bool)  # (B, kv)
        b, kv, q = valid.shape[0], valid.shape[1], plan.q
        mask = valid[:, None, None, :].expand(b, 1, q, kv).clone()
        mask[:, 0, :, kv - q :] &= torch.ones(q, q, dtype=torch.bool).tril()
        mask[:, 0, torch.arange(q), kv - q + torch.arange(q)] = True
        mask = mask.to(self._device)
        if self._eager:
            zeros = torch.zeros(mask.shape, dtype=self._dtype, device=self._device)
            return zeros.masked_fill(~mask, torch.finfo(self._dtype).min)
        return mask
