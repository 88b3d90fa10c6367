"""The chunked evaluator and the batched oracle equal their one-at-a-time references: the step
loop through SinkCache (itself pinned to a naive StreamingLLM in test_cache.py) and the
one-window-per-forward oracle. Tiny models use initializer_range 0.1 so attention is sharp enough
that a wrong sink position or a missed eviction moves the NLLs by far more than the tolerance."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from sinklab.errors import SinklabError
from sinklab.stream.band import chunked_nll, plan_chunk, window_starts
from sinklab.stream.cache import CacheConfig, SinkCache, kept_positions
from sinklab.stream.evaluate import StreamConfig, stream_nll, streaming_perplexity
from sinklab.stream.oracle import recompute_nll, recompute_nll_batched

FAMILIES = ("llama", "mistral", "qwen2", "gemma")
TOL = 2e-4


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    return {f: tiny_model_factory(f, seed=1, initializer_range=0.1) for f in FAMILIES}


def _ids(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------ the plan (pure)
@pytest.mark.parametrize(
    ("sinks", "recent"), [((0, 1), 6), ((), 8), ((0, 4, 7), 6), ((3,), 2), ((0, 1, 2, 3), 1)]
)
def test_window_starts_reproduce_kept_positions(sinks, recent):
    """Query t reads the sinks before lo(t), then lo(t)..t-1: exactly kept_positions(t)."""
    lo = window_starts(0, 40, sinks, recent)
    for t in range(40):
        got = sorted({s for s in sinks if s < lo[t]} | set(range(int(lo[t]), t)))
        assert got == kept_positions(t, sinks, recent), t


def test_plan_keeps_at_most_the_cache_between_chunks():
    """Memory: the keys carried to the next chunk never exceed n_sink + window (never T)."""
    p0, sinks, recent = 0, (0, 1), 6
    for t0 in range(0, 200, 13):
        plan = plan_chunk(t0, t0 + 13, p0, sinks, recent)
        assert plan.t1 - plan.p0_next <= len(sinks) + recent
        assert plan.band.shape == (13, plan.t1 - p0)
        p0 = plan.p0_next


# ------------------------------------------------------------------ chunked == step
EVERY_POLICY = [  # (policy, n_sink, window, sink-auto positions, chunk)
    ("dense", 2, 6, None, 16),
    ("window", 2, 6, None, 7),
    ("sink", 2, 6, None, 16),
    ("sink-auto", 3, 6, (1, 4, 7), 7),
]
SIZES = [("sink", 1, 5, None, 40), ("sink", 4, 8, None, 5), ("sink-auto", 2, 9, (0, 10), 16)]


def _check(model, ids, policy, n_sink, window, auto, chunk, tol=TOL):
    cfg = CacheConfig(policy, n_sink, window, auto)
    want, most, _ = stream_nll(model, ids, cfg)
    got, got_most, _ = chunked_nll(model, ids, cfg, chunk)
    err = float((got - want).abs().max())
    assert err <= tol, (policy, n_sink, window, chunk, err)
    assert got_most == most
    return want


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_equals_step_every_policy(models, family):
    """Every policy; the stream (40 tokens) is 4-5 windows long."""
    for case in EVERY_POLICY:
        _check(models[family], _ids(40), *case)


@pytest.mark.parametrize("case", SIZES)
def test_chunked_equals_step_other_sizes_and_chunks(models, case):
    """Chunks shorter than, about and longer than the window; sinks inside the first window."""
    _check(models["llama"], _ids(40, seed=3), *case)


def test_positions_stay_bounded_and_rebase_like_the_step_loop(tiny_model_factory):
    """max_position_embeddings 24, 90 tokens: positions restart (several rebases) as the step
    loop's SinkCache.prepare does; the NLLs still equal step's, and no position reaches 24."""
    model = tiny_model_factory("llama", seed=1, initializer_range=0.1, max_position_embeddings=24)
    seen: list[int] = []

    def record(module, args, kwargs):  # both loops pass the positions they chose
        seen.append(int(kwargs["position_ids"].max()))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        for case in [("sink", 2, 6, None, 5), ("sink-auto", 3, 17, (1, 4, 7), 64)]:
            seen.clear()
            _check(model, _ids(90), *case)
            assert max(seen) == 23
    finally:
        hook.remove()


def test_on_logits_gives_every_querys_distribution_as_the_step_loop_does(models):
    """``on_logits(t0, logits)``: one row per query, in order, each the step loop's own logits
    (SinkCache, one token a forward: what ``generate`` decodes with) within the tolerance, past
    several evictions; a row off by one query would miss by far more."""
    model, ids, cfg = models["qwen2"], _ids(40), CacheConfig("sink", 2, 6)
    rows: dict[int, torch.Tensor] = {}
    chunked_nll(model, ids, cfg, 7, on_logits=lambda t0, lg: rows.update({t0: lg.clone()}))
    assert sorted(rows) == list(range(0, 39, 7))
    got = torch.cat([rows[t0] for t0 in sorted(rows)])
    assert got.shape == (39, model.config.vocab_size)
    cache = SinkCache(model, cfg)
    with torch.inference_mode():
        want = torch.cat(
            [
                model(ids[t : t + 1].view(1, 1), cache=cache, **cache.prepare(1)).logits[0]
                for t in range(39)
            ]
        )
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    assert float((got[1:] - want[:-1]).abs().max()) > 100 * TOL


def test_generates_steps_are_the_band_evaluator_read_along_its_tokens(models, tiny_tokenizer):
    """What the vLLM tests' teacher-forced reference rests on (tests/vllm_helpers.py:
    sinklab_along): ``generate``'s logits at every step (``on_logits``), greedy, well past the
    first eviction, equal the band evaluator's read along the prompt and ``generate``'s own
    tokens, and each step's token is that row's argmax."""
    from sinklab.stream.generation import GenerateConfig, generate

    model, prompt, new = models["llama"], _ids(5), 40
    steps: list[torch.Tensor] = []
    cfg = GenerateConfig(max_new_tokens=new, n_sink=2, window=6, stop_at_eos=False)
    out = generate(model, tiny_tokenizer, prompt, cfg, on_logits=lambda x: steps.append(x))
    tokens = out.new_tokens
    assert len(tokens) == len(steps) == new
    assert tokens == [int(x.argmax()) for x in steps]
    rows: dict[int, torch.Tensor] = {}
    ids = torch.cat([prompt, torch.tensor(tokens)])
    chunked_nll(model, ids, CacheConfig("sink", 2, 6), 16,
                on_logits=lambda t0, lg: rows.update({t0: lg}))  # fmt: skip
    along = torch.cat([rows[t0] for t0 in sorted(rows)])[len(prompt) - 1 :]
    torch.testing.assert_close(along, torch.stack(steps).float(), atol=TOL, rtol=TOL)


def test_the_equality_is_sensitive(models):
    """What the tolerance separates: window vs sink, and sinks scored at the wrong distance."""
    model, ids = models["llama"], _ids(40)
    sink, _, _ = chunked_nll(model, ids, CacheConfig("sink", 2, 6), 16)
    window, _, _ = chunked_nll(model, ids, CacheConfig("window", 2, 6), 16)
    assert float((sink - window).abs().max()) > 100 * TOL
    import sinklab.stream.band as chunked

    real = chunked.plan_chunk

    def unrotated(*args):  # sinks scored at their own positions instead of just before the window
        plan = real(*args)
        if plan.off is not None:
            plan.off = plan.off * 0
        return plan

    chunked.plan_chunk = unrotated
    try:
        wrong, _, _ = chunked_nll(model, ids, CacheConfig("sink", 2, 6), 16)
    finally:
        chunked.plan_chunk = real
    assert float((sink - wrong).abs().max()) > 20 * TOL


def test_chunked_restores_the_attention_implementation(models):
    model = models["qwen2"]
    before = model.config._attn_implementation
    chunked_nll(model, _ids(20), CacheConfig("sink", 2, 6), 8)
    assert model.config._attn_implementation == before


# ------------------------------------------------------- hybrid sliding-window, NoPE, sink logits
HYBRIDS = ("gemma2", "gemma3_text", "gpt_oss", "olmo3", "cohere2")  # sliding 6 + global layers
HYBRID_CASES = [  # (policy, n_sink, window, sink-auto positions, chunk): 40 tokens evict
    *EVERY_POLICY,
    ("sink", 2, 10, None, 16),  # the sink cache wider than the sliding window
    ("sink", 1, 3, None, 5),  # narrower
]


def _loaded(family: str, **overrides):
    """A tiny archs model with the attention implementation sinklab's loader picks for it
    (gemma2 and gpt-oss: sinklab's registered function, for soft-capping and sink logits)."""
    from archs import arch_model
    from sinklab.models.arch import attn_implementation
    from sinklab.seam import register

    register()
    model = arch_model(family, seed=1, **overrides)
    model.set_attn_implementation(attn_implementation(type(model)))
    return model


@pytest.mark.parametrize("family", HYBRIDS)
def test_band_equals_step_on_hybrids_every_policy(family):
    """Sliding layers keep the model's own window band, global layers the sinks + window: the
    step loop's NLLs for every policy (dense: the model's own window on sliding layers)."""
    model = _loaded(family)
    for case in HYBRID_CASES:
        _check(model, _ids(40) % 120, *case, tol=1e-4)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("smollm3", {}), ("gpt_oss", {"layer_types": ["full_attention"] * 2})],
)
def test_band_equals_step_on_nope_layers_and_learned_sinks(family, overrides):
    """SmolLM3's NoPE layer (keys carry no position: sinks scored unrotated) and gpt-oss's
    learned sink logits without windows, every policy."""
    model = _loaded(family, **overrides)
    for case in HYBRID_CASES:
        _check(model, _ids(40) % 120, *case, tol=1e-4)


@pytest.mark.parametrize("family", ("gemma3_text", "gpt_oss"))
def test_hybrid_positions_rebase_like_the_step_loop(family):
    """max_position_embeddings 24, 90 tokens: both loops restart positions; the sliding layers'
    kept keys are rotated back by their own RoPE (Gemma 3: a local base of its own)."""
    model = _loaded(family, max_position_embeddings=24)
    for case in [("sink", 2, 6, None, 5), ("sink-auto", 3, 17, (1, 4, 7), 64)]:
        _check(model, _ids(90) % 120, *case, tol=1e-4)


def test_the_hybrid_equality_is_sensitive(monkeypatch):
    """What the tolerance separates on hybrids: sliding layers scored with the sinks + window of
    the global ones, gpt-oss's sink logits left out, and a NoPE layer's sinks rotated."""
    import sinklab.stream.band as band

    ids, cfg = _ids(40) % 120, CacheConfig("sink", 2, 6)
    real_bands, real_attend = band.layer_bands, band.BandState.attend

    def err(model) -> float:
        want, _, _ = stream_nll(model, ids, cfg)
        got, _, _ = chunked_nll(model, ids, cfg, 8)
        return float((got - want).abs().max())

    def as_global(model, cache):  # every layer keeps sinks + window (the old refusal's reason)
        return [band.LayerBand(cfg.sinks, cfg.recent, cache.rope) for _ in real_bands(model, cache)]

    def without_sink_logits(self, *args, sink_logit=None):
        return real_attend(self, *args[:6])

    def all_rotated(model, cache):
        return [band.LayerBand(b.sinks, b.recent, cache.rope) for b in real_bands(model, cache)]

    gemma3, gpt_oss = _loaded("gemma3_text"), _loaded("gpt_oss")
    smollm3 = _loaded("smollm3")
    assert max(err(gemma3), err(gpt_oss), err(smollm3)) <= 1e-4
    monkeypatch.setattr(band, "layer_bands", as_global)
    assert min(err(gemma3), err(gpt_oss)) > 1000 * TOL
    monkeypatch.setattr(band, "layer_bands", all_rotated)
    assert err(smollm3) > 100 * TOL
    monkeypatch.setattr(band, "layer_bands", real_bands)
    monkeypatch.setattr(band.BandState, "attend", without_sink_logits)
    assert err(gpt_oss) > 1000 * TOL


# ------------------------------------------------------------------------- refusals
def _message(fn) -> str:
    with pytest.raises(SinklabError) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize(
    ("family", "overrides", "cfg"),
    [
        ("gpt2", {}, CacheConfig("sink", 2, 6)),
        (
            "llama",
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            CacheConfig("sink", 2, 6),  # (dense moves no key: accepted by both)
        ),
        ("llama", {}, CacheConfig("sink", 4, 508)),  # not below the tiny model's 512 positions
    ],
)
def test_chunked_refuses_what_the_cache_refuses(tiny_model_factory, family, overrides, cfg):
    model = tiny_model_factory(family, **overrides)
    want = _message(lambda: SinkCache(model, cfg))
    assert _message(lambda: chunked_nll(model, _ids(10), cfg)) == want


REFUSAL_ROWS = [  # (archs family, overrides, a phrase of the refusal; None: chunked serves it)
    ("llama", {}, None),
    ("mistral", {"sliding_window": 9}, None),  # every layer slides, 2 + 6 fits inside 9
    ("gemma2", {}, None),  # hybrid: sliding + global layers (test_band_equals_step_on_hybrids)
    ("smollm3", {}, None),  # a NoPE layer
    ("gpt_oss", {"layer_types": ["full_attention"] * 2}, None),  # learned sink logits, no window
    ("falcon", {}, "does not dispatch attention"),
    ("gpt2", {}, "learned absolute position embeddings"),  # the sink cache's own refusal
]


@pytest.mark.parametrize(("family", "overrides", "phrase"), REFUSAL_ROWS)
def test_chunked_refusal_is_the_one_decision_made_before_any_forward(family, overrides, phrase):
    """chunked_refusal decides from the model alone; chunked_nll refuses with exactly its reason
    before the model runs (or equals the step loop), and StreamConfig's methods follow it."""
    from archs import arch_model
    from sinklab.stream.band import chunked_refusal

    model, cfg, ids = arch_model(family, **overrides), CacheConfig("sink", 2, 6), _ids(24) % 120
    forwards = []
    model.register_forward_pre_hook(lambda *a: forwards.append(1))
    reason = chunked_refusal(model, cfg)
    assert not forwards
    auto = StreamConfig(("sink",), 2, 6, 24)
    explicit = StreamConfig(("sink",), 2, 6, 24, method="chunked")
    if phrase is None:
        assert reason is None
        assert auto.choose_method(model)[0] == explicit.check_model(model)[0] == "chunked"
        got, _, _ = chunked_nll(model, ids, cfg, chunk=8)
        want, _, _ = stream_nll(model, ids, cfg)
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
        return
    assert phrase in reason and "\n" not in reason
    assert _message(lambda: chunked_nll(model, ids, cfg)) == reason
    assert _message(lambda: explicit.check_model(model)) == reason
    assert not forwards
    method, why = auto.choose_method(model)
    assert method == "step" and why == "auto: " + reason.split("; ")[0]


def test_a_lab_attention_variant_is_refused_with_its_reason(tiny_model_factory):
    """The one attention chunked streaming does not serve: a lab variant (here softmax1, which
    the seam honours on any module that names it); refused before any forward, step instead."""
    from sinklab.models.arch import attention_modules
    from sinklab.stream.band import chunked_refusal

    model, cfg = tiny_model_factory("llama"), CacheConfig("sink", 2, 6)
    for m in attention_modules(model):
        m.attention_variant = "softmax1"
    reason = chunked_refusal(model, cfg)
    assert reason is not None and "another attention variant" in reason and "\n" not in reason
    assert _message(lambda: chunked_nll(model, _ids(10), cfg)) == reason
    method, why = StreamConfig(("sink",), 2, 6, 24).choose_method(model)
    assert method == "step" and why.startswith("auto: chunked streaming: LlamaAttention uses")


@pytest.mark.parametrize(
    ("family", "method"), [("gpt2", "chunked"), ("gemma2", "chunked"), ("bloom", "step")]
)
def test_dense_alone_streams_by_auto_on_models_whose_keys_cannot_move(family, method):
    """dense moves no key: auto streams it on absolute-position models by chunked (positions are
    the stream's), on hybrids by chunked (sliding layers read the model's own window) and on
    models outside AttentionInterface by step; every way, the model's own next-token losses."""
    from archs import arch_model
    from sinklab.models.arch import attn_implementation
    from sinklab.seam import register

    register()
    model, ids = arch_model(family), _ids(30) % 120
    model.set_attn_implementation(attn_implementation(type(model)))
    config = StreamConfig(("dense",), 2, 6, 30, chunk=8)
    assert config.check_model(model)[0] == method
    result = streaming_perplexity(model, ids, config)
    assert result.method == method
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].double()
    want = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
    got = torch.tensor(result.policies["dense"].nll, dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bad_method_and_chunk():
    with pytest.raises(SinklabError, match="unknown method"):
        StreamConfig(method="fast")
    with pytest.raises(SinklabError, match="chunk"):
        StreamConfig(chunk=0)


# ------------------------------------------------------------------------ the oracle
@pytest.mark.parametrize(("every", "batch"), [(1, 1), (1, 5), (3, 4), (7, 64)])
def test_batched_oracle_equals_one_window_per_forward(models, every, batch):
    model, ids = models["mistral"], _ids(40, seed=5)
    want, longest, _ = recompute_nll(model, ids, 2, 6, every)
    got, got_longest, _ = recompute_nll_batched(model, ids, 2, 6, every, batch)
    assert torch.equal(got.isnan(), want.isnan())
    assert int((~got.isnan()).sum()) == len(range(0, 39, every))
    assert float((got - want).nan_to_num().abs().max()) <= TOL
    assert got_longest == longest == 9


# ---------------------------------------------------------------------- the JSON
def test_both_methods_give_the_same_json(models):
    model, ids = models["gemma"], _ids(30, seed=6)
    data = {}
    for method in ("step", "chunked"):
        cfg = StreamConfig(
            ("dense", "window", "sink", "recompute", "sink-auto"),
            2,
            6,
            30,
            recompute_every=3,
            probe_tokens=8,
            segment=20,
            method=method,
            chunk=16,
        )
        data[method] = json.loads(json.dumps(streaming_perplexity(model, ids, cfg).to_json()))
    step, chunk = data["step"], data["chunked"]
    assert set(step) == set(chunk) and set(step["policies"]) == set(chunk["policies"])
    for policy, a in step["policies"].items():
        b = chunk["policies"][policy]
        assert set(a) == set(b)
        for x, y in zip(a["nll"], b["nll"], strict=True):
            assert (math.isnan(x) and math.isnan(y)) or abs(x - y) <= TOL, policy
        assert b["segment_ppl"] == pytest.approx(a["segment_ppl"], rel=1e-3)
        assert (a["max_cache_len"], a["n_scored"], a["sink_positions"]) == (
            b["max_cache_len"],
            b["n_scored"],
            b["sink_positions"],
        )
    assert step["on_recompute_targets"]["n_scored"] == chunk["on_recompute_targets"]["n_scored"]


# ----------------------------------------------------------------------------- SmolLM2
@pytest.mark.integration
def test_smollm2_chunked_equals_step_over_400_tokens(smollm2):
    """400 tokens with 4 + 60: 336 evictions, the 60-slot ring wrapped five times, and each
    chunk of 256 queries spans four wraps. (It was 1,500 tokens with 4 + 252; the
    tiny-model tests above cover the other shapes, and benchmarks/stream_methods.py the long
    SmolLM2 run: 8,180 targets within 3.2e-5.) Idle, step costs about 65 ms a token."""
    from sinklab.corpus import load_text, token_stream

    ids = token_stream(load_text(), smollm2.tokenizer, 400)
    cfg = CacheConfig("sink", 4, 60)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one-token steps spin-wait with 2 threads on a busy machine
    try:
        t0 = time.perf_counter()
        want, most, _ = stream_nll(smollm2.model, ids, cfg)
        t1 = time.perf_counter()
        got, got_most, _ = chunked_nll(smollm2.model, ids, cfg)
        t2 = time.perf_counter()
    finally:
        torch.set_num_threads(threads)
    print(f"step {t1 - t0:.1f} s, chunked {t2 - t1:.1f} s, max |dNLL| {(got - want).abs().max()}")
    assert float((got - want).abs().max()) <= TOL
    assert got_most == most == 64


# ----------------------------------------------------------------------- Gemma 3 270M
@pytest.mark.integration
def test_gemma3_270m_chunked_equals_step_on_an_evicting_stream():
    """The real Gemma 3 270M (15 of 18 layers slide over 512 tokens, 3 are global) with its
    sliding layers' window cut to 12 (config and modules, as the model reads it), so that in 48
    tokens both kinds evict: the sliding layers 36 times, the global ones (4 + 20) 24 times.
    Chunked equals step on real attention; the cut window changed what they read (chunked on the
    model's own window differs). About 20 s on 2 idle cores, most of it the load and the steps."""
    from sinklab.corpus import load_text, token_stream
    from sinklab.models.arch import attention_modules, decoder_config, layer_kinds
    from sinklab.models.loading import load_model

    loaded = load_model("gemma3-270m")
    model, text_cfg = loaded.model, decoder_config(loaded.model)
    ids = token_stream(load_text(), loaded.tokenizer, 48)
    kinds = layer_kinds(text_cfg)
    assert sum(k.window == 512 for k in kinds) == 15 and len(kinds) == 18
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one-token steps spin-wait with 2 threads on a busy machine
    try:
        own, _, _ = chunked_nll(model, ids, CacheConfig("sink", 4, 20), 24)
        text_cfg.sliding_window = 12
        for m in attention_modules(model):
            if m.sliding_window is not None:
                m.sliding_window = 12
        assert sum(k.window == 12 for k in layer_kinds(text_cfg)) == 15
        cut = _check(model, ids, "sink", 4, 20, None, 24, tol=1e-4)
    finally:
        torch.set_num_threads(threads)
    assert float((cut - own).abs().max()) > 0.1
