"""Chunked streaming evaluation: StreamingLLM's token-by-token NLLs, computed C queries at a time.

Why it is exact. In the step loop (:func:`~sinklab.stream.evaluate.stream_nll`) every token's
keys and values at every layer are computed once, when it is read, from what it attended to then:
the kept positions plus itself, at cache-relative positions. With the sink cache, what query ``t``
reads is

* the contiguous run ``lo(t) .. t`` (the recent window, any sink inside it, and ``t`` itself), at
  the distances ``t - p`` the text gives them, and
* the sinks before ``lo(t)`` ("detached"), sink ``j`` (j-th smallest) at cache index ``j``, so at
  distance ``n_kept(t) - j`` from the query (``n_kept(t) = n_sb(t) + t - lo(t)``, with ``n_sb``
  the number of detached sinks).

So one forward over a chunk of queries ``t0 .. t1-1`` gives the same keys, values and logits
when each query row gets its own band mask ``lo(t) <= p <= t`` over the stored recent keys plus
the chunk, and the detached sinks are scored with the query rotated back by
``off(t) = lo(t) - n_sb(t)`` positions against the sink keys rotated to their indices ``j``
(a RoPE score depends only on the difference of positions). The model runs its own forward at the
stream's positions (as the step loop does); only attention goes through the function registered
here with transformers' ``AttentionInterface`` (:data:`BAND_ATTN`), and the rotation is
:class:`~sinklab.models.rotary.Rope`'s.

Layer by layer (:func:`layer_bands`), as the step loop's cache layers keep them: a hybrid model's
sliding layer (Gemma 2/3, gpt-oss, OLMo 3, Cohere 2) keeps the model's own window of ``W``
tokens, so its band is ``lo(t) = t - W + 1`` with no sinks and its keys are never moved but by a
rebase (with that layer type's RoPE); a NoPE layer (SmolLM3) scores its sinks unrotated;
gpt-oss's learned sink logits join every row's softmax as one more key with no value. Layers with
the same band share one plan per chunk.

Memory: the kept keys and values (the recent window and the sinks per layer) plus one chunk's
``C x (kept + C)`` scores; never ``T x T``. ``dense`` keeps every key (as its cache does) and
scores ``C x t`` per chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sinklab.attention import sink_softmax
from sinklab.errors import SinklabError, check_positive
from sinklab.models.arch import attention_modules, decoder_config, input_device, layer_kinds
from sinklab.models.rotary import Rope
from sinklab.progress import Progress, quiet
from sinklab.seam import bound_handlers, check_supported
from sinklab.stream.cache import CacheConfig, SinkCache

BAND_ATTN = "sinklab_band"
DEFAULT_CHUNK = 256  # queries per forward


# ------------------------------------------------------------------ the plan (pure, positions)
def window_starts(t0: int, t1: int, sinks: tuple[int, ...], recent: int | None) -> Tensor:
    """``lo(t)`` for ``t`` in ``t0..t1-1``: query ``t`` reads the contiguous run ``lo(t)..t`` and
    the sinks before ``lo(t)``. (``kept_positions(t, sinks, recent)`` = sinks < lo + lo..t-1.)"""
    t = torch.arange(t0, t1)
    if recent is None:
        return torch.zeros_like(t)
    sink_t = torch.tensor(sorted(sinks), dtype=torch.long)
    n_sinks_before = (sink_t[None, :] < t[:, None]).sum(1)
    n_other = t - n_sinks_before  # non-sink positions before t
    every = torch.arange(max(t1, 1))
    others = every[~torch.isin(every, sink_t)]  # non-sink positions in stream order
    others = torch.cat((others, torch.zeros(1, dtype=torch.long)))  # never empty
    evicted = n_other > recent
    idx = (n_other - recent).clamp(min=0)
    return torch.where(evicted, others[idx.clamp(max=others.numel() - 1)], torch.zeros_like(t))


@dataclass
class ChunkPlan:
    """What every layer does for the chunk ``t0..t1-1`` (planned once, shared by all layers)."""

    t0: int
    t1: int
    p0: int  # first stored recent position (keys p0..t0-1 are kept from earlier chunks)
    p0_next: int  # first position the next chunk still needs
    band: Tensor  # bool (C, t1 - p0): query row may read key p0 + k
    sinks: list[int]  # sink positions < t1 (all have a stored, re-indexed key after this plan)
    new_sinks: list[int]  # those read in this chunk
    sink_mask: Tensor | None  # bool (C, S): sink j is detached for the row (None: none is)
    off: Tensor | None  # (C,) positions the query is rotated back by to score the sinks


def plan_chunk(
    t0: int, t1: int, p0: int, sinks: tuple[int, ...], recent: int | None, base: int = 0
) -> ChunkPlan:
    """The chunk of queries ``t0..t1-1``, which the model reads at positions ``t - base``."""
    lo = window_starts(t0, t1 + 1, sinks, recent)
    lo, lo_next = lo[:-1], int(lo[-1])
    t = torch.arange(t0, t1)
    kpos = torch.arange(p0, t1)
    band = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] <= t[:, None])
    seen = [s for s in sorted(sinks) if s < t1]
    new = [s for s in seen if s >= t0]
    sink_mask = off = None
    if seen:
        st = torch.tensor(seen)
        detached = st[None, :] < lo[:, None]  # (C, S)
        if bool(detached.any()):
            sink_mask, off = detached, lo - detached.sum(1) - base
    return ChunkPlan(t0, t1, p0, lo_next, band, seen, new, sink_mask, off)


# ------------------------------------------------------------------ per-layer state
@dataclass(frozen=True)
class LayerBand:
    """What one layer's queries read, as the step loop's cache layer gives it: the ``sinks``
    plus the ``recent`` most recent other positions (None: every position), keys rotated by
    ``rope`` (None: nothing is ever rotated: a NoPE layer, or ``dense``, which moves no key)."""

    sinks: tuple[int, ...]
    recent: int | None
    rope: Rope | None


def layer_bands(model: nn.Module, cache: SinkCache) -> list[LayerBand]:
    """Per layer, what the step loop through ``cache`` lets its queries read.

    * a layer whose own sliding window of ``W`` tokens the step loop applies (a hybrid model's
      sliding layer under a bounded cache: transformers' ``DynamicSlidingWindowLayer``, keys
      never moved; or any windowed layer under ``dense``: the model's own mask over every key)
      reads the ``W - 1`` positions before the query, no sinks, keys as the model rotated them;
    * every other layer reads the sink cache's sinks + recent window; where every layer slides
      (Mistral v0.1) the sink cache fits inside the model's window
      (:func:`~sinklab.models.arch.check_windows`), which therefore never cuts it."""
    kinds = layer_kinds(decoder_config(model))
    bounded = cache.capacity is not None
    bands = []
    for kind in kinds:
        if kind.window is not None and (cache.hybrid or not bounded):
            rope = cache.sliding_rope if kind.rotary else None
            bands.append(LayerBand((), kind.window - 1, rope))
        else:
            rope = cache.rope if kind.rotary else None
            bands.append(LayerBand(cache.config.sinks, cache.config.recent, rope))
    return bands


class BandState:
    """The kept keys/values of every layer between chunks: recent positions ``p0..t0-1`` of the
    layer's band (as the model rotated them, at their own positions) and the sinks (rotated to
    their indices j). Layers with the same band share one plan per chunk."""

    def __init__(self, bands: list[LayerBand]) -> None:
        self.bands = bands
        self.groups = list(dict.fromkeys((b.sinks, b.recent) for b in bands))
        self.group = [self.groups.index((b.sinks, b.recent)) for b in bands]
        self.p0 = [0] * len(self.groups)  # per group: first stored recent position
        n_layers = len(bands)
        self.k: list[Tensor | None] = [None] * n_layers
        self.v: list[Tensor | None] = [None] * n_layers
        self.sink_k: list[Tensor | None] = [None] * n_layers
        self.sink_v: list[Tensor | None] = [None] * n_layers
        self.plans: list[ChunkPlan] = []

    def plan(self, t0: int, t1: int, base: int) -> None:
        """Plan the chunk of queries ``t0..t1-1`` (read at positions ``t - base``), per group."""
        self.plans = [
            plan_chunk(t0, t1, p0, sinks, recent, base)
            for p0, (sinks, recent) in zip(self.p0, self.groups, strict=True)
        ]

    def advance(self) -> None:
        """After the chunk: each group keeps from the first position the next chunk needs."""
        self.p0 = [p.p0_next for p in self.plans]

    def rebase(self, shift: int) -> None:
        """Positions restart lower by ``shift``: rotate every layer's recent keys back, each by
        its own RoPE (O(kept), once; the sinks live at their indices and do not move)."""
        for i, k in enumerate(self.k):
            rope = self.bands[i].rope
            if k is not None and k.shape[-2] and rope is not None:
                self.k[i] = rope.shift(k, torch.full((k.shape[-2],), -shift))

    def kept_bytes(self) -> int:
        tensors = [*self.k, *self.v, *self.sink_k, *self.sink_v]
        return sum(x.numel() * x.element_size() for x in tensors if x is not None)

    def attend(
        self,
        layer: int,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        scale: float,
        softcap: float | None,
        sink_logit: Tensor | None = None,
    ) -> Tensor:
        """query (B, H, C, D), key/value (B, Hkv, C, D) of the chunk -> output (B, H, C, D).
        ``sink_logit`` (H,): gpt-oss's learned logit of an extra key with no value."""
        assert self.plans, "no chunk planned"
        plan, rope = self.plans[self.group[layer]], self.bands[layer].rope
        if plan.new_sinks:  # index j among all sinks; shift from own position s to j
            j0 = len(plan.sinks) - len(plan.new_sinks)
            at = torch.tensor([s - plan.t0 for s in plan.new_sinks], device=key.device)
            nk, nv = key.index_select(-2, at), value.index_select(-2, at)
            delta = torch.tensor([j0 + i - s for i, s in enumerate(plan.new_sinks)])
            if rope is not None and bool(delta.any()):
                nk = rope.shift(nk, delta)
            old_k, old_v = self.sink_k[layer], self.sink_v[layer]
            self.sink_k[layer] = nk if old_k is None else torch.cat((old_k, nk), -2)
            self.sink_v[layer] = nv if old_v is None else torch.cat((old_v, nv), -2)
        past_k, past_v = self.k[layer], self.v[layer]
        kb = key if past_k is None else torch.cat((past_k, key), -2)  # positions p0..t1-1
        vb = value if past_v is None else torch.cat((past_v, value), -2)
        keep = plan.p0_next - plan.p0
        self.k[layer], self.v[layer] = kb[:, :, keep:], vb[:, :, keep:]
        band = plan.band.to(query.device)
        if plan.sink_mask is None and softcap is None and sink_logit is None:
            out = F.scaled_dot_product_attention(
                query, kb, vb, attn_mask=band, scale=scale, enable_gqa=True
            )
            return out
        return self._attend_with_sinks(layer, plan, query, kb, vb, band, scale, softcap, sink_logit)

    def _attend_with_sinks(
        self, layer, plan, query, kb, vb, band, scale, softcap, sink_logit
    ) -> Tensor:
        b, h, c, d = query.shape
        hkv = kb.shape[1]
        grouped = (b, hkv, (h // hkv) * c, d)  # query head h reads kv head h // (H / Hkv)
        scores = (query * scale).reshape(grouped) @ kb.transpose(-1, -2)  # (B, Hkv, r*C, K)
        masks, values = [band], [vb]
        if plan.sink_mask is not None:
            sk, sv = self.sink_k[layer], self.sink_v[layer]
            assert sk is not None and sv is not None and plan.off is not None
            rope = self.bands[layer].rope
            qs = query * scale if rope is None else rope.shift(query * scale, -plan.off)
            sink_scores = qs.reshape(grouped) @ sk.transpose(-1, -2)  # (B, Hkv, r*C, S)
            scores = torch.cat((sink_scores, scores), -1)
            masks, values = [plan.sink_mask.to(query.device), band], [sv, vb]
        mask = torch.cat(masks, -1)  # (C, S + K), the same for every head
        scores = scores.reshape(b, h, c, -1)  # rows of a kv group are (head, query): a view
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if sink_logit is None:
            work = torch.promote_types(scores.dtype, torch.float32)
            weights = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=work)
        else:  # gpt-oss: one more key per head, logit sink_logit[h], no value (dropped)
            weights = sink_softmax(scores, mask, sink_logit)
        weights = weights.to(vb.dtype).reshape(b, hkv, -1, mask.shape[-1])
        out = weights @ torch.cat(values, -2)  # (B, Hkv, r*C, D)
        return out.reshape(b, h, c, d)


# ------------------------------------------------------------------ the registered function
# attention module -> (state, layer); weak keys, like sinklab.seam.binding: a module that is gone
# leaves nothing behind, and an id() reused by a new module can never see a stale state
_STATES: WeakKeyDictionary[nn.Module, tuple[BandState, int]] = WeakKeyDictionary()


def band_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The function registered as :data:`BAND_ATTN`: ``(output (B, C, H, D), None)``."""
    bound = _STATES.get(module)
    if bound is None:
        raise SinklabError(f"{BAND_ATTN} attention used outside sinklab.stream.band.band_attention")
    state, layer = bound
    sink_logit = kwargs.get("s_aux")  # gpt-oss's learned sink logits (H,)
    if getattr(module, "attention_variant", "softmax") != "softmax":
        raise SinklabError(f"chunked streaming: {VARIANT}; {STEP}")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out = state.attend(layer, query, key, value, scale, kwargs.get("softcap"), sink_logit)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :data:`BAND_ATTN` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(BAND_ATTN, band_attention_forward)
    AttentionMaskInterface.register(BAND_ATTN, sdpa_mask)  # the model's own mask is unused


@contextmanager
def band_attention(model: nn.Module, state: BandState) -> Iterator[nn.Module]:
    """Route ``model``'s attention through :data:`BAND_ATTN` with ``state``; restore on exit."""
    register()
    check_supported(model)
    layers = attention_modules(model)  # sinklab.models.arch: index = layer
    if not layers:
        raise SinklabError(f"no attention layers found in {type(model).__name__}")
    previous = model.config._attn_implementation
    for i, m in enumerate(layers):
        _STATES[m] = (state, i)
    try:
        model.set_attn_implementation(BAND_ATTN)
        yield model
    finally:
        for m in layers:
            _STATES.pop(m, None)
        model.set_attn_implementation(previous)


# ------------------------------------------------------------------ what it serves
STEP = "use --method step"
VARIANT = "it serves softmax attention (and gpt-oss's learned sink logits), not the lab's variants"


def chunked_refusal(model: nn.Module, cache_config: CacheConfig) -> str | None:
    """Why :func:`chunked_nll` cannot stream ``model`` with ``cache_config``, in one line, or None
    when it can: decided from the config and modules alone, before any forward. The reasons, in
    the order they are checked: what :class:`SinkCache` refuses (the step loop refuses it too); a
    model whose attention does not go through transformers' ``AttentionInterface``, or whose
    layers' attention modules cannot be found; attention that is neither plain softmax nor
    softmax with learned sink logits (the lab's variants); attention handlers bound to the model
    (an intervention of :mod:`sinklab.seam.interventions`, or any other handler): the band
    function scores each query against its own kept keys and never forms the weights a handler
    changes or reads, so it refuses rather than silently ignore them, and ``auto`` takes the step
    loop, which runs them on the cache's keys (docs/streaming.md#methods). Sliding-window layers
    (every layer or some: :func:`layer_bands`), NoPE layers and gpt-oss's sink logits are
    served."""
    try:
        SinkCache(model, cache_config)  # the same refusals (architecture, sizes) as step
    except SinklabError as exc:
        return str(exc)
    try:
        check_supported(model)
    except SinklabError as exc:
        return str(exc)
    bound = next((h for m in model.modules() for h in bound_handlers(m)), None)
    if bound is not None:
        return (
            f"chunked streaming does not run attention handlers, and {type(bound).__name__} is "
            f"bound to this model (an intervention, e.g. mask_sink or attention_mix); {STEP}"
        )
    modules = attention_modules(model)
    if modules is None:
        return (
            f"chunked streaming cannot find each layer's attention module in "
            f"{type(model).__name__}; {STEP}"
        )
    for m in modules:
        if getattr(m, "attention_variant", "softmax") != "softmax":
            name = type(m).__name__
            return f"chunked streaming: {name} uses another attention variant; {VARIANT}; {STEP}"
    return None


# ------------------------------------------------------------------ the loop
def most_kept(n_seen: int, sinks: tuple[int, ...], recent: int | None) -> int:
    """``len(kept_positions(n_seen, sinks, recent))`` without listing them (it never shrinks)."""
    if recent is None:
        return n_seen
    n_sinks = sum(1 for s in sinks if s < n_seen)
    return n_sinks + min(recent, n_seen - n_sinks)


@torch.inference_mode()
def chunked_nll(
    model: Any,
    ids: Tensor,
    cache_config: CacheConfig,
    chunk: int = DEFAULT_CHUNK,
    progress: Progress = quiet,
    rss: Callable[[], float] | None = None,
    out: Tensor | None = None,
    on_logits: Callable[[int, Tensor], None] | None = None,
) -> tuple[Tensor, int, float]:
    """The step loop's result, ``chunk`` queries per forward: ``ids`` (T,) -> (nll (T-1,), most
    positions cached, peak sampled RSS MiB). Refuses what :class:`SinkCache` refuses. ``out``
    (T-1,) float64, if given, is filled chunk by chunk; ``progress(done, total, note)`` (the one
    :data:`~sinklab.progress.Progress`: targets, the running perplexity in the note) after each.
    ``on_logits(t0, logits)``, if given, gets each forward's float32 logits (t1 - t0, V): row
    ``i`` is the distribution of ``ids[t0 + i + 1]`` given ``ids[: t0 + i + 1]`` under the cache
    (how the vLLM tests read sinklab's distributions along another engine's stream).

    Positions: the step loop's (:meth:`SinkCache.prepare`): below ``max_position`` (the model's
    ``max_position_embeddings``) for every bounded policy; before the token that would reach it,
    positions restart at ``kept`` (the stored keys rotated back once). Chunks end there."""
    check_positive({"chunk": chunk})
    reason = chunked_refusal(model, cache_config)
    if reason is not None:
        raise SinklabError(reason)
    cache = SinkCache(model, cache_config)
    sinks, recent = cache.config.sinks, cache.config.recent
    state = BandState(layer_bands(model, cache))
    dev = input_device(model)
    ids = ids.reshape(-1)
    n = ids.numel() - 1
    nll = torch.empty(n, dtype=torch.float64) if out is None else out
    sample = rss or (lambda: 0.0)
    bound = cache.max_position if cache.capacity is not None else None
    peak, total, base, t0 = sample(), 0.0, 0, 0
    with band_attention(model, state):
        while t0 < n:
            t1 = min(n, t0 + chunk)
            if bound:
                if t0 - base >= bound:  # SinkCache's rebase, before reading t0
                    shift = t0 - most_kept(t0, sinks, recent) - base
                    state.rebase(shift)
                    base += shift
                t1 = min(t1, base + bound)  # every position t - base stays below the bound
            state.plan(t0, t1, base)
            pos = torch.arange(t0 - base, t1 - base, device=dev)[None]
            logits = model(ids[t0:t1][None].to(dev), position_ids=pos, use_cache=False).logits
            lg = logits[0].float()
            if on_logits is not None:
                on_logits(t0, lg)
            target = ids[t0 + 1 : t1 + 1].to(lg.device)  # the LM head's device
            part = torch.logsumexp(lg, -1) - lg.gather(-1, target[:, None])[:, 0]
            nll[t0:t1] = part.double().cpu()
            total += float(part.double().sum())
            state.advance()
            t0 = t1
            peak = max(peak, sample())
            progress(t1, n, f"ppl {math.exp(total / t1):.2f}")
    return nll, most_kept(n, sinks, recent), peak
