"""The block path: attention one block of query rows at a time, with handlers.

Each block materialises its ``(B, H, c, Tk)`` weights, lets handlers transform them, forms the
output, then lets handlers observe it; only one block of one layer exists at a time.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from sinklab.attention import attention_weights
from sinklab.seam.handlers import AttentionChunk, AttentionHandler

# Bytes one materialised weight block may take; the chunk size in query rows follows from it.
CHUNK_BYTES = 32 * 1024 * 1024


def chunk_rows(b: int, h: int, tk: int, itemsize: int) -> int:
    """Query rows per block so one ``(b, h, rows, tk)`` block stays within :data:`CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // max(1, b * h * tk * itemsize))


@functools.lru_cache(maxsize=128)
def _causal_block(c: int, kend: int, device: torch.device) -> Tensor:
    """Causal mask of the last ``c`` queries over ``kend`` keys: bool (1, 1, c, kend), cached
    because every layer of a forward asks for the same blocks."""
    return torch.ones(c, kend, dtype=torch.bool, device=device).tril_(kend - c)[None, None]


@functools.lru_cache(maxsize=16)
def _future_block(c: int, device: torch.device) -> Tensor:
    """The keys a row of a ``c``-row causal block must not see, among its last c keys: (c, c)."""
    return torch.ones(c, c, dtype=torch.bool, device=device).triu_(1)


def attention_by_blocks(
    module: nn.Module,
    layer: int,
    handlers: list[AttentionHandler],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    *,
    causal: bool,
    scale: float,
    variant: str,
    sink_logit: Tensor | None,
    softcap: float | None,
) -> Tensor:
    """Attention output (B, H, Tq, D) with ``handlers`` applied to every block of query rows.

    ``query`` (B, H, Tq, D); ``key``/``value`` (B, H, Tk, D), KV heads already repeated; ``mask``
    bool (B|1, 1, Tq, Tk), or None when the mask is plain causal and every handler opts in to
    ``causal_trim`` (then each block's keys stop at the last one its rows can see); ``causal``:
    the mask is plain causal with the queries at the end.
    """
    b, h, tq, _ = query.shape
    tk = key.shape[2]
    trim = mask is None
    out = torch.empty_like(query)
    step = chunk_rows(b, h, tk, 4)
    for q0 in range(0, tq, step):
        q1 = min(tq, q0 + step)
        qc = query[:, :, q0:q1]
        kend = tk - tq + q1 if trim else tk  # keys any row of this chunk can see
        kc, vc = (key[:, :, :kend], value[:, :, :kend]) if trim else (key, value)
        scores = torch.matmul(qc * scale, kc.transpose(-1, -2))  # (B, H, c, kend); scale on q
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        c = q1 - q0
        # trimmed: causal (c, kend), only the last c key columns hold masked entries
        mc = _causal_block(c, kend, query.device) if trim else mask[..., q0:q1, :]
        if variant == "softmax" and causal:  # fused softmax; no fully masked row can occur
            work = torch.promote_types(scores.dtype, torch.float32)
            if trim:  # only opted-in observers see this chunk: mask the scores in place
                masked = scores
                masked[..., kend - c :].masked_fill_(_future_block(c, query.device), float("-inf"))
            else:
                masked = scores.masked_fill(~mc, float("-inf"))
            weights = torch.softmax(masked, dim=-1, dtype=work).to(scores.dtype)
        else:
            weights = attention_weights(variant, scores, mc, sink_logit=sink_logit)
        chunk = AttentionChunk(layer, module, q0, tk - tq, tq, qc, kc, vc, scores, mc, weights)
        for handler in handlers:
            handler.transform(chunk)
        chunk.output = torch.matmul(chunk.weights.to(value.dtype), vc)  # (B, H, c, D)
        for handler in handlers:
            handler.observe(chunk)
        out[:, :, q0:q1] = chunk.output
    return out
