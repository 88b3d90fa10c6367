"""Positions that never grow: ``SinkCache.prepare`` keeps the positions the model is given below
``max_position_embeddings`` (rebasing the cache once per bound, not every step) and the NLLs equal
the unbounded loop's."""

from __future__ import annotations

import itertools

import pytest
import torch

from sinklab.errors import SinklabError
from sinklab.stream.cache import CacheConfig, SinkCache
from sinklab.stream.evaluate import stream_nll

MAX_POS = 32


@pytest.fixture(scope="module")
def short_model(tiny_model_factory):
    """A tiny Llama that claims only 32 positions, so a short stream is 10x its length."""
    return tiny_model_factory("llama", seed=9, max_position_embeddings=MAX_POS)


class _Positions:
    """A forward hook on the rotary embedding: every position the model is given."""

    def __init__(self, model) -> None:
        self.seen: list[int] = []
        rotary = model.model.rotary_emb
        self.handle = rotary.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        if "position_ids" in kwargs:  # the model's forward (SinkCache's layout check passes args)
            self.seen.append(int(kwargs["position_ids"].max()))

    def close(self) -> None:
        self.handle.remove()


def _nll(logits: torch.Tensor, target: int) -> float:
    return float(torch.logsumexp(logits.double(), -1) - logits.double()[target])


@torch.no_grad()
def _stream(model, ids: list[int], cfg: CacheConfig, bounded: bool, chunk: int = 1):
    cache = SinkCache(model, cfg)
    spy = _Positions(model)
    nll = []
    try:
        for t in range(0, len(ids) - 1, chunk):
            x = ids[t : min(t + chunk, len(ids) - 1)]
            extra = cache.prepare(len(x)) if bounded else {}
            logits = model(torch.tensor([x]), cache=cache, **extra).logits[0]
            nll += [_nll(logits[j], ids[t + j + 1]) for j in range(len(x))]
    finally:
        spy.close()
    return torch.tensor(nll, dtype=torch.float64), spy.seen, cache


def test_positions_stay_below_the_bound_and_nlls_equal_the_unbounded_loop(short_model):
    ids = torch.randint(3, 500, (10 * MAX_POS,), generator=torch.Generator().manual_seed(1))
    ids = ids.tolist()
    cfg = CacheConfig("sink", 2, 6)
    spy = _Positions(short_model)  # the library's token-by-token loop
    try:
        got, most, _ = stream_nll(short_model, torch.tensor(ids), cfg)
    finally:
        spy.close()
    positions = spy.seen
    want, free_positions, _ = _stream(short_model, ids, cfg, bounded=False)
    assert max(positions) < MAX_POS
    assert max(free_positions) == len(ids) - 2  # the unbounded loop really went past the bound
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # rebased once per bound, not every step: positions fall back only every ~ (32 - 8) tokens
    drops = sum(b < a for a, b in itertools.pairwise(positions))
    assert 1 <= drops <= len(ids) // (MAX_POS - cfg.capacity - 1) + 1
    assert most == cfg.capacity


@pytest.mark.parametrize("policy", ["sink", "sink-auto", "window"])
def test_chunked_reads_are_bounded_too(short_model, policy):
    ids = torch.randint(3, 500, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    cfg = CacheConfig(policy, 2, 6, (0, 5) if policy == "sink-auto" else None)
    got, positions, _ = _stream(short_model, ids, cfg, bounded=True, chunk=7)
    want, _, _ = _stream(short_model, ids, cfg, bounded=False, chunk=7)
    assert max(positions) < MAX_POS
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_read_that_cannot_fit_below_the_bound_is_refused(short_model):
    cache = SinkCache(short_model, CacheConfig("sink", 2, 8))
    with pytest.raises(SinklabError, match="read at most"):
        cache.prepare(MAX_POS + 1)


def test_prepare_refuses_bad_counts(short_model):
    cache = SinkCache(short_model, CacheConfig("sink", 2, 8))
    for bad in ([1, 1], [0], -1):
        with pytest.raises(SinklabError, match="one count"):
            cache.prepare(bad)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_generate_is_bounded_and_equals_model_generate(short_model, tiny_tokenizer):
    """sinklab's generate (bounded positions) picks the tokens model.generate (unbounded) picks."""
    from sinklab.stream.generation import GenerateConfig, generate

    prompt = torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(3))
    cfg = GenerateConfig(max_new_tokens=5 * MAX_POS, n_sink=2, window=6, stop_at_eos=False)
    spy = _Positions(short_model)
    try:
        res = generate(short_model, tiny_tokenizer, prompt, cfg)
    finally:
        spy.close()
    assert max(spy.seen) < MAX_POS and res.max_position < MAX_POS and res.max_cache_len == 8
    cache = SinkCache(short_model, CacheConfig("sink", 2, 6))
    out = short_model.generate(
        prompt[None], cache=cache, max_new_tokens=5 * MAX_POS, do_sample=False, eos_token_id=None
    )
    assert res.new_tokens == out[0, 20:].tolist()
