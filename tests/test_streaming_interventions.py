"""Interventions on every streaming path (docs/streaming.md#methods): the step loop runs each one
exactly as a naive StreamingLLM loop over the kept tokens does under the same intervention; the
band evaluator, which cannot run attention handlers, refuses in one line, and ``auto`` takes the
step loop and says why. (Before, the band evaluator silently ignored them.)"""

from __future__ import annotations

import math

import pytest
import torch

from sinklab.errors import SinklabError
from sinklab.seam.interventions import (
    AttentionReplace,
    attention_mix,
    attention_temperature,
    intervene,
    mask_sink,
    sink_logit,
)
from sinklab.stream.band import chunked_nll
from sinklab.stream.cache import CacheConfig, SinkCache
from sinklab.stream.evaluate import StreamConfig, run_policy, streaming_perplexity
from streamref import naive_logits

INTERVENTIONS = {
    "mask_sink": lambda m: mask_sink(m, positions=(1,)),
    "attention_mix": lambda m: attention_mix(m, 0.5),
    "attention_temperature": lambda m: attention_temperature(m, 2.0, layers=(1,)),
    "sink_logit": lambda m: sink_logit(m, 0.0, heads=(0,)),
}
# what needs keys in text order beyond the sinks: refused by the cache, on every method
REFUSED = {
    "attention_replace": (lambda m: intervene(m, AttentionReplace(lam=0.5)), "own key"),
    "mask_sink of a window position": (lambda m: mask_sink(m, positions=(0, 5)), r"\[5\]"),
}


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.double(), -1)
    return -lp[:-1].gather(-1, ids[1:, None])[:, 0]


@pytest.mark.parametrize("name", sorted(INTERVENTIONS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_intervention_on_each_method(name, family, tiny_model_factory):
    model = tiny_model_factory(family)
    n_sink, window, n = 2, 6, 30
    ids = torch.randint(
        0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(3)
    )
    config = StreamConfig(policies=("sink",), n_sink=n_sink, window=window, n_tokens=n, chunk=7)
    sinks = set(CacheConfig("sink", n_sink, window).sinks)
    plain = _nll(naive_logits(model, ids.tolist(), sinks, window), ids)
    with INTERVENTIONS[name](model):
        ref = _nll(naive_logits(model, ids.tolist(), sinks, window), ids)
        step = run_policy(model, ids, config, "sink", method="step")[0]
        assert config.choose_method(model)[0] == "step"
        assert "does not run attention handlers" in config.choose_method(model)[1]
        res = streaming_perplexity(model, ids, config)
        with pytest.raises(SinklabError, match="chunked streaming does not run attention") as e:
            run_policy(model, ids, config, "sink", method="chunked")
        assert "\n" not in str(e.value)
        with pytest.raises(SinklabError, match="does not run attention handlers"):
            chunked_nll(model, ids, CacheConfig("sink", n_sink, window))
    assert (step - ref).abs().max() < 1e-5  # honoured on the cache's slots, past eviction
    assert (ref - plain).abs().max() > 1e-4  # and it changed something (random tiny weights)
    assert res.method == "step" and math.isclose(
        res.policies["sink"].ppl, math.exp(float(ref.mean())), rel_tol=1e-4
    )
    # once the intervention is gone, auto takes the band evaluator again, on the plain numbers
    assert config.choose_method(model)[0] == "chunked"
    chunked = run_policy(model, ids, config, "sink", method="chunked")[0]
    assert (chunked - plain).abs().max() < 1e-4


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_interventions_that_need_text_order_are_refused(name, tiny_model_factory):
    """The cache writes its window in ring order, so a key index names a stream position only
    for a sink at its own slot: what reads another position (or each query's own key) would run
    on whichever token holds that slot, so it is refused in one line before any forward."""
    model = tiny_model_factory("llama")
    ids = torch.randint(
        0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(4)
    )
    config = StreamConfig(policies=("sink",), n_sink=2, window=6, n_tokens=20)
    enter, match = REFUSED[name]
    with enter(model):
        for method in ("step", "chunked"):
            with pytest.raises(SinklabError, match=match) as e:
                run_policy(model, ids, config, "sink", method=method)
            assert "\n" not in str(e.value)
        with pytest.raises(SinklabError, match=match):
            SinkCache(model, CacheConfig("sink", 2, 6))
        SinkCache(model, CacheConfig("dense", 2, 6))  # dense keeps text order: it runs
    cache = SinkCache(model, CacheConfig("sink", 2, 6))  # and nothing is left bound afterwards
    model(ids[None, :8], cache=cache)
    with enter(model), pytest.raises(SinklabError, match=match):  # bound after the cache was made
        model(ids[None, 8:9], cache=cache)
    model(ids[None, 8:9], cache=cache)  # unbound again: the stream goes on
    assert cache.stream_length() == 9


def test_smollm2_mix_is_honoured_by_default(smollm2):
    """The issue's measurement, on the real model: under attention_mix(0.5) the default method
    now gives the step loop's perplexity (the band evaluator gave the unmixed one)."""
    model, tok = smollm2.model, smollm2.tokenizer
    text = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet"
    ids = torch.tensor(tok(text * 3).input_ids[:48])
    config = StreamConfig(policies=("sink",), n_sink=4, window=12, n_tokens=48)
    plain = streaming_perplexity(model, ids, config).policies["sink"].ppl
    with attention_mix(model, 0.5):
        mixed = streaming_perplexity(model, ids, config)
        step = run_policy(model, ids, config, "sink", method="step")[0]
    assert mixed.method == "step"
    assert math.isclose(mixed.policies["sink"].ppl, math.exp(float(step.mean())), rel_tol=1e-6)
    assert mixed.policies["sink"].ppl > 1.5 * plain  # the mix hurts, as the step loop measured
