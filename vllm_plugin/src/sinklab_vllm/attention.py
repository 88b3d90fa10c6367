"""Worker side: one decode query's StreamingLLM attention over a request's kept slots
(docs/vllm.md#attention).

The query at stream position ``t`` attends to the sinks ``0 .. n_sink-1``, the window
``t-window .. t-1`` and itself (``sinklab.stream.policy.kept_positions(t, ...)`` plus ``t``),
gathered from vLLM's cache by position (:func:`sinklab_vllm.cache.gather`), so evicted slots, null
blocks and the tails of partially evicted blocks are never read. Once a gap has opened
(``t > n_sink + window``) the sink keys are moved by ``delta = t - n_sink - window`` positions
(:class:`sinklab_vllm.rotary.KeyMover`, from the cached key each time), which puts them just
before the window, where StreamingLLM's cache-relative positions put them. This module is plain
PyTorch (a reference path, not a fast kernel) and is not wired into an engine yet."""

from __future__ import annotations

import torch
from torch import Tensor

from sinklab_vllm.cache import gather
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
