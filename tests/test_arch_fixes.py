"""Architecture bugs (docs/architectures.md), one test each (every one failed before its fix):
sliding windows without layer types, NoPE layers, falcon's ALiBi, partial and interleaved RoPE,
refusals that were not needed, and the facts ``info`` shows."""

from __future__ import annotations

import pytest
import torch

from archs import arch_config, arch_model
from helpers import CliRun, assert_one_line_error, run_main
from sinklab.errors import SinklabError
from sinklab.models.rotary import ALIBI, ROPE, position_scheme, rope_of
from sinklab.stream.cache import CacheConfig, SinkCache
from streamref import naive_logits


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _stream(model, ids: list[int], cfg: CacheConfig) -> torch.Tensor:
    cache = SinkCache(model, cfg)
    return torch.cat([model(torch.tensor([[t]]), cache=cache).logits[0] for t in ids])


@pytest.mark.parametrize("family", ["mistral", "phi3", "starcoder2"])
def test_sliding_window_on_every_layer(family):
    """The model's sliding mask was applied in ring-slot order (max |dlogit| ~4.5 here): now
    n_sink + window + 1 beyond the window is refused, and within it the numbers are right."""
    ids = _ids(24)
    with pytest.raises(SinklabError, match="sliding window of 8 tokens"):
        SinkCache(arch_model(family, sliding_window=8), CacheConfig("sink", 2, 6))
    model = arch_model(family, sliding_window=9)
    want = naive_logits(model, ids, {0, 1}, 6)
    torch.testing.assert_close(
        _stream(model, ids, CacheConfig("sink", 2, 6)), want, atol=1e-4, rtol=1e-4
    )


def test_nope_layers_keep_their_sinks_unrotated():
    """SmolLM3's NoPE layer had its sinks re-rotated (0.62 off the reference)."""
    model, ids = arch_model("smollm3", no_rope_layers=[0, 1]), _ids(24)
    got = _stream(model, ids, CacheConfig("sink", 2, 6))
    torch.testing.assert_close(got, naive_logits(model, ids, {0, 1}, 6), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "cohere2", "olmo3"])
def test_hybrid_sliding_layers_compute_what_the_model_computes(family):
    """With a sink window longer than the stream, a hybrid model's cache must give exactly the
    model's own logits: sliding layers keep the model's window (6 here, 24 tokens)."""
    model, ids = arch_model(family), _ids(24)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(
        _stream(model, ids, CacheConfig("sink", 2, 60)), want, atol=1e-4, rtol=1e-4
    )


def test_falcon_alibi_is_not_rope():
    """Falcon configs carry RoPE parameters even with alibi=True; the stream crashed."""
    model = arch_model("falcon", alibi=True)
    assert position_scheme(model.config) == ALIBI
    with pytest.raises(SinklabError, match="ALiBi"):
        SinkCache(model, CacheConfig("sink", 2, 6))


@pytest.mark.parametrize(("family", "rot_dim"), [("phi", 4), ("stablelm", 4), ("gpt_neox", 4)])
def test_partial_rotary_is_checked_on_the_rotated_slice(family, rot_dim):
    rope = rope_of(arch_model(family))
    assert rope.rot_dim == rot_dim and not rope.interleaved


@pytest.mark.parametrize("family", ["cohere", "glm4"])
def test_interleaved_rope(family):
    """Cohere and GLM rotate pairs (2i, 2i+1); they were refused (or wrong with the check off)."""
    model, ids = arch_model(family), _ids(24)
    assert rope_of(model).interleaved
    got = _stream(model, ids, CacheConfig("sink", 2, 6))
    torch.testing.assert_close(got, naive_logits(model, ids, {0, 1}, 6), atol=1e-4, rtol=1e-4)


def test_stablelm_probe_goes_through_the_seam():
    """StableLM lacks _supports_attention_backend but dispatches through the interface."""
    from sinklab.probe import probe

    model = arch_model("stablelm")
    result = probe(model, torch.tensor(_ids(12)))
    assert result.sink_mass.shape == (2, 4)


def test_dense_needs_no_rope(tiny_model_dir, tmp_path, capsys):
    """`stream --policy dense` on GPT-2 was refused: dense moves no key."""
    folder = str(tiny_model_dir("gpt2"))

    def stream(policy: str, out: str) -> CliRun:
        args = ["stream", "--model", folder, "--policy", policy, "--tokens", "24", "--method"]
        return run_main(capsys, *args, "step", "--out", str(tmp_path / out))

    run = stream("dense", "a")
    assert run.returncode == 0, run.stderr
    assert_one_line_error(stream("sink", "b"), "absolute")


def test_info_facts_gptj_is_rotary_falcon_kv_heads():
    from sinklab.models.arch import kv_heads

    assert position_scheme(arch_config("gptj")) == ROPE
    falcon = arch_config("falcon")
    assert kv_heads(falcon) == 2 and not hasattr(falcon, "num_key_value_heads")


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("gemma3_text", {}), ("gemma2", {}), ("smollm3", {"no_rope_layers": [0, 1]})],
)
def test_rebased_positions_on_hybrid_and_nope_layers(family, overrides):
    """prepare() rebases positions below the bound: a hybrid's sliding layers move along with
    their own RoPE (Gemma 3: another base), NoPE layers not at all; NLLs equal the unbounded."""
    model = arch_model(family, max_position_embeddings=24, **overrides)
    ids = _ids(80, seed=5)

    @torch.no_grad()
    def nll(bounded: bool) -> torch.Tensor:
        cache = SinkCache(model, CacheConfig("sink", 2, 6), max_position=24 if bounded else 10**6)
        out = []
        for t in range(len(ids) - 1):
            extra = cache.prepare(1)
            assert int(extra["position_ids"].max()) < (24 if bounded else 10**6)
            logits = model(torch.tensor([[ids[t]]]), cache=cache, **extra).logits[0, -1]
            out.append(float(torch.logsumexp(logits.double(), -1) - logits.double()[ids[t + 1]]))
        return torch.tensor(out)

    torch.testing.assert_close(nll(True), nll(False), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("family", "overrides", "why"),
    [
        ("bloom", {}, "from the attention mask"),
        ("mpt", {}, "ring-slot order"),
        ("falcon", {"alibi": True}, "every token seen"),
    ],
)
def test_alibi_refusals_say_why(family, overrides, why):
    """Item 3: each ALiBi model says why its bias cannot follow the sink cache; dense works
    (the matrix's "stream dense" column)."""
    with pytest.raises(SinklabError, match=why):
        SinkCache(arch_model(family, **overrides), CacheConfig("sink", 2, 6))


@pytest.mark.parametrize("policy", ["dense", "sink"])
def test_chunked_serves_sliding_and_nope_layers(policy):
    """--method chunked once scored sliding layers as global (gemma2 dense: 3 nats off, silently)
    and was refused on them; it now reads each layer's own band (every NoPE layer here)."""
    from sinklab.stream.band import chunked_nll
    from sinklab.stream.evaluate import stream_nll

    ids, cfg = torch.tensor(_ids(20)), CacheConfig(policy, 2, 6)
    for model in (arch_model("gemma2"), arch_model("smollm3", no_rope_layers=[0, 1])):
        got, _, _ = chunked_nll(model, ids, cfg, chunk=8)
        want, _, _ = stream_nll(model, ids, cfg)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
