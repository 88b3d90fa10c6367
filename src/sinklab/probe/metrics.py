"""The probe's sink metrics (``docs/metrics.md#probe-metrics``) as pure tensor functions.

Attention weights are ``(B, H, Tq, Tk)``: query row ``i`` sits at key position ``q_offset + i``
(``q_offset = 0`` for a full causal forward; a chunk of rows starting at row ``s`` of the full
matrix has ``q_offset = s``). Because positions grow with the row index, every "queries t >= s"
selection is a suffix of rows, so each mean is a *sum over rows* divided by a *count*: the
``*_partial`` functions return exactly those sums and counts, and accumulating them chunk by chunk
gives the same numbers as one call on the whole matrix (see :mod:`sinklab.probe.capture`).

Hidden-state metrics take one layer's residual stream ``(T, d)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

HEAD_KINDS = ("sink", "diagonal", "previous-token", "mixed")


def _first_row(tq: int, q_offset: int, start: int) -> int:
    """Index of the first row whose position ``q_offset + i`` is ``>= start`` (clamped)."""
    return min(tq, max(0, start - q_offset))


def _offset_diagonal(weights: Tensor, q_offset: int, shift: int) -> tuple[Tensor, int]:
    """``A[t, t - shift]`` for every row that has such a key: ``((B, H, n), first row index)``."""
    tq, tk = weights.shape[-2:]
    k0 = q_offset - shift  # key index of row 0
    r0 = max(0, -k0)  # rows before r0 would need a negative key
    n = max(0, min(tq - r0, tk - (k0 + r0)))
    diag = torch.diagonal(weights[..., r0 : r0 + n, k0 + r0 : k0 + r0 + n], dim1=-2, dim2=-1)
    return diag, r0


# ----------------------------------------------------------------------------- partial sums
def sink_mass_partial(
    weights: Tensor, key: int = 0, q0: int = 0, q_offset: int = 0
) -> tuple[Tensor, int]:
    """Sum over rows t >= max(key, q0) of ``A[t, key]``: ``((B, H), number of rows)``."""
    r0 = _first_row(weights.shape[-2], q_offset, max(key, q0))
    rows = weights[..., r0:, key]
    return rows.sum(-1).double(), rows.shape[-1]


def diagonal_partial(weights: Tensor, q0: int = 0, q_offset: int = 0) -> tuple[Tensor, int]:
    """Sum over rows t >= q0 of ``A[t, t]``: ``((B, H), count)``."""
    diag, r0 = _offset_diagonal(weights, q_offset, 0)
    d = diag[..., max(0, _first_row(weights.shape[-2], q_offset, q0) - r0) :]
    return d.sum(-1).double(), d.shape[-1]


def prev_token_partial(weights: Tensor, q0: int = 0, q_offset: int = 0) -> tuple[Tensor, int]:
    """Sum over rows t >= max(1, q0) of ``A[t, t - 1]``: ``((B, H), count)``."""
    diag, r0 = _offset_diagonal(weights, q_offset, 1)
    d = diag[..., max(0, _first_row(weights.shape[-2], q_offset, max(1, q0)) - r0) :]
    return d.sum(-1).double(), d.shape[-1]


def entropy_partial(weights: Tensor, q0: int = 0, q_offset: int = 0) -> tuple[Tensor, int]:
    """Sum over rows t >= q0 of the row entropy ``-sum_j A log A`` in nats: ``((B, H), count)``."""
    r0 = _first_row(weights.shape[-2], q_offset, q0)
    ent = torch.special.entr(weights[..., r0:, :].float()).sum(-1)  # (B, H, rows)
    return ent.double().sum(-1), ent.shape[-1]


def received_partial(weights: Tensor, q0: int = 0, q_offset: int = 0) -> tuple[Tensor, Tensor]:
    """Column sums over rows t >= q0, and how many of them can see each key (causal).

    Returns ``(sums (B, H, Tk) float64, counts (Tk,) int64)``; key j is seen by rows t >= j.
    """
    tq, tk = weights.shape[-2:]
    r0 = _first_row(tq, q_offset, q0)
    rows = weights[..., r0:, :]
    ones = rows.new_ones(*rows.shape[:-2], 1, rows.shape[-2])
    sums = torch.matmul(ones, rows).squeeze(-2).double()  # column sums by BLAS: (B, H, Tk)
    first_seen = (torch.arange(tk, device=weights.device) - q_offset).clamp(min=r0, max=tq)
    return sums, tq - first_seen


def sink_output_partial(
    weights: Tensor,
    value_norm: Tensor,
    output: Tensor,
    key: int = 0,
    q0: int = 0,
    q_offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """Sums over rows t >= max(key, q0) of ``||A[t,key] v_key||`` and ``||o_t||``: two (B, H).

    ``value_norm`` (B, H) is ``||v_key||``; ``output`` (B, H, Tq, D) the head's output rows.
    """
    r0 = _first_row(weights.shape[-2], q_offset, max(key, q0))
    part = weights[..., r0:, key].sum(-1).double() * value_norm.double()
    total = torch.linalg.vector_norm(output[..., r0:, :].float(), dim=-1).double().sum(-1)
    return part, total


def value_norm_partial(
    value: Tensor, key: int = 0, start: int = 0, end: int | None = None
) -> tuple[Tensor, Tensor, int]:
    """Over the keys ``start <= j < end``: ``||v_key||`` if key is among them (else 0), the sum
    of ``||v_j||`` over the others, and how many others: ``((B, H), (B, H), count)``.

    ``value`` (B, H, Tk, D). Summing over disjoint key ranges covering every key gives
    :func:`value_norm_ratio` as ``key_norm / (others / count)``.
    """
    end = value.shape[-2] if end is None else min(end, value.shape[-2])
    norms = torch.linalg.vector_norm(value[..., start:end, :].double(), dim=-1)  # (B, H, n)
    has_key = start <= key < end
    key_norm = norms[..., key - start] if has_key else norms.new_zeros(norms.shape[:-1])
    return key_norm, norms.sum(-1) - key_norm, norms.shape[-1] - int(has_key)


def ratio(total: Tensor, count: int | Tensor) -> Tensor:
    """``total / count`` as float32, NaN where the count is 0."""
    if isinstance(count, int):
        return (total / count).float() if count else torch.full_like(total, float("nan")).float()
    return (total / count.clamp_min(1)).masked_fill(count == 0, float("nan")).float()


# ----------------------------------------------------------------------------- attention metrics
def sink_mass(weights: Tensor, key: int = 0, q0: int = 0, q_offset: int = 0) -> Tensor:
    """Mean over queries t >= max(key, q0) of ``A[t, key]``: (B, H, Tq, Tk) -> (B, H).

    NaN where no query qualifies. With ``key = 0, q0 = 0`` this is Gu et al.'s alpha.
    """
    return ratio(*sink_mass_partial(weights, key, q0, q_offset))


def received_attention(weights: Tensor, q0: int = 0, q_offset: int = 0) -> Tensor:
    """Mean attention each key receives over the queries t >= q0 that can see it: -> (B, H, Tk)."""
    return ratio(*received_partial(weights, q0, q_offset))


def diagonal_mass(weights: Tensor, q0: int = 0, q_offset: int = 0) -> Tensor:
    """Mean over queries t >= q0 of ``A[t, t]`` (attention to itself): -> (B, H)."""
    return ratio(*diagonal_partial(weights, q0, q_offset))


def prev_token_mass(weights: Tensor, q0: int = 0, q_offset: int = 0) -> Tensor:
    """Mean over queries t >= max(1, q0) of ``A[t, t - 1]``: -> (B, H)."""
    return ratio(*prev_token_partial(weights, q0, q_offset))


def mean_entropy(weights: Tensor, q0: int = 0, q_offset: int = 0) -> Tensor:
    """Mean over queries t >= q0 of the entropy of row t, in nats: -> (B, H)."""
    return ratio(*entropy_partial(weights, q0, q_offset))


def value_norm_ratio(value: Tensor, key: int = 0) -> Tensor:
    """``||v_key|| / mean_{j != key} ||v_j||``: (B, H, Tk, D) -> (B, H). Small = near no-op sink."""
    norms = torch.linalg.vector_norm(value.double(), dim=-1)  # (B, H, Tk)
    others = (norms.sum(-1) - norms[..., key]) / max(1, norms.shape[-1] - 1)
    return (norms[..., key] / others).float()


def sink_output_share(
    weights: Tensor,
    value: Tensor,
    key: int = 0,
    q0: int = 0,
    q_offset: int = 0,
    output: Tensor | None = None,
) -> Tensor:
    """The sink's share of the output norm: ``sum_t ||A[t,key] v_key|| / sum_t ||o_t||``.

    Sums over queries t >= max(key, q0); ``value`` (B, H, Tk, D), ``output`` (B, H, Tq, D)
    defaults to ``weights @ value``. Ratio of sums (not a mean of ratios): robust to tiny outputs.
    -> (B, H).
    """
    out = torch.matmul(weights, value) if output is None else output
    vnorm = torch.linalg.vector_norm(value[..., key, :].double(), dim=-1)
    part, total = sink_output_partial(weights, vnorm, out, key, q0, q_offset)
    return (part / total).float()


def head_kind(
    sink: Tensor | Sequence,
    diagonal: Tensor | Sequence,
    prev: Tensor | Sequence,
    floor: float = 0.3,
) -> list:
    """Classify heads by the largest of sink, diagonal and previous-token mass.

    Any shape (e.g. (L, H)) in, the same nesting of strings out; a head whose largest mass is
    below ``floor`` (or NaN) is ``"mixed"`` (dense or something else).
    """
    masses = torch.stack([torch.as_tensor(x, dtype=torch.float32) for x in (sink, diagonal, prev)])
    best, idx = masses.nan_to_num(-1.0).max(0)
    names = [HEAD_KINDS[i] for i in idx.flatten().tolist()]
    low = (best < floor).flatten().tolist()
    flat = [HEAD_KINDS[3] if lo else nm for nm, lo in zip(names, low, strict=True)]
    out = torch.arange(len(flat)).reshape(best.shape).tolist()

    def fill(x):
        return [fill(v) for v in x] if isinstance(x, list) else flat[x]

    return fill(out)


def sink_rate(sink_mass: Tensor, eps: float) -> float:
    """Fraction of (layer, head) pairs with sink mass > eps; NaN masses count as not sinks."""
    m = torch.as_tensor(sink_mass, dtype=torch.float32)
    return float((m > eps).float().mean()) if m.numel() else float("nan")


def sink_positions(
    received: Tensor, q0: int = 0, factor: float = 5.0, top: int = 8
) -> list[dict[str, float | int]]:
    """Keys whose received attention is far above both uniform and typical.

    ``received`` (..., Tk) is averaged over leading dims (layers, heads). Key j is a sink position
    when its mean received attention exceeds ``factor`` times the larger of (a) what causal
    uniform attention would give it (mean over t >= max(j, q0) of 1/(t+1)) and (b) the median over
    keys. Only keys seen by at least ``max(16, Tk // 16)`` queries t >= q0 are candidates: the
    last few keys are seen by a handful of queries that mostly attend locally (diagonal,
    previous token), which says nothing about sinks. Returns up to ``top`` ``{"position",
    "mass"}`` by decreasing mass.
    """
    r = received.double().reshape(-1, received.shape[-1]).nanmean(0)  # (Tk,)
    tk = r.shape[0]
    seen_by = tk - torch.clamp(torch.arange(tk), min=q0)  # queries t >= max(j, q0)
    inv = 1.0 / torch.arange(1, tk + 1, dtype=torch.float64)
    tail = inv.flip(0).cumsum(0).flip(0)  # sum_{t >= j} 1/(t+1)
    start = torch.clamp(torch.arange(tk), min=q0)
    uniform = torch.where(
        start < tk, tail[start.clamp(max=tk - 1)] / (tk - start).clamp(min=1), torch.nan
    )
    base = torch.maximum(uniform, r.nanmedian().expand(tk)) * factor
    hits = torch.nonzero((r > base) & (seen_by >= max(16, tk // 16))).flatten().tolist()
    hits.sort(key=lambda j: -float(r[j]))
    return [{"position": int(j), "mass": float(r[j])} for j in hits[:top]]


# ------------------------------------------------------------------- (layer, head) tables
def _flat(values: Any) -> list[Any]:
    if isinstance(values, Tensor):
        return values.flatten().tolist()
    if isinstance(values, list | tuple):
        return [x for v in values for x in _flat(v)]
    return [values]


def nan_mean(values: Tensor | Sequence[Any]) -> float:
    """Mean of ``values`` (a tensor or nested lists of numbers), NaN-skipping: a NaN entry (a head
    with no counted query) or None (a site not measured) is left out, never counted as 0; NaN
    when nothing is left."""
    kept = [float(v) for v in _flat(values) if v is not None and v == v]
    return sum(kept) / len(kept) if kept else math.nan


def layer_means(table: Tensor | Sequence[Sequence[float]]) -> list[float]:
    """(L, H) -> the mean over heads of each layer, NaN-skipping (:func:`nan_mean`)."""
    return [nan_mean(row) for row in table]


def top_heads(table: Tensor | Sequence[Sequence[float]], top: int) -> list[tuple[int, int, float]]:
    """(L, H) -> the ``top`` (layer, head, value) with the largest values, largest first (ties in
    (layer, head) order); NaN heads are left out."""
    cells = [
        (layer, head, float(v))
        for layer, row in enumerate(table)
        for head, v in enumerate(_flat(row))
        if v == v
    ]
    return sorted(cells, key=lambda c: -c[2])[:top]


# ----------------------------------------------------------------------------- hidden states
def _unit(hidden: Tensor) -> Tensor:
    h = hidden.double()
    return h / torch.linalg.vector_norm(h, dim=-1, keepdim=True).clamp_min(1e-30)


def _first_cos_of(u: Tensor) -> float:
    """Mean over j >= 1 of ``u_0 . u_j`` for unit rows ``u`` (T, d)."""
    return float((u[1:] @ u[0]).mean()) if u.shape[0] > 1 else float("nan")


def _pair_cos_of(u: Tensor) -> float:
    """Mean over i != j of ``u_i . u_j`` for unit rows ``u`` (n, d), in O(n d):
    ``sum_{i != j} u_i . u_j = ||sum_i u_i||^2 - sum_i ||u_i||^2``."""
    n = u.shape[0]
    if n < 2:
        return float("nan")
    s = u.sum(0)
    return float((s @ s - (u * u).sum()) / (n * (n - 1)))


def first_token_cosine(hidden: Tensor) -> float:
    """Mean over j >= 1 of ``cos(h_0, h_j)``: (T, d) -> float."""
    return _first_cos_of(_unit(hidden))


def token_similarity(hidden: Tensor, skip_first: bool = True) -> float:
    """Mean pairwise cosine over i != j (i, j >= 1 when ``skip_first``): (T, d) -> float.

    O(T d): ``sum_{i != j} u_i . u_j = ||sum_i u_i||^2 - n`` for unit vectors u.
    """
    return _pair_cos_of(_unit(hidden[1:] if skip_first else hidden))


def cosines(hidden: Tensor) -> tuple[float, float]:
    """``(first_token_cosine, token_similarity)`` of (T, d) from one set of unit vectors (each
    row is normalised on its own, so the rows 1.. of the whole set are those of ``hidden[1:]``):
    half the work of calling both."""
    u = _unit(hidden)
    return _first_cos_of(u), _pair_cos_of(u[1:])


def first_token_norm_ratio(hidden: Tensor) -> float:
    """``||h_0|| / median_{j >= 1} ||h_j||`` (massive activations): (T, d) -> float."""
    norms = torch.linalg.vector_norm(hidden.double(), dim=-1)
    return float(norms[0] / norms[1:].median()) if hidden.shape[0] > 1 else float("nan")
