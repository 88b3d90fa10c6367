"""Worker side: one decode query's StreamingLLM attention over a request's kept slots
(docs/vllm.md#attention).

The query at stream position ``t`` attends to the sinks ``0 .. n_sink-1``, the window
``t-window .. t-1`` and itself (``sinklab.stream.policy.kept_positions(t, ...)`` plus ``t``),
gathered from vLLM's cache by position (:func:`sinklab_vllm.cache.gather`), so evicted slots, null
blocks and the tails of partially evicted blocks are never read. Once a gap has opened
(``t > n_sink + window``) the sink keys are moved by ``delta = t - n_sink - window`` positions
(:class:`sinklab_vllm.rotary.KeyMover`, from the cached key each time), which puts them just
before the window, where StreamingLLM's cache-relative positions put them. This module is plain
PyTorch (a reference path, not a fast kernel); :mod:`sinklab_vllm.backend` calls it for every
query past the window."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sinklab_vllm.cache import gather, key_value_caches
from sinklab_vllm.rotary import KeyMover


def kept_slots(t: int, n_sink: int, window: int) -> Tensor:
    """Stream positions the query at ``t`` attends to, in stream order: the sinks seen, the
    ``window`` most recent others before ``t``, and ``t``."""
    sinks = list(range(min(n_sink, t)))
    recent = list(range(max(n_sink, t - window), t))
    return torch.tensor([*sinks, *recent, t], dtype=torch.long)


def sink_attention(
    query: Tensor,
    kv_cache: Tensor,
    block_row: Tensor,
    t: int,
    n_sink: int,
    window: int,
    mover: KeyMover,
    scale: float,
) -> Tensor:
    """Attention output ``(num_heads, head_size)`` of one query ``(num_heads, head_size)``
    (rotated by the model at ``t``) over the request's kept slots, softmax in float32."""
    positions = kept_slots(t, n_sink, window)
    keys, values = gather(kv_cache, block_row, positions)  # (K, kv_heads, D)
    delta = max(0, t - n_sink - window)
    n_seen_sinks = min(n_sink, t)
    if delta and n_seen_sinks:
        shift = torch.full((n_seen_sinks,), delta, dtype=torch.long)
        keys = torch.cat((mover.move(keys[:n_seen_sinks], shift), keys[n_seen_sinks:]))
    group = query.shape[0] // keys.shape[1]  # query heads per KV head (GQA)
    keys = keys.repeat_interleave(group, dim=1).float()  # (K, heads, D)
    values = values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("hd,khd->hk", query.float(), keys) * scale
    weights = scores.softmax(dim=-1)
    return torch.einsum("hk,khd->hd", weights, values).to(query.dtype)


def rotated_at(positions: Tensor, capacity: int, max_position: int | None) -> Tensor:
    """The RoPE position the plugin gives stream ``positions`` (docs/vllm.md#positions): the
    position itself below ``max_position`` (or always, when ``None``); past it, the rebase wraps
    it back to ``capacity`` (``n_sink + window``) and on, once every ``max_position - capacity``
    steps, so no query or key is ever rotated at ``max_position`` or beyond. Only differences of
    positions enter attention, and the backend moves each kept key to its StreamingLLM
    distance from the query, so the wrap changes no score."""
    if max_position is None:
        return positions
    wrapped = capacity + (positions - capacity).remainder(max_position - capacity)
    return torch.where(positions < capacity, positions, wrapped)


@dataclass(frozen=True)
class EvictedPlan:
    """What :func:`attend_evicted` needs for some queries past the window, apart from the
    layer's own tensors: computed once a forward (:func:`plan_evicted`) and shared by every
    layer, since the slots and the sinks' rotations depend only on the positions and block
    tables. ``blocks``/``offsets`` ``(Q, K)`` locate each query's kept slots in the cache,
    ``moving`` ``(K,)`` marks the columns whose keys are rotated, by ``cos``/``sin``
    ``(Q * M, 1, head_size)`` (``M`` moving columns; ``None`` when none moves)."""

    blocks: Tensor
    offsets: Tensor
    moving: Tensor
    cos: Tensor | None
    sin: Tensor | None


def plan_evicted(
    block_rows: Tensor,
    positions: Tensor,
    n_sink: int,
    window: int,
    mover: KeyMover,
    block_size: int,
    dtype: torch.dtype,
    max_position: int | None = None,
) -> EvictedPlan:
    """The :class:`EvictedPlan` of queries at stream ``positions`` (each ``> n_sink +
    window``) of the requests whose block-table rows are ``block_rows``, for keys of ``dtype``
    in blocks of ``block_size``. With ``max_position`` the queries and keys were rotated at
    :func:`rotated_at` of their positions (the rebase): a sink is moved by ``r(s) - n_sink -
    window`` (``r(s)`` the query's rotation position), a window key at ``p`` by ``b(p) - b(s)``
    (``b(x) = x - r(x)``, zero unless a wrap lies between them), which puts every key at its
    StreamingLLM distance."""
    capacity = n_sink + window
    if bool((positions <= capacity).any()):
        raise ValueError("plan_evicted takes only queries past the window")
    sinks = torch.arange(n_sink, device=positions.device)
    recent = torch.arange(-window, 1, device=positions.device)  # the window, then the query
    slots = torch.cat(  # (Q, K) stream positions
        (sinks.expand(len(positions), -1), positions[:, None] + recent[None, :]), dim=1
    ).to(block_rows.dtype)
    blocks = torch.gather(block_rows, 1, slots // block_size)
    offsets = slots % block_size
    r = rotated_at(positions, capacity, max_position)
    shift = torch.zeros(slots.shape, dtype=torch.long, device=positions.device)
    shift[:, :n_sink] = (r - capacity)[:, None]
    if max_position is not None:
        recent_slots = slots[:, n_sink:].long()
        b_key = recent_slots - rotated_at(recent_slots, capacity, max_position)
        shift[:, n_sink:] = b_key - (positions - r)[:, None]
    moving = shift.ne(0).any(dim=0)  # the columns with a key to move (the sinks, after a wrap)
    cos = sin = None
    if bool(moving.any()):
        cos, sin = mover.cos_sin(shift[:, moving].reshape(-1), dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
    return EvictedPlan(blocks, offsets, moving, cos, sin)


def attend_evicted(
    queries: Tensor, kv_cache: Tensor, plan: EvictedPlan, mover: KeyMover, scale: float
) -> Tensor:
    """StreamingLLM's attention ``(Q, num_heads, head_size)`` of ``queries`` ``(Q, num_heads,
    head_size)`` over their kept slots in one layer's ``kv_cache``, as ``plan`` locates and
    moves them: one gather and one batched softmax (float32) for all of them."""
    keys_cache, values_cache = key_value_caches(kv_cache)
    keys = keys_cache[plan.blocks, :, :, plan.offsets]  # (Q, K, kv_heads, D), a fresh tensor
    values = values_cache[plan.blocks, :, plan.offsets]
    if plan.cos is not None:
        part = keys[:, plan.moving]
        moved = mover.turn(part.reshape(-1, *part.shape[2:]), plan.cos, plan.sin)
        keys[:, plan.moving] = moved.view(part.shape)
    n_q, heads, head_size = queries.shape
    kv_heads = keys.shape[2]
    # GQA without copying keys per query head: each KV head's query heads in one matmul
    grouped = queries.float().view(n_q, kv_heads, heads // kv_heads, head_size)
    scores = torch.matmul(grouped, keys.float().permute(0, 2, 3, 1)) * scale  # (Q, kv, g, K)
    weights = scores.softmax(dim=-1)
    out = torch.matmul(weights, values.float().permute(0, 2, 1, 3))  # (Q, kv, g, D)
    return out.reshape(n_q, heads, head_size).to(queries.dtype)


def sink_attention_many(
    queries: Tensor,
    kv_cache: Tensor,
    block_rows: Tensor,
    positions: Tensor,
    n_sink: int,
    window: int,
    mover: KeyMover,
    scale: float,
    max_position: int | None = None,
) -> Tensor:
    """:func:`sink_attention` for many queries at once, each past the window: ``queries``
    ``(Q, num_heads, head_size)``, query ``i`` at stream position ``positions[i] > n_sink +
    window`` of the request whose block-table row is ``block_rows[i]``. Every such query attends
    to the same number of slots (``n_sink + window + 1``), so one gather and one batched softmax
    serve them all. :func:`plan_evicted` then :func:`attend_evicted`; the backend plans once a
    forward and attends in every layer."""
    block_size = key_value_caches(kv_cache)[1].shape[2]
    plan = plan_evicted(
        block_rows, positions, n_sink, window, mover, block_size, kv_cache.dtype, max_position
    )
    return attend_evicted(queries, kv_cache, plan, mover, scale)
