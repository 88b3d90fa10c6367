"""The plugin's evicted-query attention (``sinklab_vllm.attention``: :func:`plan_evicted` once a
forward, :func:`attend_evicted` in every layer) against StreamingLLM written out in this test:
for each query past the window, the sinks and the ``window`` keys before it and itself, each
raw (unrotated) key rotated at its position *in the cache* (sink ``j`` at ``j``, the window
after them, the query at ``n_sink + window``), softmax in float64. The cache is laid out as
vLLM's CPU backend writes it (keys transposed per block, docs/vllm.md#layout) with keys rotated
at their stream position (or at the rebased one past ``max_position``), scattered over shuffled
blocks, with only the slots some query keeps written (NaN everywhere else, so a slot read that
is not kept shows). One plan serves two layers' caches, as the backend reuses it.

Pure PyTorch: the plugin's attention module imports nothing from vLLM, so this runs in
sinklab's venv beside the engine tests of tests/test_vllm_stream.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "vllm_plugin" / "src"))

from sinklab_vllm.attention import (
    attend_evicted,
    plan_evicted,
    rotated_at,
    sink_attention_many,
)
from sinklab_vllm.rotary import KeyMover

HEADS, KV_HEADS, D, B = 6, 2, 16, 8
INV = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of ``x`` (S, heads, D) at ``pos`` (S,), in float64."""
    ang = pos.double()[:, None] * INV[None, :]
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
    half = D // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x.double() * cos + rot.double() * sin


def _layer(length: int, seed: int):
    """Raw keys, values (length, KV_HEADS, D) and queries (length, HEADS, D) of one request."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(length, KV_HEADS, D, generator=g),
            torch.randn(length, KV_HEADS, D, generator=g),
            torch.randn(length, HEADS, D, generator=g))  # fmt: skip


def _naive(queries, keys, values, t: int, n_sink: int, window: int) -> torch.Tensor:
    """StreamingLLM at query ``t``: cache positions, not stream positions, in float64."""
    kept = list(range(n_sink)) + list(range(t - window, t + 1))
    k = _rope(keys[kept], torch.arange(len(kept)))  # each key at its cache position
    q = _rope(queries[t : t + 1], torch.tensor([len(kept) - 1]))[0]  # (HEADS, D)
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, dim=1)  # (K, HEADS, D)
    v = values[kept].double().repeat_interleave(group, dim=1)
    w = (torch.einsum("hd,khd->hk", q, k) / D**0.5).softmax(-1)
    return torch.einsum("hk,khd->hd", w, v)


@pytest.mark.parametrize("max_position", [None, 40], ids=["no-rebase", "past-a-wrap"])
def test_one_plan_serves_every_layer_as_streamingllm_attends(max_position):
    n_sink, window, length = 3, 12, 90  # with max_position 40: positions wrap twice
    capacity = n_sink + window
    mover = KeyMover(INV, D, D)
    n_blocks = 3 * (length // B + 1)
    perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(0))
    per = length // B + 1
    rows = [perm[:per].int(), perm[per : 2 * per].int()]  # int32, as vLLM's block table
    positions = torch.tensor([capacity + 1, 50, length - 1])  # past the window
    which = torch.tensor([0, 1, 0])  # each query's request
    block_rows = torch.stack([rows[int(r)] for r in which])
    plan = plan_evicted(block_rows, positions, n_sink, window, mover, B, torch.float32,
                        max_position)  # fmt: skip
    for layer in range(2):  # the plan is the forward's, the caches are each layer's
        layers = [_layer(length, seed=10 * layer + r) for r in range(2)]
        cache = torch.full((n_blocks, KV_HEADS, B, 2 * D), float("nan"))
        kv = cache.view(n_blocks, KV_HEADS, 2 * B, D)
        key_blocks = kv[:, :, :B].reshape(n_blocks, KV_HEADS, D, B)  # views: written through
        value_blocks = kv[:, :, B:]
        kept: list[set[int]] = [set(), set()]  # only what some query keeps: NaN elsewhere
        for r, t in zip(which.tolist(), positions.tolist(), strict=True):
            kept[r] |= set(range(n_sink)) | set(range(t - window, t + 1))
        for r, (keys, values, _) in enumerate(layers):
            rotated = _rope(keys, rotated_at(torch.arange(length), capacity, max_position))
            for p in sorted(kept[r]):
                b, o = int(rows[r][p // B]), p % B
                value_blocks[b, :, o] = values[p]
                key_blocks[b, :, :, o] = rotated[p].float()
        queries = torch.stack([
            _rope(layers[int(r)][2][t : t + 1], rotated_at(torch.tensor([t]), capacity,
                  max_position))[0].float()
            for r, t in zip(which, positions.tolist(), strict=True)
        ])  # fmt: skip
        ours = attend_evicted(queries, cache, plan, mover, 1 / D**0.5)
        again = sink_attention_many(queries, cache, block_rows, positions, n_sink, window, mover,
                                    1 / D**0.5, max_position)  # fmt: skip
        assert torch.equal(ours, again)  # a fresh plan: the same bits
        for i, (r, t) in enumerate(zip(which.tolist(), positions.tolist(), strict=True)):
            keys, values, raw_q = layers[r]
            ref = _naive(raw_q, keys, values, t, n_sink, window)
            assert torch.allclose(ours[i].double(), ref, atol=2e-5), (layer, t, ours[i] - ref)
        assert torch.isfinite(ours).all()  # never read a slot it does not keep (NaN there)
