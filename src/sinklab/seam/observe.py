"""The observation path: attention through one fused kernel that also returns its log-sum-exp,
for handlers that only read a few weights per query. No block of weights is ever formed: memory
stays linear in the sequence length, and the cost is about that of the forward.

With logits ``z[t, j] = s q_t . k_j`` and ``lse_t = log sum_{j <= t} exp z[t, j]`` (returned by
the fused kernel beside the output ``o_t``; docs/metrics.md#how-the-probe-reads-attention):

* ``A[t, j] = exp(z[t, j] - lse_t)`` for the few columns a metric needs (a sink key, the
  diagonal, the previous token): O(T D) each;
* the column sums ``c_j = sum_{t >= j} A[t, j]`` (attention each key receives) as
  ``exp(lse'_j)`` of a second fused call with the roles swapped: queries ``[k_j, 1]``, keys
  ``[s q_t, -lse_t]``, scale 1, both reversed in time so the causal mask reads ``t >= j``;
* in the same second call, with the keys ``[s q_t, -lse_t]`` also as values, the output
  ``o'_j = sum_t A[t, j] [s q_t, -lse_t] / c_j`` gives ``sum_t sum_j A[t, j] z[t, j] =
  sum_j c_j k_j . o'_j``, so the summed row entropy ``sum_t -sum_j A log A = sum_t m_t lse_t -
  sum_t sum_j A[t, j] z[t, j]`` (``m_t = sum_j A[t, j]``: 1 for softmax, ``1 - exp(lambda -
  lse_t)`` with a sink slot of logit lambda) costs nothing more.

softmax1 and a learned sink logit (gpt-oss ``s_aux``) add the sink slot as one more key
(:func:`sinklab.attention._with_sink_key`), so ``lse`` counts it exactly. What this path does not
serve goes to the block path (:mod:`sinklab.seam.blocks`) with the reason: :func:`route`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sinklab.attention import _with_sink_key

FUSED, BLOCK = "fused", "block"
#: weight variants with a log-sum-exp form (a sink slot is one more key)
LSE_VARIANTS = ("softmax", "softmax1", "sink")
#: what a handler may ask the observation path to compute beyond a few columns; both come from
#: the one swapped call (module docstring)
NEEDS = ("entropy", "received")


@dataclass(frozen=True)
class Route:
    """Which path one layer's attention took, and why it was not the fused one."""

    path: str  # FUSED or BLOCK
    reason: str = ""

    def __str__(self) -> str:
        return self.path if not self.reason else f"{self.path}: {self.reason}"


def lse_kernel_missing(device: torch.device) -> str | None:
    """Why ``device`` has no fused attention kernel returning the log-sum-exp (None: it has)."""
    if device.type in ("cpu", "cuda"):
        return None
    return f"no fused attention kernel with a log-sum-exp on {device.type}"


def route(
    handlers: list[Any],  # sinklab.seam.handlers.AttentionHandler (it imports this module)
    *,
    variant: str,
    softcap: float | None,
    masked: bool,
    sliding_window: int | None,
    tq: int,
    tk: int,
    device: torch.device,
) -> Route:
    """The path a layer's attention takes with ``handlers`` active: fused when every handler only
    observes (``fused_needs`` is set) and the weights have a log-sum-exp form under a plain
    causal mask; else the block path, with the first reason found. ``masked``: transformers
    passed an explicit mask (not the plain causal pattern)."""
    for h in handlers:
        if h.fused_needs is None:
            return Route(BLOCK, f"{type(h).__name__} reads or changes the weights block by block")
    if softcap is not None:
        return Route(BLOCK, f"logit softcapping ({softcap:g}) has no log-sum-exp kernel")
    if variant not in LSE_VARIANTS:
        return Route(BLOCK, f"the {variant} variant has no log-sum-exp form")
    if masked:
        if sliding_window is not None:
            return Route(BLOCK, f"sliding window of {sliding_window} keys (an explicit mask)")
        return Route(BLOCK, "an explicit attention mask (not plain causal)")
    if tq != tk:
        return Route(BLOCK, f"{tq} queries over {tk} keys (a cache), not one causal forward")
    missing = lse_kernel_missing(device)
    return Route(BLOCK, missing) if missing else Route(FUSED)


def _pad_to(x: Tensor, width: int) -> Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def fused_lse(q: Tensor, k: Tensor, v: Tensor, *, scale: float) -> tuple[Tensor, Tensor]:
    """Causal attention through one fused kernel, with its log-sum-exp.

    ``q`` (B, H, Tq, D), ``k`` (B, H, Tk, D), ``v`` (B, H, Tk, Dv), the causal mask top-left
    aligned (query ``i`` sees keys ``0..i``). Returns ``(out (B, H, Tq, Dv), lse (B, H, Tq))``,
    ``lse`` in float32 (float64 for float64 inputs), natural log. CPU: the flash kernel (it wants
    equal head dims: the narrower ones are zero-padded, which changes no logit); CUDA: the
    memory-efficient kernel (head dims padded to a multiple of 8).
    """
    dv = v.shape[-1]
    if q.device.type == "cpu":
        width = max(q.shape[-1], dv)
        q, k, v = (_pad_to(x, width) for x in (q, k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True, scale=scale
        )
    elif q.device.type == "cuda":
        qk_width = -(-q.shape[-1] // 8) * 8
        q, k = _pad_to(q, qk_width), _pad_to(k, qk_width)
        v = _pad_to(v, -(-dv // 8) * 8)
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, True, scale=scale
        )
        lse = lse[..., : q.shape[-2]]  # the kernel pads the query axis of lse
    else:  # route() sends such layers to the block path
        raise RuntimeError(lse_kernel_missing(q.device))
    return out[..., :dv], lse


def _work(x: Tensor) -> Tensor:
    """float32 for half types; float32/64 unchanged."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@dataclass
class LayerView:
    """One layer's attention as observers on the fused path see it (no weights are stored).

    ``query`` (B, H, T, D), ``key``/``value`` (B, H, T, D), KV heads already repeated; ``output``
    (B, H, T, Dv); ``lse`` (B, H, T), counting the sink slot where there is one; ``sink_logit``
    (H,) the sink slot's logit (0 for softmax1), None for plain softmax. Query ``t`` sits at
    position ``t``.
    """

    layer: int
    module: nn.Module
    query: Tensor
    key: Tensor
    value: Tensor
    output: Tensor
    lse: Tensor
    scale: float
    sink_logit: Tensor | None = None
    _memo: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def n_tokens(self) -> int:
        return int(self.query.shape[-2])

    def _q(self) -> Tensor:
        if "q" not in self._memo:
            self._memo["q"] = _work(self.query) * self.scale  # (B, H, T, D)
        return self._memo["q"]

    def weights_at(self, col: int) -> Tensor:
        """``A[t, col]`` for every query t: (B, H, T); rows ``t < col`` (which cannot see the
        key) hold 0."""
        if ("col", col) not in self._memo:
            k = _work(self.key[:, :, col])  # (B, H, D)
            z = torch.einsum("bhtd,bhd->bht", self._q(), k)
            a = torch.exp(z - self.lse)
            a[..., :col] = 0.0
            self._memo[("col", col)] = a
        return self._memo[("col", col)]

    def diagonal(self, shift: int = 0) -> Tensor:
        """``A[t, t - shift]`` for the queries ``t >= shift``: (B, H, T - shift)."""
        t = self.n_tokens
        k = _work(self.key[:, :, : t - shift])
        z = (self._q()[:, :, shift:] * k).sum(-1)
        return torch.exp(z - self.lse[..., shift:])

    def mass(self) -> Tensor | None:
        """``m_t = sum_j A[t, j]`` over the real keys: (B, H, T), or None where it is 1."""
        if self.sink_logit is None:
            return None
        lam = self.sink_logit.to(self.lse.device, self.lse.dtype).view(1, -1, 1)
        return -torch.expm1(lam - self.lse)  # 1 - the sink slot's weight

    def _swapped(self, q0: int) -> tuple[Tensor, Tensor]:
        """The swapped call over the queries ``t >= q0`` (module docstring): the column sums
        (B, H, T) and ``sum_t sum_j A[t, j] z[t, j]`` (B, H), float64."""
        if ("swapped", q0) not in self._memo:
            q, lse = self._q(), self.lse.to(self._q().dtype)
            keys = torch.cat([q, -lse[..., None]], -1)[:, :, q0:].flip(2)  # t = T-1 .. q0
            k = _work(self.key)
            queries = torch.cat([k, torch.ones_like(k[..., :1])], -1).flip(2)  # j = T-1 .. 0
            out, lse2 = fused_lse(queries, keys, keys, scale=1.0)
            sums = lse2.flip(2).double().exp()  # c_j: (B, H, T)
            mixed = (k.double() * out[..., : k.shape[-1]].flip(2).double()).sum(-1)  # k_j . o'_j
            self._memo[("swapped", q0)] = (sums, (sums * mixed).sum(-1))
        return self._memo[("swapped", q0)]

    def column_sums(self, q0: int = 0) -> Tensor:
        """``sum_{t >= max(j, q0)} A[t, j]`` for every key j: (B, H, T) float64."""
        return self._swapped(q0)[0]

    def entropy_sum(self, q0: int = 0) -> Tensor:
        """``sum_{t >= q0}`` of the row entropy ``-sum_j A[t, j] log A[t, j]`` (nats, over the
        real keys): (B, H) float64."""
        lse = self.lse[..., q0:].double()
        mass = self.mass()
        first = (lse if mass is None else mass[..., q0:].double() * lse).sum(-1)
        return first - self._swapped(q0)[1]


def observe_attention(
    module: nn.Module,
    layer: int,
    handlers: list[Any],  # sinklab.seam.handlers.AttentionHandler (it imports this module)
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float,
    variant: str,
    sink_logit: Tensor | None,
) -> Tensor:
    """Causal attention output (B, H, T, Dv) through one fused kernel; every handler's
    ``observe_layer`` sees the layer's :class:`LayerView` (keys and values: KV heads repeated)."""
    lam = None
    if variant == "softmax":
        out, lse = fused_lse(query, key, value, scale=scale)
    else:  # the sink slot as one more key, first, seen by a dummy query row 0 (dropped)
        h = query.shape[1]
        given = sink_logit if variant == "sink" and sink_logit is not None else 0.0
        lam = torch.as_tensor(given, device=query.device).to(lse_dtype(query)).expand(h)
        q2, k2, v2 = _with_sink_key(query, key, value, given, scale, prepend=True)
        out, lse = fused_lse(q2, k2, v2, scale=scale)
        out, lse = out[:, :, 1:, : value.shape[-1]], lse[:, :, 1:]
    view = LayerView(layer, module, query, key, value, out, lse, scale, sink_logit=lam)
    for handler in handlers:
        handler.observe_layer(view)
    return view.output


def lse_dtype(x: Tensor) -> torch.dtype:
    """The dtype the kernels return the log-sum-exp in for inputs like ``x``."""
    return torch.promote_types(x.dtype, torch.float32)
