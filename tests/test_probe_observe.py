"""The probe's observation path (sinklab.seam.observe): every metric read from the fused kernel's
log-sum-exp equals the block path's, for every weight variant it serves; what it does not serve
takes the block path with the reason recorded; the route of each case is asserted."""

import json

import pytest
import torch

from archs import arch_model
from conftest import make_tiny_model
from helpers import assert_one_line_error, run_main
from sinklab.errors import SinklabError
from sinklab.models.rotary import Rope
from sinklab.probe import ProbeConfig, probe, spec
from sinklab.seam import AttentionHandler, sinklab_attention
from sinklab.seam.observe import LayerView

FORCED = "block: AttentionHandler reads or changes the weights block by block"
TENSORS = [n for n in spec.names("attention")]  # every metric the attention adds up


def _lab(variant: str):
    from sinklab.lab.model import LabConfig, LabForCausalLM

    torch.manual_seed(0)
    cfg = LabConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        attention_variant=variant,
    )
    model = LabForCausalLM(cfg).eval()
    if variant == "sink":  # a learned logit per head, far from softmax1's 0
        for layer in model.model.layers:
            layer.self_attn.sink_logit.data = torch.tensor([-2.0, 0.5, 1.5, 3.0])
    return model


def _both(model, ids, config):
    """The probe as it routes itself, and the same probe forced onto the block path (a bound
    handler that does not opt in to the observation path)."""
    fused = probe(model, ids, config)
    with sinklab_attention(model, AttentionHandler()):
        block = probe(model, ids, config)
    assert block.attention_path == [FORCED] * block.n_layers
    return fused, block


def _assert_same(a, b, atol):
    for name in TENSORS:
        torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=atol, rtol=0)
    assert a.head_kind == b.head_kind and a.sink_rate == b.sink_rate
    pa, pb = a.sink_positions, b.sink_positions
    assert [p["position"] for p in pa] == [p["position"] for p in pb]
    assert all(abs(p["mass"] - q["mass"]) <= atol for p, q in zip(pa, pb, strict=True))


GPT_OSS = "sink logit (gpt-oss s_aux), sliding window"
CASES = {  # case -> (model factory, route of each layer)
    "softmax": (lambda: arch_model("gpt2"), ["fused", "fused"]),
    "softmax GQA": (lambda: make_tiny_model("llama"), ["fused", "fused"]),
    "softmax1": (lambda: _lab("softmax1"), ["fused", "fused"]),
    "sink logit": (lambda: _lab("sink"), ["fused", "fused"]),
    GPT_OSS: (
        lambda: arch_model("gpt_oss"),
        ["block: sliding window of 6 keys (an explicit mask)", "fused"],
    ),
    "sliding window, every layer": (
        lambda: make_tiny_model("mistral", sliding_window=8),
        ["block: sliding window of 8 keys (an explicit mask)"] * 2,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_metric_equals_the_block_path_float64(case):
    """float64 to 1e-6; gpt-oss in float32 to 1e-5 (its experts' grouped matmul has no float64)."""
    factory, routes = CASES[case]
    model = factory() if case == GPT_OSS else factory().double()
    if case == GPT_OSS:
        for layer in model.model.layers:  # s_aux starts random and small: make it matter
            layer.self_attn.sinks.data = torch.tensor([-2.0, 0.5, 1.5, 3.0])
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, 40), generator=torch.Generator().manual_seed(2))
    for q0 in (0, 5):
        fused, block = _both(model, ids, ProbeConfig(q0=q0))
        assert fused.attention_path == routes
        _assert_same(fused, block, atol=1e-5 if case == GPT_OSS else 1e-6)


class _View(AttentionHandler):
    fused_needs = frozenset()

    def observe_layer(self, view: LayerView) -> None:
        self.view = view


def test_bfloat16_sink_logit_is_the_float32_one_as_on_the_block_path():
    """bfloat16 q, k, v and a learned sink logit: the fused kernel's log-sum-exp counts the sink
    slot at the logit the block path uses (float32), so lse and the mass of the real keys equal
    a float64 computation from the same bfloat16 numbers to the kernel's own error (6e-5 here
    without a sink slot); before, the logit / scale was rounded to bfloat16 (0.01 off at a logit
    of 3) and lse and mass were off by up to 5e-3."""
    from sinklab.seam.observe import observe_attention

    g = torch.Generator().manual_seed(5)
    b, h, t, d = 1, 4, 24, 8
    q, k, v = (torch.randn(b, h, t, d, generator=g).to(torch.bfloat16) for _ in range(3))
    lam = torch.tensor([-2.0, 0.5, 1.5, 3.0], dtype=torch.bfloat16)
    scale = d**-0.5  # not a power of 2: lam / scale is not a bfloat16 number
    rec = _View()
    kw = {"scale": scale, "variant": "sink", "sink_logit": lam}
    observe_attention(torch.nn.Identity(), 0, [rec], q, k, v, **kw)
    z = torch.einsum("bhtd,bhsd->bhts", q.double(), k.double()) * scale  # (B, H, T, T)
    z = z.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    sink = lam.double().view(1, h, 1, 1).expand(b, h, t, 1)
    lse = torch.cat([z, sink], -1).logsumexp(-1)  # (B, H, T)
    torch.testing.assert_close(rec.view.lse.double(), lse, atol=2e-4, rtol=0)
    mass = 1 - torch.exp(lam.double().view(1, h, 1) - lse)
    torch.testing.assert_close(rec.view.mass().double(), mass, atol=2e-4, rtol=0)


def test_sink_logit_model_in_bfloat16_observes_as_the_block_path():
    """The tiny sink-logit model in bfloat16: the fused path's metrics equal the block path's
    within bfloat16's own rounding (the output-based ones round the outputs: looser). Before,
    the entropy was 7e-3 nats off (the sink logit rounded to bfloat16 on the fused path only)."""
    model = _lab("sink").to(torch.bfloat16)
    ids = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(2))
    fused, block = _both(model, ids, ProbeConfig())
    assert fused.attention_path == ["fused", "fused"]
    loose = {"value_norm_ratio", "sink_output_share"}  # from bfloat16 outputs
    for name in TENSORS:
        atol = 1e-2 if name in loose else 1e-3
        torch.testing.assert_close(getattr(fused, name), getattr(block, name), atol=atol, rtol=0)


def test_softcapping_takes_the_block_path_with_its_reason():
    model = arch_model("gemma2", attn_logit_softcapping=5.0).double()
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, 24), generator=torch.Generator().manual_seed(3))
    fused, block = _both(model, ids, ProbeConfig())
    assert fused.attention_path == ["block: logit softcapping (5) has no log-sum-exp kernel"] * 2
    _assert_same(fused, block, atol=0)  # the same path: the same numbers


def test_an_intervention_keeps_the_block_path():
    from sinklab.seam.interventions import mask_sink

    model = make_tiny_model("llama")
    ids = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(4))
    with mask_sink(model, positions=[0]):
        res = probe(model, ids, ProbeConfig(q0=1))  # query 0 sees key 0 alone: kept
    assert all(p.startswith("block: ") and "reads or changes" in p for p in res.attention_path)
    assert res.sink_mass.abs().max() == 0  # after the intervention: key 0 masked from query 1


class _Rows(AttentionHandler):
    """Keeps each layer's per-query numbers of the observation path."""

    fused_needs = frozenset()

    def __init__(self):
        self.seen = {}

    def observe_layer(self, view: LayerView) -> None:
        self.seen[view.layer] = torch.cat(
            [view.weights_at(0), view.diagonal(0), view.diagonal(1), view.lse], -1
        )  # (1, H, 4T - 1)


def _per_query(model, ids):
    rec = _Rows()
    with sinklab_attention(model, rec), torch.no_grad():
        model(ids, use_cache=False)
    t = ids.shape[1]
    return {
        layer: (x[..., :t], x[..., t : 2 * t], x[..., 2 * t : 3 * t - 1], x[..., 3 * t - 1 :])
        for layer, x in rec.seen.items()
    }


def test_causal_later_tokens_change_nothing_at_earlier_queries():
    model = make_tiny_model("llama").double()
    ids = torch.randint(3, 500, (1, 32), generator=torch.Generator().manual_seed(5))
    other = ids.clone()
    other[:, 20:] = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(6))
    a, b = _per_query(model, ids), _per_query(model, other)
    for layer in a:
        for x, y in zip(a[layer], b[layer], strict=True):
            torch.testing.assert_close(x[..., :19], y[..., :19], atol=1e-12, rtol=0)
        assert not torch.allclose(a[layer][3][..., 20:], b[layer][3][..., 20:])  # later: differ


def test_fast_measures_only_the_few_column_metrics():
    model = make_tiny_model("qwen2")
    ids = torch.randint(3, 500, (1, 30), generator=torch.Generator().manual_seed(7))
    full = probe(model, ids, ProbeConfig(q0=2))
    fast = probe(model, ids, ProbeConfig(q0=2, metrics="fast"))
    assert fast.attention_path == ["fused"] * 2
    skipped = {"entropy", "received", "sink_positions"}
    assert {n for n in spec.names() if getattr(fast, n) is None} == skipped
    for name in set(TENSORS) - skipped:
        torch.testing.assert_close(getattr(fast, name), getattr(full, name), atol=0, rtol=0)
    data = fast.to_json()
    assert data["entropy"] is None and data["sink_positions"] is None
    assert data["attention_path"] == ["fused", "fused"]
    with pytest.raises(SinklabError, match="--metrics all"):
        ProbeConfig(metrics="most")


def test_cli_metrics_fast_and_its_refusal(capsys, tmp_path, tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    args = ["probe", "--model", model, "--text", "shakespeare:hamlet", "--tokens", "32"]
    proc = run_main(capsys, *args, "--metrics", "fast", "--out", str(tmp_path), "--no-figures")
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "probe.json").read_text())
    assert data["entropy"] is None and data["meta"]["params"]["metrics"] == "fast"
    assert data["attention_path"] == ["fused", "fused"]
    assert "not measured" in proc.stdout  # the sink-positions sentence says so
    bad = run_main(capsys, *args, "--metrics", "some", "--out", str(tmp_path / "x"))
    assert_one_line_error(bad, "--metrics")


def test_rope_builds_cos_sin_on_the_keys_device():
    """A rotation on another device never goes through the host: on the meta device (no data,
    no copy to the CPU possible) ``shift`` still works."""
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    rope = Rope(inv, 8, "default")
    x = torch.randn(3, 5, 8)
    cpu = rope.shift(x, torch.arange(5))
    meta = rope.shift(x.to("meta"), torch.arange(5, device="meta"))
    assert meta.device.type == "meta" and meta.shape == cpu.shape
    assert torch.device("meta") in rope._on_device  # inv_freq copied there once, then reused
    angle = 3 * inv[1]  # position 3, pair 1 (rotate_half layout: dims 1 and 5)
    want = x[0, 3, 1] * torch.cos(angle) - x[0, 3, 5] * torch.sin(angle)
    torch.testing.assert_close(cpu[0, 3, 1].double(), want, atol=1e-6, rtol=0)


@pytest.mark.integration
def test_smollm2_fused_equals_block_at_1024(smollm2):
    from sinklab.corpus import load_text, token_stream

    ids = token_stream(load_text("shakespeare:hamlet"), smollm2.tokenizer, 1024)
    fused, block = _both(smollm2.model, ids, ProbeConfig(q0=16))
    assert fused.attention_path == ["fused"] * fused.n_layers
    _assert_same(fused, block, atol=1e-5)
