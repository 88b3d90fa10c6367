"""What a SinkCache reports about its length, and how it is reused
(docs/streaming.md#lengths-seen-and-kept)."""

from __future__ import annotations

import pytest
import torch
from transformers import pipeline
from transformers.cache_utils import DynamicSlidingWindowLayer

from sinklab.errors import SinklabError
from sinklab.stream import CacheConfig, SinkCache

CFG = CacheConfig(n_sink=4, window=28)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def test_seq_length_is_tokens_seen_as_transformers_sliding_layer_counts(tiny_model_factory):
    """get_seq_length() counts tokens seen, as transformers' own sliding-window layer does (and
    generate slices its inputs with it); kept_length() is what is cached, bounded."""
    model = tiny_model_factory("llama")
    cache = SinkCache(model, CFG)
    theirs = DynamicSlidingWindowLayer(sliding_window=CFG.capacity)
    for chunk in (50, 1, 1, 20):
        model(_ids(chunk, chunk), cache=cache, use_cache=True)
        theirs.update(torch.zeros(1, 2, chunk, 8), torch.zeros(1, 2, chunk, 8))
    assert cache.get_seq_length() == theirs.get_seq_length() == 72
    assert cache.kept_length() == CFG.capacity < cache.get_seq_length()
    assert theirs.keys.shape[-2] <= CFG.capacity


def test_a_new_prompt_needs_reset_and_reset_equals_a_fresh_cache(tiny_model_factory):
    model = tiny_model_factory("llama")
    cache = SinkCache(model, CFG)
    model.generate(_ids(60, 0), cache=cache, max_new_tokens=5, do_sample=False)
    second = _ids(40, 1)
    with pytest.raises(SinklabError, match=r"cache\.reset\(\)"):
        model.generate(second, cache=cache, max_new_tokens=5, do_sample=False)
    cache.reset()
    again = model.generate(second, cache=cache, max_new_tokens=8, do_sample=False)
    fresh = model.generate(second, cache=SinkCache(model, CFG), max_new_tokens=8, do_sample=False)
    assert torch.equal(again, fresh)


def test_pipeline_with_a_sink_cache_equals_generate(tiny_model_factory, tiny_tokenizer):
    """transformers' text-generation pipeline drives the cache through generate: its tokens are
    generate's on a fresh cache (a prompt longer than the cache, so it evicts)."""
    model = tiny_model_factory("llama")
    text = " ".join(["to be or not to be that is the question"] * 6)
    ids = tiny_tokenizer(text, return_tensors="pt").input_ids
    assert ids.shape[1] > CFG.capacity
    pipe = pipeline("text-generation", model=model, tokenizer=tiny_tokenizer, device="cpu")
    out = pipe(
        text,
        cache=SinkCache(model, CFG),
        max_new_tokens=12,
        do_sample=False,
        return_tensors=True,
    )
    want = model.generate(ids, cache=SinkCache(model, CFG), max_new_tokens=12, do_sample=False)
    assert out[0]["generated_token_ids"] == want[0].tolist()
