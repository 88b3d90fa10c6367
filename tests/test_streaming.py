"""Streaming perplexity (every policy, recompute sampling, JSON) and bounded-memory generation on
tiny models; on SmolLM2, the StreamingLLM result: window collapses, sink tracks recompute."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sinklab.errors import SinklabError
from sinklab.stream.evaluate import StreamConfig, segment_ppl, streaming_perplexity
from sinklab.stream.generation import GenerateConfig, generate

ALL = ("dense", "window", "sink", "recompute", "sink-auto")


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama", seed=3)


def _ids(n: int) -> torch.Tensor:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(4))


def test_every_policy_equals_no_cache_when_the_window_covers_the_stream(llama):
    ids = _ids(14)
    with torch.no_grad():
        logits = llama(ids[None]).logits[0, :-1]
    want = (torch.logsumexp(logits, -1) - logits.gather(-1, ids[1:, None])[:, 0]).double()
    result = streaming_perplexity(llama, ids, StreamConfig(ALL, 4, 64, 14, probe_tokens=12))
    for policy, r in result.policies.items():
        torch.testing.assert_close(
            torch.tensor(r.nll, dtype=torch.float64), want, atol=1e-4, rtol=1e-4, msg=policy
        )
        assert r.ppl == pytest.approx(math.exp(float(want.mean())), rel=1e-4)
    assert len(result.policies["sink-auto"].sink_positions) == 4
    # the same NLLs everywhere: dense never collapses, said in every stream's JSON (bare too)
    where = result.to_json()["dense_collapse"]
    assert where["block"] == 1000 and where["at_token"] is None


def test_recompute_every_k_scores_every_kth_target_and_says_so(llama):
    ids = _ids(30)
    cfg = StreamConfig(("sink", "recompute"), 2, 6, 30, recompute_every=4, segment=10)
    result = streaming_perplexity(llama, ids, cfg)
    rec, sink = result.policies["recompute"], result.policies["sink"]
    assert [i for i, x in enumerate(rec.nll) if not math.isnan(x)] == list(range(0, 29, 4))
    assert rec.n_scored == 8 and rec.recompute_every == 4 and rec.max_cache_len is None
    assert sink.max_cache_len == 8 and len(sink.segment_ppl) == 3
    # before any eviction the oracle is the cache; after, it differs only slightly
    assert rec.nll[0] == pytest.approx(sink.nll[0], abs=1e-4)
    assert rec.nll[4] == pytest.approx(sink.nll[4], abs=1e-4)
    data = json.loads(json.dumps(result.to_json(), allow_nan=True))
    assert data["on_recompute_targets"]["recompute_every"] == 4
    assert data["on_recompute_targets"]["n_scored"] == 8
    assert set(data["policies"]["sink"]) >= {
        "ppl",
        "segment_ppl",
        "nll",
        "tokens_per_s",
        "peak_rss_mb",
        "max_cache_len",
    }


def test_progress_for_reports_every_policy(llama):
    seen: dict[str, tuple[int, int]] = {}
    streaming_perplexity(
        llama,
        _ids(20),
        StreamConfig(("window", "sink"), 2, 4, 20),
        progress_for=lambda p: lambda d, n, note: seen.__setitem__(p, (d, n)),
    )
    assert seen == {"window": (19, 19), "sink": (19, 19)}


def test_segment_ppl_skips_nan():
    nll = torch.tensor([0.0, math.nan, math.log(4.0), math.log(4.0)])
    assert segment_ppl(nll, 2) == pytest.approx([1.0, 4.0])


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(n_sink=0), "n_sink"),
        (dict(window=-1), "window"),
        (dict(policies=("x",)), "unknown"),
        (dict(recompute_every=0), "recompute_every"),
        (dict(n_tokens=1), "at least 2"),
        (dict(segment=100.0), "segment must be a positive integer"),
    ],
)
def test_bad_stream_configs(kwargs, needle):
    with pytest.raises(SinklabError, match=needle):
        StreamConfig(**kwargs)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_generate_is_bounded_streams_text_and_is_seeded(tiny_model_factory, tiny_tokenizer):
    model = tiny_model_factory("llama", seed=6)
    prompt = torch.tensor(tiny_tokenizer("To be or not to be").input_ids)
    cfg = GenerateConfig(max_new_tokens=40, n_sink=2, window=6, stop_at_eos=False)
    pieces: list[str] = []
    res = generate(model, tiny_tokenizer, prompt, cfg, on_text=pieces.append)
    assert len(res.new_tokens) == 40 and res.max_cache_len == 8
    assert "".join(pieces) == res.text == tiny_tokenizer.decode(res.new_tokens)
    hot = GenerateConfig(max_new_tokens=20, n_sink=2, window=6, temperature=1.5, seed=3)
    a, b = (generate(model, tiny_tokenizer, prompt, hot).new_tokens for _ in range(2))
    assert a == b


# ----------------------------------------------------------------------------- SmolLM2
@pytest.mark.integration
def test_smollm2_window_collapses_sink_tracks_recompute(smollm2):
    """StreamingLLM's finding on the real model, kept cheap (~40 s on 2 cores): n_sink 4 +
    window 60 over the first 192 tokens of the default corpus, the oracle on every 4th target.

    Measured here (fp32), on targets past the window (t >= 64): window PPL 49.1 against sink
    17.5 (2.8x); on the 32 recompute targets there, sink 18.04 against recompute 17.77 (+1.5%;
    over 256 tokens: +0.4%; at 4 + 508 over 3,000 tokens, +1.0% on the 150 shared targets of
    benchmarks/results/2026-11-30/stream-3k-sink-vs-recompute.json). Bounds with margin for
    other BLAS builds and the few targets: window at least 2x sink, sink within 5% of recompute.
    """
    from sinklab.corpus import load_text, token_stream

    ids = token_stream(load_text(), smollm2.tokenizer, 192)
    cfg = StreamConfig(("window", "sink", "recompute"), 4, 60, 192, recompute_every=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one-token steps: 2 threads gain little and, on a busy machine,
    try:  # spin-wait (measured here: 37 s with 1 thread, 260 s with 2 on a loaded box)
        result = streaming_perplexity(smollm2.model, ids, cfg)
    finally:
        torch.set_num_threads(threads)
    nll = {p: torch.tensor(r.nll[64:], dtype=torch.float64) for p, r in result.policies.items()}
    scored = ~nll["recompute"].isnan()
    ppl = {p: math.exp(float(x[~x.isnan()].mean())) for p, x in nll.items()}
    on_scored = {p: math.exp(float(x[scored].mean())) for p, x in nll.items()}
    assert ppl["window"] > 2 * ppl["sink"], ppl
    assert abs(on_scored["sink"] / on_scored["recompute"] - 1) < 0.05, on_scored


def test_one_policy_table_and_stream_run(llama):
    """Every policy is one row of POLICIES (the default run, `--policy all`, the report's order);
    StreamRun's progress ends at its total, and its argv parses back to the same config."""
    from sinklab.commands.stream import parse_policies
    from sinklab.stream import POLICIES, StreamRun

    assert StreamConfig().policies == tuple(POLICIES) == parse_policies("all")
    assert tuple(POLICIES) == ("dense", "window", "sink", "sink-auto", "recompute")
    config = StreamConfig(("window", "recompute"), 2, 4, 20, recompute_every=3, segment=5)
    assert [config.scored_every(p) for p in config.policies] == [1, 3]
    assert config.work("recompute") == pytest.approx(6 / 12)
    calls: list[tuple[float, float, str]] = []
    result = StreamRun(config).run(llama, _ids(30), lambda d, t, note: calls.append((d, t, note)))
    assert calls[-1][0] == pytest.approx(calls[-1][1]) == pytest.approx(19 * 1.5)
    assert calls[-1][2].startswith("recompute 19/19 ppl")
    assert len(result.policies["window"].nll) == 19  # the first `tokens` only
    argv = StreamRun(config).argv(["--model", "m"], "t.txt", "o")
    opts = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert argv[:2] == ["sinklab", "stream"] and opts["--policy"] == "window,recompute"
    rebuilt = StreamConfig(
        parse_policies(opts["--policy"]),
        int(opts["--n-sink"]),
        int(opts["--window"]),
        int(opts["--tokens"]),
        int(opts["--recompute-every"]),
        segment=int(opts["--segment"]),
        method=opts["--method"],
    )
    assert rebuilt == config and opts["--text"] == "t.txt" and opts["--out"] == "o"
