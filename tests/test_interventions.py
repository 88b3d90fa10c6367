"""Interventions: scoped (bitwise restore), exact against hand computations and references."""

import pytest
import torch

from conftest import make_tiny_model
from helpers import Recorder
from sinklab.ablate.first_token import first_token
from sinklab.attention import sink_softmax
from sinklab.errors import SinklabError
from sinklab.seam import AttentionHandler, sinklab_attention
from sinklab.seam.interventions import (
    AttentionMix,
    AttentionReplace,
    AttentionTemperature,
    MaskSink,
    SinkLogit,
    attention_mix,
    attention_temperature,
    intervene,
    jacobian_sensitivity,
    mask_sink,
    sink_logit,
)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", n_layers=2)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 500, (2, 19), generator=torch.Generator().manual_seed(3))


# what an observer entered after an intervention keeps of each chunk (the final weights, ...)
ALL_FIELDS = ("scores", "mask", "weights", "value", "output")


INTERVENTIONS = {
    "mask_sink": lambda m: mask_sink(m, positions=[0]),
    "mask_sink_heads": lambda m: mask_sink(m, positions=[0, 2], layers=[1], heads=[0, 3]),
    "attention_mix_0.3": lambda m: attention_mix(m, 0.3),
    "attention_temperature_2": lambda m: attention_temperature(m, 2.0, layers=[1]),
    "attention_replace_0.3": lambda m: intervene(m, AttentionReplace(lam=0.3)),
    "sink_logit": lambda m: sink_logit(m, 0.0, layers=[0]),
}


@pytest.mark.parametrize("name", list(INTERVENTIONS))
def test_every_intervention_restores_bitwise(model, ids, name):
    with torch.no_grad():
        before = model(ids).logits
        with INTERVENTIONS[name](model):
            during = model(ids).logits
        after = model(ids).logits
    assert not torch.allclose(during, before)
    assert torch.equal(before, after)
    assert model.config._attn_implementation == "sdpa"


def test_mask_sink_restores_even_on_error(model, ids):
    with torch.no_grad():
        before = model(ids).logits
        with (
            pytest.raises(SinklabError, match="cover every key position"),
            mask_sink(model, positions=range(19)),
        ):
            model(ids)
        assert torch.equal(model(ids).logits, before)


def test_mask_sink_is_a_no_op_without_attention_to_the_positions(model, ids):
    # Left padding: no query attends to position 0, so masking it changes nothing (bitwise).
    attn = torch.ones_like(ids)
    attn[:, 0] = 0
    with torch.no_grad(), sinklab_attention(model, AttentionHandler()):  # same chunked path
        base = model(ids, attention_mask=attn).logits
        with mask_sink(model, positions=[0]):
            masked = model(ids, attention_mask=attn).logits
    assert torch.equal(base, masked)


def test_mask_sink_is_idempotent_and_renormalises(model, ids):
    cap = Recorder(ALL_FIELDS)
    with torch.no_grad():
        with sinklab_attention(model, MaskSink(positions=frozenset({0})), cap):
            once = model(ids).logits
        with mask_sink(model, [0]), mask_sink(model, [0]):
            twice = model(ids).logits
    torch.testing.assert_close(once, twice, atol=1e-6, rtol=0)
    w = cap.cat(0, "weights")  # (B, H, T, T)
    assert w[:, :, 1:, 0].abs().max() == 0  # queries >= 1 send nothing to the sink
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
    assert torch.all(w[:, :, 0, 0] == 1)  # query 0 (the sink itself) keeps its only key


def test_mask_sink_heads_and_layers_only(model, ids):
    cap = Recorder(ALL_FIELDS)
    with torch.no_grad(), sinklab_attention(model, MaskSink(layers={1}, heads={2}), cap):
        model(ids)
    w1, w0 = cap.cat(1, "weights"), cap.cat(0, "weights")
    assert w1[:, 2, 1:, 0].abs().max() == 0 and w1[:, 1, 1:, 0].min() > 0
    assert w0[:, :, 1:, 0].min() > 0


def test_attention_replace_0_gives_own_value_and_1_the_running_mean(model, ids):
    for lam in (0.0, 1.0):
        cap = Recorder(ALL_FIELDS)
        with torch.no_grad(), sinklab_attention(model, AttentionReplace(lam=lam), cap):
            model(ids)
        for layer in (0, 1):
            v = cap.cat(layer, "value")  # (B, H, T, D)
            out = cap.cat(layer, "output")
            if lam == 0.0:
                expected = v  # each token its own value
            else:
                count = torch.arange(1, v.shape[2] + 1, dtype=v.dtype).view(1, 1, -1, 1)
                expected = v.cumsum(dim=2) / count  # causal running mean
            torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
        if lam == 0.0:
            assert torch.equal(cap.cat(0, "output"), cap.cat(0, "value"))


def test_sink_logit_matches_reference_sink_softmax(model, ids):
    cap = Recorder(ALL_FIELDS)
    with torch.no_grad(), sinklab_attention(model, SinkLogit(value=0.7), cap):
        handled = model(ids).logits
    for layer in (0, 1):
        ref = sink_softmax(cap.cat(layer, "scores"), cap.cat(layer, "mask"), 0.7)
        torch.testing.assert_close(cap.cat(layer, "weights"), ref, atol=0, rtol=0)
        assert cap.cat(layer, "weights").sum(-1).max() < 1
    # Independent path: the attention modules declare a sink logit -> hooks' fused attention.
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")]
    try:
        for m in mods:
            m.attention_variant = "sink"
            m.sink_logit = torch.full((4,), 0.7)
        with torch.no_grad(), sinklab_attention(model):
            fused = model(ids).logits
    finally:
        for m in mods:
            del m.attention_variant, m.sink_logit
    torch.testing.assert_close(handled, fused, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: AttentionMix(lam=1.5), "lam must be in [0, 1]"),
        (lambda: AttentionMix(lam=-0.1), "lam must be in [0, 1]"),
        (lambda: AttentionReplace(lam=2.0), "lam must be in [0, 1]"),
        (lambda: AttentionTemperature(tau=0.0), "temperature must be a finite number > 0"),
        (lambda: AttentionTemperature(tau=float("inf")), "temperature must be a finite number"),
        (lambda: MaskSink(positions=frozenset()), "positions is empty"),
        (lambda: MaskSink(heads=frozenset({-1})), "heads must be >= 0"),
    ],
)
def test_bad_configs_raise(make, needle):
    with pytest.raises(SinklabError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        make()


def test_out_of_range_layer_and_head_say_the_range(model):
    with pytest.raises(SinklabError, match=r"layer 5 is out of range.*0\.\.1"):
        mask_sink(model, layers=[5]).__enter__()
    with pytest.raises(SinklabError, match=r"head 4 is out of range.*0\.\.3"):
        attention_mix(model, 0.5, heads=[4]).__enter__()


def test_first_token_modes(tiny_tokenizer):
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    keep = first_token(ids, "keep")
    assert torch.equal(keep.ids, ids) and keep.shift == 0
    drop = first_token(ids[0], "drop")
    assert drop.ids.tolist() == [[6, 7, 8]] and drop.shift == -1 and drop.original == (5,)
    bos = first_token(ids, "bos", tiny_tokenizer)
    assert bos.ids[:, 0].tolist() == [1, 1] and torch.equal(bos.ids[:, 1:], ids[:, 1:])
    assert bos.to_json()["replacement"] == 1 and bos.to_json()["original"] == [5, 9]
    word = first_token(ids, "word", tiny_tokenizer, seed=1)
    assert tiny_tokenizer.decode([word.replacement]) == word.replacement_text
    assert first_token(ids, "token", tiny_tokenizer, token=42).ids[0, 0] == 42
    assert torch.equal(ids, torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]))  # input untouched
    with pytest.raises(SinklabError, match="unknown first-token mode"):
        first_token(ids, "shuffle")
    with pytest.raises(SinklabError, match="not one"):
        first_token(ids, "newline", tiny_tokenizer)  # whitespace tokenizer: "\n" is no token


def test_jacobian_matches_finite_differences():
    # GPT-2: its LayerNorm stays float64 (Llama's RMSNorm computes in float32, which spoils FD).
    model = make_tiny_model("gpt2", n_layers=2).double()
    ids = torch.randint(3, 500, (1, 7), generator=torch.Generator().manual_seed(4))
    q, k = [3, 6], [0, 2, 3, 5]
    handler = MaskSink(positions=frozenset({0}))
    for handlers in ((), (handler,)):
        exact = jacobian_sensitivity(model, ids, q, k, handlers=handlers, batch=13)
        emb = model.get_input_embeddings()(ids).detach()
        eps, d = 1e-6, emb.shape[-1]
        fd = torch.zeros(len(q), len(k), dtype=torch.float64)
        with torch.no_grad(), sinklab_attention(model, *handlers):
            for b, i in enumerate(k):
                dx = torch.zeros(d, *emb.shape[1:], dtype=emb.dtype)  # one row per input dim
                dx[torch.arange(d), i, torch.arange(d)] = eps  # (d, T, d)
                hp = model(inputs_embeds=emb + dx, output_hidden_states=True).hidden_states[-1]
                hm = model(inputs_embeds=emb - dx, output_hidden_states=True).hidden_states[-1]
                jac = (hp - hm)[:, q] / (2 * eps)  # (d_in, len(q), d_out)
                fd[:, b] = jac.pow(2).sum((0, -1)).sqrt()
        assert exact[0, 3] == 0 and exact[0, 2] > 0  # causal: i > t gives 0
        torch.testing.assert_close(exact, fd, rtol=1e-3, atol=1e-6)
    plain = jacobian_sensitivity(model, ids, q, k)
    assert exact[:, 0].max() < 1e-12 < plain[:, 0].min()  # masking the sink cuts token 0 off


def test_jacobian_hutchinson_is_close_to_exact():
    model = make_tiny_model("llama", n_layers=2)
    ids = torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(5))
    exact = jacobian_sensitivity(model, ids, [8], [0, 4, 8])
    est = jacobian_sensitivity(model, ids, [8], [0, 4, 8], probes=2000, batch=500)
    torch.testing.assert_close(est, exact, rtol=0.1, atol=0)
