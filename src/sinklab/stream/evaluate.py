"""Streaming perplexity with StreamingLLM's protocol, the recompute oracle, sink-auto's choice of
sinks, and bounded-memory generation.

Protocol (Xiao et al., StreamingLLM): feed the text one token at a time; after reading token
``t`` score token ``t + 1`` from the logits, then let the cache evict. Policies:

* ``dense``: keep everything (memory grows; quality collapses past the trained length);
* ``window``: the ``n_sink + window`` most recent tokens, no sinks (same memory as ``sink``);
* ``sink``: tokens 0..n_sink-1 plus the ``window`` most recent (StreamingLLM);
* ``sink-auto``: ``n_sink`` sinks chosen where the probe measures attention sinks on the prefix
  (the first ``min(probe_tokens, n_sink + window)`` tokens, so nothing is chosen from the future);
* ``recompute``: the oracle. For each scored target, a fresh forward over exactly the tokens the
  ``sink`` cache keeps, at positions 0..n. It differs from ``sink`` only in that deeper layers'
  keys and values are recomputed in the current context. ``--n-sink 0`` is not allowed, so the
  paper's sink-less "sliding window with re-computation" is not offered. Slow: ``recompute_every
  K`` scores every K-th target only (``nll`` is NaN elsewhere), and the JSON says so.

Two methods compute the same NLLs (``StreamConfig.method``): ``step`` feeds one token per forward
through a :class:`~sinklab.stream.cache.SinkCache` and runs the oracle one target per forward (the
reference); ``chunked`` reads ``chunk`` tokens per forward with a per-query band mask and
re-indexed sinks (:mod:`sinklab.stream.band`, exact: every token sees what it would have seen token
by token) and batches the oracle's windows (:mod:`sinklab.stream.oracle`). ``auto`` (the default) is
chunked where :func:`sinklab.stream.band.chunked_refusal` finds nothing against the model, else step
(models outside transformers' ``AttentionInterface``, the lab's attention variants), decided
before any work by :meth:`StreamConfig.choose_method`; the result records the method run and why.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from sinklab.errors import SinklabError, check_positive
from sinklab.memory import SAMPLE_EVERY, rss_mb
from sinklab.models.arch import input_device
from sinklab.probe import ProbeConfig, probe
from sinklab.progress import Progress, ProgressFor, quiet, quiet_for
from sinklab.stream.band import DEFAULT_CHUNK, chunked_nll, chunked_refusal
from sinklab.stream.cache import CacheConfig, SinkCache
from sinklab.stream.oracle import recompute_nll, recompute_nll_batched
from sinklab.stream.policy import cache_policies
from sinklab.stream.summary import (
    BLOCK_FIGURE,
    FIGURE,
    block_ppl_figure,
    collapse_point,
    running_ppl_figure,
)

__all__ = [
    "METHODS",
    "POLICIES",
    "PolicyResult",
    "StreamConfig",
    "StreamResult",
    "stream_nll",
    "streaming_perplexity",
]

log = logging.getLogger(__name__)

METHODS = ("auto", "chunked", "step")  # same NLLs; step is the token-by-token reference


@dataclass(frozen=True)
class StreamConfig:
    """One streaming-perplexity run; recorded in ``meta.params``."""

    policies: tuple[str, ...] = field(default_factory=lambda: tuple(POLICIES))  # all, in order
    n_sink: int = 4
    window: int = 508
    n_tokens: int = 4000
    recompute_every: int = 1  # score the recompute oracle on every K-th target only
    probe_tokens: int = 256  # sink-auto: prefix on which sinks are measured
    segment: int = 1000  # tokens per entry of segment_ppl
    method: str = "auto"  # chunked (C queries per forward) | step (one token a forward) | auto
    chunk: int = DEFAULT_CHUNK  # chunked: queries per forward
    # chunked: recompute windows per forward (step: one at a time). On CPU a 513-token window is
    # already matmul-bound: 16 per forward cost 1.32 vs 1.14 CPU s a target (SmolLM2, one thread,
    # benchmarks/results/2026-12-01/stream-methods.json), so 1; batches pay off on accelerators.
    # Either way the targets still inside the first window come from one forward over the prefix.
    oracle_batch: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SinklabError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        bad = [p for p in self.policies if p not in POLICIES]
        if not self.policies or bad:
            raise SinklabError(
                f"unknown policy {', '.join(bad) or '(none)'}; choose from {', '.join(POLICIES)}"
            )
        check_positive(
            {
                "n_sink": self.n_sink,
                "window": self.window,
                "recompute_every": self.recompute_every,
                "probe_tokens": self.probe_tokens,
                "segment": self.segment,
                "chunk": self.chunk,
                "oracle_batch": self.oracle_batch,
            }
        )
        if self.n_tokens < 2:
            raise SinklabError(f"tokens must be at least 2, got {self.n_tokens}")

    def check_model(self, model: Any) -> tuple[str, str]:
        """Refuse, before any work, a model whose keys the sink cache cannot move, or that
        ``method="chunked"`` cannot serve (one-line reason). ``dense`` moves no key, so it alone
        streams every model. -> :meth:`choose_method`'s (method, why)."""
        for cache in self._caches():
            if cache.capacity is not None:  # dense moves no key
                SinkCache(model, cache)
        return self.choose_method(model)

    def _caches(self) -> list[CacheConfig]:
        """The caches this run's policies stream through (one per kind; sink-auto's sinks come
        later, so its cache is checked with sink's sizes)."""
        kinds = (POLICIES[p].cache for p in self.policies)
        return [self.cache_config(k) for k in dict.fromkeys(k for k in kinds if k is not None)]

    def scored_every(self, policy: str) -> int:
        """Every how many targets ``policy`` scores one (the oracle: ``recompute_every``)."""
        return 1 if POLICIES[policy].cache is not None else self.recompute_every

    def work(self, policy: str) -> float:
        """``policy``'s share of a run's work per token, for a progress bar: a cached token
        costs 1; an oracle target re-reads its whole window (about a quarter of a token each, on
        a CPU), every ``recompute_every``-th target."""
        if POLICIES[policy].cache is not None:
            return 1.0
        return (self.n_sink + self.window) / (4 * self.recompute_every)

    def choose_method(self, model: Any) -> tuple[str, str]:
        """The method this run uses on ``model`` and why, before any work: ``step`` as asked;
        ``chunked`` as asked (SinklabError, one line, when :func:`chunked_refusal` refuses a
        policy's cache); ``auto``: chunked unless it refuses, then step. (recompute needs no
        cache: chunked batches its windows on every model.)"""
        if self.method == "step":
            return "step", "asked for"
        reasons = [r for c in self._caches() if (r := chunked_refusal(model, c))]
        if self.method == "chunked":
            if reasons:
                raise SinklabError(reasons[0])
            return "chunked", "asked for"
        if reasons:
            why = reasons[0].split("; ")[0]  # the reason without its advice
            return "step", f"auto: {why}"
        return (
            "chunked",
            "auto: chunked serves this model (many tokens a forward, the same NLLs as step)",
        )

    def cache_config(self, policy: str, sinks: Sequence[int] | None = None) -> CacheConfig:
        auto = tuple(sinks) if policy == "sink-auto" else None
        return CacheConfig(policy, self.n_sink, self.window, auto)


@dataclass
class PolicyResult:
    """One policy's stream: ``nll`` (n_tokens - 1,) in nats per target (NaN = not scored)."""

    policy: str
    ppl: float
    segment_ppl: list[float]
    nll: list[float]
    n_scored: int
    tokens_per_s: float
    peak_rss_mb: float  # largest resident set sampled during this policy's run
    max_cache_len: int | None  # most positions any layer cached (None: no cache, recompute)
    sink_positions: list[int] | None = None
    recompute_every: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StreamResult:
    """Every policy's result on the same token stream, and the run's ``meta``."""

    config: StreamConfig
    policies: dict[str, PolicyResult]
    meta: dict[str, Any] = field(default_factory=dict)
    method: str = ""  # the method run (config.method may say auto)
    method_reason: str = ""  # why that one (StreamConfig.choose_method)

    def scored_ppl(self) -> dict[str, float]:
        """Each policy's perplexity on the targets every policy scored (the recompute subset)."""
        nll = torch.tensor([r.nll for r in self.policies.values()], dtype=torch.float64)
        mask = ~nll.isnan().any(0)
        return {p: _ppl(nll[i][mask]) for i, p in enumerate(self.policies)}

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"meta": self.meta}
        data.update(method=self.method, method_reason=self.method_reason)
        data["policies"] = {p: r.to_json() for p, r in self.policies.items()}
        data["dense_collapse"] = collapse_point(data["policies"], self.config.segment)
        if "recompute" in self.policies:
            data["on_recompute_targets"] = {
                "recompute_every": self.config.recompute_every,
                "n_scored": self.policies["recompute"].n_scored,
                "ppl": self.scored_ppl(),
            }
        return data

    def figures(self) -> dict[str, Any]:
        """The running- and block-perplexity matplotlib Figures by name, with or without
        ``meta`` (a bare result is titled by its config)."""
        from sinklab.meta import bare_meta

        data = self.to_json()
        data["meta"] = self.meta or bare_meta(self.config)
        return {FIGURE: running_ppl_figure(data), BLOCK_FIGURE: block_ppl_figure(data)}

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per policy: its perplexity, targets scored, speed, memory
        and cache size (the per-target NLLs stay in ``policies[p].nll``)."""
        from sinklab.frames import records_frame

        columns = ["policy", "ppl", "n_scored", "tokens_per_s", "peak_rss_mb", "max_cache_len"]
        return records_frame((r.to_json() for r in self.policies.values()), columns)


# ------------------------------------------------------------------------------- helpers
def _ppl(nll: Tensor) -> float:
    nll = nll[~nll.isnan()]
    return float(torch.exp(nll.double().mean())) if nll.numel() else math.nan


def segment_ppl(nll: Tensor, segment: int) -> list[float]:
    """Perplexity of each block of ``segment`` consecutive targets (NaNs skipped)."""
    return [_ppl(nll[i : i + segment]) for i in range(0, nll.numel(), segment)]


def _target_nll(logits: Tensor, target: int) -> float:
    """``logits`` (V,) -> -log p(target)."""
    logits = logits.float()
    return float(torch.logsumexp(logits, -1) - logits[target])


def _device(model: Any) -> torch.device:
    return input_device(model)


# ------------------------------------------------------------------------------ the loops
@torch.inference_mode()
def stream_nll(
    model: Any,
    ids: Tensor,
    cache_config: CacheConfig,
    progress: Progress = quiet,
    out: Tensor | None = None,
    period: int = SAMPLE_EVERY,
) -> tuple[Tensor, int, float]:
    """Token by token through a :class:`SinkCache`: ``ids`` (T,) -> (nll (T-1,), most positions
    cached, peak sampled RSS MiB). ``progress(done, total, note)`` (the one
    :data:`~sinklab.progress.Progress`: targets, the running perplexity in the note) is called
    every ``period`` tokens; ``out`` (T-1,) float64, if given, is filled as it goes (so the
    caller's ``progress`` can read the NLLs so far)."""
    cache = SinkCache(model, cache_config)
    dev, n = _device(model), ids.numel() - 1
    nll = torch.empty(n, dtype=torch.float64) if out is None else out
    total, most, peak = 0.0, 0, rss_mb()
    for t in range(n):
        res = model(ids[t : t + 1].view(1, 1).to(dev), cache=cache, **cache.prepare(1))
        nll[t] = _target_nll(res.logits[0, -1], int(ids[t + 1]))
        total += float(nll[t])
        most = max(most, cache.kept_length())
        if (t + 1) % period == 0 or t + 1 == n:
            peak = max(peak, rss_mb())
            progress(t + 1, n, f"ppl {math.exp(total / (t + 1)):.2f}")
    return nll, most, peak


def choose_sinks(model: Any, prefix: Tensor, n_sink: int) -> tuple[int, ...]:
    """sink-auto: the ``n_sink`` positions of ``prefix`` (T,) where the probe finds attention
    sinks (received attention far above uniform and typical, averaged over layers and heads),
    strongest first; if it finds fewer, the earliest other positions fill up (StreamingLLM's
    choice). Returned sorted."""
    result = probe(model, prefix, ProbeConfig(max_sink_positions=n_sink))
    found = [int(d["position"]) for d in result.sink_positions][:n_sink]
    fill = [p for p in range(prefix.numel()) if p not in found][: n_sink - len(found)]
    log.info("sink-auto: probe found %s, filled with %s", found, fill)
    return tuple(sorted(found + fill))


@dataclass(frozen=True)
class Loop:
    """How a policy's runner loops and reports: ``chunked`` (the band evaluator and batched
    oracle) or the step loop; ``progress(done, total, note)`` (the one
    :data:`~sinklab.progress.Progress`: targets, the running perplexity in the note); ``out``
    (T-1,) float64 filled as it goes; ``period``: targets between reports of the one-per-forward
    loops."""

    chunked: bool
    progress: Progress = quiet
    out: Tensor | None = None
    period: int = SAMPLE_EVERY

    def through(self, model: Any, ids: Tensor, cache: CacheConfig, chunk: int) -> Any:
        """``ids`` through ``cache`` -> (nll, most positions cached, peak RSS MiB)."""
        if self.chunked:
            return chunked_nll(model, ids, cache, chunk, self.progress, rss_mb, self.out)
        return stream_nll(model, ids, cache, self.progress, self.out, self.period)


#: (nll (T-1,) NaN where unscored, most positions cached (None: no cache), peak sampled RSS
#: MiB, the sinks chosen (sink-auto; else None))
PolicyOutput = tuple[Tensor, "int | None", float, "tuple[int, ...] | None"]
Runner = Callable[[Any, Tensor, StreamConfig, Loop], PolicyOutput]


def _cached(model: Any, ids: Tensor, config: StreamConfig, loop: Loop, *, policy: str) -> Any:
    """A cache policy: its cache through the step loop or the band evaluator."""
    return (*loop.through(model, ids, config.cache_config(policy), config.chunk), None)


def _sink_auto(model: Any, ids: Tensor, config: StreamConfig, loop: Loop) -> Any:
    """sink-auto: sinks chosen by the probe on the prefix, then the sink cache with them."""
    n_probe = min(config.probe_tokens, config.n_sink + config.window, ids.numel())
    sinks = choose_sinks(model, ids[:n_probe], config.n_sink)
    cache = config.cache_config("sink-auto", sinks)
    return (*loop.through(model, ids, cache, config.chunk), sinks)


def _recompute(model: Any, ids: Tensor, config: StreamConfig, loop: Loop) -> Any:
    """The oracle: a fresh forward per scored target (batched windows when chunked)."""
    args = (model, ids, config.n_sink, config.window, config.recompute_every)
    if loop.chunked:
        batch = config.oracle_batch
        nll, _, peak = recompute_nll_batched(*args, batch, loop.progress, rss_mb, loop.out)
    else:
        nll, _, peak = recompute_nll(*args, loop.progress, rss_mb, loop.out, loop.period)
    return nll, None, peak, None


@dataclass(frozen=True)
class Policy:
    """One streaming policy: how it runs, and the cache whose sizes and refusals apply to it
    (``None``: no cache, the oracle, which scores every ``recompute_every``-th target)."""

    run: Runner
    cache: str | None


class _Policies(Mapping[str, Policy]):
    """Every streaming policy, in the order ``--policy all``, the report and the figures use:
    each registered cache policy (:mod:`sinklab.stream.policy`; adding one there adds it here),
    then the recompute oracle. ``sink-auto`` first chooses its sinks with the probe."""

    def _all(self) -> dict[str, Policy]:
        out = {
            name: Policy(_sink_auto, "sink")
            if name == "sink-auto"
            else Policy(partial(_cached, policy=name), name)
            for name in cache_policies()
        }
        return {**out, "recompute": Policy(_recompute, None)}

    def __getitem__(self, name: str) -> Policy:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


POLICIES: Mapping[str, Policy] = _Policies()


def run_policy(
    model: Any,
    ids: Tensor,
    config: StreamConfig,
    policy: str,
    progress: Progress = quiet,
    out: Tensor | None = None,
    period: int = SAMPLE_EVERY,
    method: str | None = None,
) -> tuple[Tensor, int | None, float, tuple[int, ...] | None]:
    """One policy on ``ids`` (T,) by ``method`` (chunked | step; None: ``config``'s choice,
    :meth:`StreamConfig.choose_method`) -> (nll (T-1,) NaN where unscored, most positions cached
    (None: recompute has no cache), peak sampled RSS MiB, sink-auto's sinks).
    ``progress(done, total, note)`` (the one :data:`~sinklab.progress.Progress`: targets, the
    running perplexity in the note, ``ppl 12.34``); ``out`` (T-1,) float64 is filled as the loop
    goes; ``period``: tokens (targets) between reports of the one-per-forward loops."""
    chunked = (method or config.choose_method(model)[0]) == "chunked"
    return POLICIES[policy].run(model, ids, config, Loop(chunked, progress, out, period))


def streaming_perplexity(
    model: Any,
    ids: Tensor,
    config: StreamConfig,
    progress_for: ProgressFor = quiet_for,
) -> StreamResult:
    """Run every policy of ``config`` on ``ids`` (LongTensor (T,)), one after another.

    ``progress_for(policy)`` (:data:`~sinklab.progress.ProgressFor`) is the policy's
    :data:`~sinklab.progress.Progress`, asked for as the policy starts: its targets done of T-1,
    the running perplexity in the note (``ppl 12.34``). The result's ``meta`` is the caller's
    (:func:`sinklab.meta.attach_meta`).
    """
    ids = torch.as_tensor(ids).reshape(-1).long()
    if ids.numel() < 2:
        raise SinklabError(f"need at least 2 tokens to score one, got {ids.numel()}")
    method, why = config.choose_method(model)
    results: dict[str, PolicyResult] = {}
    for policy in config.policies:
        tick = progress_for(policy)
        t0 = time.perf_counter()
        nll, most, peak, sinks = run_policy(model, ids, config, policy, tick, method=method)
        seconds = time.perf_counter() - t0
        scored = int((~nll.isnan()).sum())
        results[policy] = PolicyResult(
            policy=policy,
            ppl=_ppl(nll),
            segment_ppl=segment_ppl(nll, config.segment),
            nll=[round(float(x), 5) for x in nll],
            n_scored=scored,
            tokens_per_s=scored / seconds if seconds > 0 else math.inf,
            peak_rss_mb=round(peak, 1),
            max_cache_len=most,
            sink_positions=list(sinks) if sinks is not None else None,
            recompute_every=config.recompute_every if policy == "recompute" else None,
        )
        log.info("%s: ppl %.2f, %.1f tok/s", policy, results[policy].ppl, scored / seconds)
    return StreamResult(config, results, method=method, method_reason=why)
