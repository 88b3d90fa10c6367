"""Cache policies are objects in one registry (docs/streaming.md#policies): the built-in four keep
what they kept before, and a new policy is one class plus one registration, after which every
streaming path (the SinkCache step loop, the band evaluator, ``streaming_perplexity``) runs it and
agrees with the naive StreamingLLM reference of tests/streamref.py."""

from __future__ import annotations

import math

import pytest
import torch

from sinklab.errors import SinklabError
from sinklab.stream.cache import CacheConfig, SinkCache
from sinklab.stream.evaluate import POLICIES, StreamConfig, run_policy, streaming_perplexity
from sinklab.stream.policy import (
    CACHE_POLICIES,
    CachePolicy,
    cache_policies,
    kept_positions,
    policy_of,
    register,
    unregister,
)
from streamref import naive_logits


class SinkSpread(CachePolicy):
    """A toy policy: ``n_sink`` sinks spread over every other position (0, 2, 4, ...) plus the
    window; the whole policy is these lines and the ``register`` call in the fixture."""

    name = "sink-spread"

    def sinks(self, config: CacheConfig) -> tuple[int, ...]:
        return tuple(range(0, 2 * config.n_sink, 2))


@pytest.fixture
def spread():
    register(SinkSpread())
    yield "sink-spread"
    unregister("sink-spread")


def test_builtin_policies_keep_what_they_kept():
    assert CACHE_POLICIES == ("dense", "window", "sink", "sink-auto")
    assert list(POLICIES) == [*CACHE_POLICIES, "recompute"]
    got = {p: CacheConfig(p, 4, 8) for p in ("dense", "window", "sink")}
    assert (got["dense"].capacity, got["dense"].sinks, got["dense"].recent) == (None, (), None)
    assert (got["window"].capacity, got["window"].sinks, got["window"].recent) == (12, (), 12)
    assert (got["sink"].capacity, got["sink"].sinks, got["sink"].recent) == (12, (0, 1, 2, 3), 8)
    auto = CacheConfig("sink-auto", 4, 8, (5, 0))
    assert (auto.capacity, auto.sinks, auto.recent) == (12, (0, 5), 8)


def test_policy_errors_are_one_line():
    with pytest.raises(SinklabError, match="not one of dense, window, sink, sink-auto"):
        CacheConfig("h2o", 4, 8)
    with pytest.raises(SinklabError, match="only meaningful for the sink-auto"):
        CacheConfig("sink", 4, 8, (0,))
    with pytest.raises(SinklabError, match="distinct sink positions"):
        CacheConfig("sink-auto", 4, 8, (1, 1))
    with pytest.raises(ValueError, match="already registered"):
        register(type("Other", (CachePolicy,), {"name": "sink"})())


def test_a_new_policy_is_registered_and_listed(spread):
    assert spread in cache_policies() and spread in POLICIES
    assert policy_of(spread).sinks(CacheConfig(spread, 3, 8)) == (0, 2, 4)
    assert StreamConfig(policies=(spread,), n_sink=3, window=8).policies == (spread,)


def test_unregistered_policy_is_gone(spread):
    unregister(spread)
    assert spread not in POLICIES
    with pytest.raises(SinklabError, match="sink-spread"):
        CacheConfig(spread, 3, 8)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_new_policy_streams_exactly_on_every_path(spread, family, tiny_model_factory):
    """Token by token through SinkCache, and by ``run_policy`` on both methods, the toy policy's
    logits / NLLs equal the naive reference's with the same sinks and window (past eviction)."""
    model = tiny_model_factory(family)
    n_sink, window, n = 3, 8, 40
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen)
    cfg = CacheConfig(spread, n_sink, window)
    sinks = set(cfg.sinks)
    ref = naive_logits(model, ids.tolist(), sinks, window)

    cache = SinkCache(model, cfg)
    got = []
    with torch.no_grad():
        for t in range(n):
            got.append(model(ids[None, t : t + 1], cache=cache, use_cache=True).logits[0])
    got = torch.cat(got)
    assert (got - ref).abs().max() < 1e-4
    assert cache.kept_positions() == kept_positions(n, cfg.sinks, window)  # what it holds
    assert len(cache.kept_positions()) <= n_sink + window

    lp = torch.log_softmax(ref.double(), -1)
    ref_nll = -lp[:-1].gather(-1, ids[1:, None])[:, 0]
    config = StreamConfig(policies=(spread,), n_sink=n_sink, window=window, n_tokens=n, chunk=7)
    for method in ("step", "chunked"):
        nll = run_policy(model, ids, config, spread, method=method)[0]
        assert (nll - ref_nll).abs().max() < 1e-4, method
    res = streaming_perplexity(model, ids, config)
    assert math.isclose(res.policies[spread].ppl, math.exp(float(ref_nll.mean())), rel_tol=1e-4)
