"""SinkCache: transformers API seams, equivalence with no cache and with an independent naive
StreamingLLM reference, the memory bound, generate (one and several calls), clear refusals."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers

from sinklab.errors import SinklabError
from sinklab.stream.cache import CacheConfig, SinkCache, kept_positions

FAMILIES = ("llama", "mistral", "qwen2", "gemma")


# ------------------------------------------------------------------ the naive reference
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.no_grad()
def naive_streaming_logits(
    model, ids: list[int], sinks: set[int], recent: int | None, chunks: list[int] | None = None
) -> torch.Tensor:
    """StreamingLLM's semantics written out by hand, independently of sinklab.stream.cache.

    Each token's keys and values are computed once, when it is read, and stored un-rotated.
    At every step the context is [kept tokens in text order] + [the new tokens]; they are rotated
    at cache-relative positions 0..n-1. After the step, keep the sinks and the ``recent`` most
    recent other tokens. ``chunks`` feeds several tokens per step (causal within the chunk).
    Returns logits (T, V).
    """
    inner = model.model
    hd = inner.layers[0].self_attn.head_dim
    store_k = [{} for _ in inner.layers]
    store_v = [{} for _ in inner.layers]
    kept: list[int] = []
    out, t = [], 0
    for size in chunks or [1] * len(ids):
        new = list(range(t, t + size))
        ctx = kept + new
        n = len(ctx)
        dummy = torch.zeros(1, n, hd)
        cos, sin = inner.rotary_emb(dummy, torch.arange(n)[None])  # (1, n, hd)
        cos, sin = cos[:, None], sin[:, None]  # (1, 1, n, hd)
        h = inner.embed_tokens(torch.tensor([ids[p] for p in new])[None])  # (1, size, hidden)
        for li, layer in enumerate(inner.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(1, size, -1, hd).transpose(1, 2)  # (1, H, size, hd)
            k = a.k_proj(x).view(1, size, -1, hd).transpose(1, 2)  # (1, Hkv, size, hd)
            v = a.v_proj(x).view(1, size, -1, hd).transpose(1, 2)
            for j, p in enumerate(new):
                store_k[li][p], store_v[li][p] = k[0, :, j], v[0, :, j]
            keys = torch.stack([store_k[li][p] for p in ctx], dim=1)[None]  # (1, Hkv, n, hd)
            vals = torch.stack([store_v[li][p] for p in ctx], dim=1)[None]
            keys = keys * cos + _rotate_half(keys) * sin
            q = q * cos[:, :, -size:] + _rotate_half(q) * sin[:, :, -size:]
            rep = q.shape[1] // keys.shape[1]
            keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
            scores = (q @ keys.transpose(-1, -2)) * a.scaling  # (1, H, size, n)
            allowed = torch.arange(n)[None, :] <= (n - size + torch.arange(size))[:, None]
            w = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            o = (w @ vals).transpose(1, 2).reshape(1, size, -1)  # (1, size, H*hd)
            h = h + a.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        out.append(model.lm_head(inner.norm(h))[0])
        others = [p for p in ctx if p not in sinks]
        drop = set(others[: max(0, len(others) - recent)]) if recent is not None else set()
        kept = [p for p in ctx if p not in drop]
        t += size
    return torch.cat(out)


@torch.no_grad()
def cache_logits(model, ids: list[int], cfg: CacheConfig, chunks: list[int] | None = None):
    cache = SinkCache(model, cfg)
    out, t, kept = [], 0, []
    for size in chunks or [1] * len(ids):
        out.append(model(torch.tensor([ids[t : t + size]]), cache=cache).logits[0])
        kept.append(cache.kept_length())
        t += size
    return torch.cat(out), cache, kept


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    return {f: tiny_model_factory(f) for f in FAMILIES}


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------------ API seams
def test_transformers_cache_api_we_rely_on():
    """A transformers upgrade that changes these seams must fail here, loudly."""
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import _preprocess_mask_arguments

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    assert (major, minor) >= (5, 22) and (major, minor) < (5, 25), transformers.__version__
    params = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert params(CacheLayerMixin.update)[:3] == ["self", "key_states", "value_states"]
    assert params(CacheLayerMixin.get_mask_sizes) == ["self", "query_length"]
    assert params(CacheLayerMixin.lazy_initialization) == ["self", "key_states", "value_states"]
    assert {"get_seq_length", "get_max_length", "reorder_cache"} <= set(dir(CacheLayerMixin))
    assert params(Cache.update)[:4] == ["self", "key_states", "value_states", "layer_idx"]
    assert params(Cache.get_mask_sizes) == ["self", "query_length", "layer_idx"]
    assert "layers" in params(Cache.__init__)
    src = inspect.getsource(_preprocess_mask_arguments)
    assert "cache.get_query_offset" in src and "cache.get_mask_sizes" in src


def test_model_passes_position_ids_to_cache_update(models):
    """SinkCache checks the positions the model used; they reach update() as kwargs."""
    seen = {}

    class Spy(SinkCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            seen.update(kwargs.get("kwargs") or {})
            return super().update(k, v, layer_idx, *args, **kwargs)

    for fam, model in models.items():
        seen.clear()
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]]), cache=Spy(model, CacheConfig("sink", 2, 6)))
        assert seen["position_ids"].tolist() == [[0, 1, 2]], fam


def test_kept_positions_is_streamingllm_eviction():
    assert kept_positions(10, (0, 1), 3) == [0, 1, 7, 8, 9]
    assert kept_positions(4, (0, 1), 3) == [0, 1, 2, 3]
    assert kept_positions(10, (), 3) == [7, 8, 9]
    assert kept_positions(10, (0, 8), 2) == [0, 7, 8, 9]  # a sink inside the window
    assert kept_positions(5, (), None) == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------- equivalences
LONG_WINDOW = [("llama", p) for p in ("dense", "window", "sink", "sink-auto")] + [
    (f, "sink") for f in FAMILIES[1:]
]


@pytest.mark.parametrize(("family", "policy"), LONG_WINDOW)
def test_window_longer_than_stream_equals_no_cache(models, family, policy):
    model, ids = models[family], _ids(12)
    auto = (0, 3) if policy == "sink-auto" else None
    got, _, _ = cache_logits(model, ids, CacheConfig(policy, 4, 64, auto))
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


CASES = {  # policy -> (config, sinks, recent) of the naive reference
    "dense": (CacheConfig("dense", 2, 6), set(), None),
    "window": (CacheConfig("window", 2, 6), set(), 8),
    "sink": (CacheConfig("sink", 2, 6), {0, 1}, 6),
    "sink-auto": (CacheConfig("sink-auto", 3, 6, (0, 4, 7)), {0, 4, 7}, 6),
}


NAIVE = [(f, p) for f in FAMILIES for p in ("dense", "window", "sink")] + [("llama", "sink-auto")]


@pytest.mark.parametrize(("family", "policy"), NAIVE)
def test_after_evictions_equals_naive_streamingllm(models, family, policy):
    cfg, sinks, recent = CASES[policy]
    model, ids = models[family], _ids(24, seed=1)
    got, cache, kept = cache_logits(model, ids, cfg)
    want = naive_streaming_logits(model, ids, sinks, recent)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if cfg.capacity is not None:
        assert max(kept) == cfg.capacity and cache.seen == 24


@pytest.mark.parametrize("policy", ["sink", "sink-auto"])
def test_chunks_after_evictions_equal_naive(models, policy):
    """Multi-token updates (generate's prefill, later turns): causal within the chunk."""
    cfg, sinks, recent = CASES[policy]
    model, ids = models["llama"], _ids(32, seed=2)
    chunks = [5, 1, 9, 1, 1, 12, 1, 2]
    got, _, _ = cache_logits(model, ids, cfg, chunks)
    want = naive_streaming_logits(model, ids, sinks, recent, chunks)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_cache_never_exceeds_sinks_plus_window_and_layer0_keys_are_fresh(models):
    model, ids = models["qwen2"], _ids(30, seed=3)
    cfg = CacheConfig("sink", 3, 10)
    cache = SinkCache(model, cfg)
    inner = model.model
    with torch.no_grad():
        for t in range(30):
            model(torch.tensor([[ids[t]]]), cache=cache)
            assert cache.kept_length() <= 13
            for layer in cache.layers:  # the slots: 13 kept + 1 for the incoming token
                assert layer.keys.shape[-2] == 14 and layer.values.shape[-2] == 14
        kept = cache.kept_positions()
        assert kept == [0, 1, 2, *range(20, 30)]
        # layer 0: keys depend only on the token, so they equal a fresh computation at 0..n-1
        a = inner.layers[0].self_attn
        x = inner.layers[0].input_layernorm(
            inner.embed_tokens(torch.tensor([[ids[p] for p in kept]]))
        )
        k = a.k_proj(x).view(1, len(kept), -1, a.head_dim).transpose(1, 2)
        cos, sin = inner.rotary_emb(k, torch.arange(len(kept))[None])
        fresh = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        keys, _ = cache.relative_keys(0)
        torch.testing.assert_close(keys, fresh, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------- generate
@pytest.fixture(scope="module")
def gen_model(tiny_model_factory):
    model = tiny_model_factory("llama", seed=5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def _manual_greedy(model, cache, chunk: list[int], n: int) -> list[int]:
    out = []
    logits = model(torch.tensor([chunk]), cache=cache).logits[0, -1]
    for _ in range(n):
        out.append(int(logits.argmax()))
        if len(out) < n:
            logits = model(torch.tensor([[out[-1]]]), cache=cache).logits[0, -1]
    return out


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_generate_matches_manual_greedy_and_continues_across_calls(gen_model):
    cfg = CacheConfig("sink", 2, 8)
    prompt, more = _ids(6, seed=7), _ids(5, seed=8)
    kw = dict(do_sample=False, max_new_tokens=14)
    cache = SinkCache(gen_model, cfg)
    out1 = gen_model.generate(torch.tensor([prompt]), past_key_values=cache, **kw)
    new1 = out1[0, len(prompt) :].tolist()
    assert cache.kept_length() == 10 and cache.seen == out1.shape[1] - 1
    out2 = gen_model.generate(
        torch.cat((out1, torch.tensor([more])), 1), past_key_values=cache, **kw
    )
    new2 = out2[0, out1.shape[1] + len(more) :].tolist()

    manual = SinkCache(gen_model, cfg)
    want1 = _manual_greedy(gen_model, manual, prompt, 14)
    want2 = _manual_greedy(gen_model, manual, [want1[-1], *more], 14)
    assert new1 == want1 and new2 == want2
    assert cache.seen == manual.seen == out2.shape[1] - 1


@torch.no_grad()
def _sink_logprob(model, cfg: CacheConfig, prompt: list[int], new: list[int]) -> float:
    """Sum of log p(new | prompt) with the prompt prefilled, then one token per step."""
    cache = SinkCache(model, cfg)
    logits = model(torch.tensor([prompt]), cache=cache).logits[0, -1]
    total = 0.0
    for tok in new:
        total += float(torch.log_softmax(logits.double(), -1)[tok])
        logits = model(torch.tensor([[tok]]), cache=cache).logits[0, -1]
    return total


@pytest.mark.parametrize("n_sink,window", [(2, 8), (2, 64)])
def test_beam_search_reorders_the_cache(gen_model, n_sink, window):
    """Each beam's score is its own sequence's log-probability under the sink cache: a cache
    that mixed the beams' histories on reordering (or on expansion) would not give that."""
    cfg = CacheConfig("sink", n_sink, window)
    prompt = _ids(6, seed=11)
    out = gen_model.generate(
        torch.tensor([prompt]),
        cache=SinkCache(gen_model, cfg),
        num_beams=3,
        num_return_sequences=3,
        do_sample=False,
        max_new_tokens=12,
        length_penalty=0.0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == (3, len(prompt) + 12)
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        assert seq[: len(prompt)] == prompt
        want = _sink_logprob(gen_model, cfg, prompt, seq[len(prompt) :])
        assert score == pytest.approx(want, abs=1e-4)


# --------------------------------------------------------------------------- refusals
def test_absolute_positions_refused_naming_the_scheme(tiny_model_factory):
    with pytest.raises(SinklabError, match="absolute"):
        SinkCache(tiny_model_factory("gpt2"), CacheConfig())


def test_length_dependent_rope_refused(tiny_model_factory):
    model = tiny_model_factory(
        "llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    )
    with pytest.raises(SinklabError, match="dynamic"):
        SinkCache(model, CacheConfig())


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(n_sink=0), "positive"),
        (dict(window=-3), "positive"),
        (dict(policy="bogus"), "not one of"),
        (dict(policy="sink-auto"), "sink-auto needs"),
        (dict(policy="sink-auto", sink_positions=(0, 600)), "must lie in"),
    ],
)
def test_bad_configs_raise_sinklab_error(kwargs, needle):
    with pytest.raises(SinklabError, match=needle):
        CacheConfig(**kwargs)


def test_window_beyond_max_positions_refused(models):
    with pytest.raises(SinklabError, match="max positions"):
        SinkCache(models["llama"], CacheConfig("sink", 4, 508))  # tiny models: 512 positions


def test_wrong_positions_refused(models):
    model = models["llama"]
    cache = SinkCache(model, CacheConfig("sink", 2, 6))
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), cache=cache)
        with pytest.raises(SinklabError, match="has seen 3 tokens"):
            model(torch.tensor([[8]]), cache=cache, position_ids=torch.tensor([[0]]))


def test_each_layer_owns_its_state(tiny_model_factory):
    """A SinkLayer is built with what it needs and handed the step: it counts its own columns,
    knows no cache, and refuses an update the cache did not plan."""
    from sinklab.errors import SinklabError
    from sinklab.stream.cache import CacheConfig, SinkCache
    from sinklab.stream.layer import SinkLayer

    model = tiny_model_factory("llama", seed=1)
    cache = SinkCache(model, CacheConfig("sink", 2, 4))
    ids = torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(2))
    for t in range(9):
        model(ids[:, t : t + 1], cache=cache, **cache.prepare(1))
    for layer in cache.layers:
        assert isinstance(layer, SinkLayer) and not hasattr(layer, "owner")
        assert layer.get_seq_length() == cache.get_seq_length() == 9
        assert layer.capacity == 6 and layer.n_sinks == 2
    k = torch.zeros(1, 2, 1, 8)
    with pytest.raises(SinklabError, match="updated by its SinkCache"):
        SinkLayer(6, 2).update(k, k)
