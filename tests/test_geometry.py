"""Geometry at three sites: each site pinned against an independent computation from
``output_hidden_states`` and the model's own modules; hooks always removed."""

import math

import pytest
import torch

from conftest import make_tiny_model
from sinklab.errors import SinklabError
from sinklab.probe.geometry import (
    SITES,
    capture_geometry,
    first_token_cosine,
    geometry,
    middle_third,
    token_similarity,
)

FAMILIES = ("llama", "gemma", "gpt2")


def _blocks(model):
    base = getattr(model, model.base_model_prefix)
    return base.layers if hasattr(base, "layers") else base.h


def _input_norm(block):
    return block.input_layernorm if hasattr(block, "input_layernorm") else block.ln_1


def _brute(x: torch.Tensor) -> tuple[float, float]:
    """(first-token cosine, token similarity) by explicit loops over pairs, float64: (T, d)."""
    x = x.double()
    cos = torch.nn.functional.cosine_similarity
    t = x.shape[0]
    first = sum(float(cos(x[0], x[j], dim=0)) for j in range(1, t)) / (t - 1)
    pairs = [(i, j) for i in range(1, t) for j in range(1, t) if i != j]
    sim = sum(float(cos(x[i], x[j], dim=0)) for i, j in pairs) / len(pairs)
    return first, sim


def _keys(model, block, x: torch.Tensor) -> torch.Tensor:
    """Independent keys before RoPE from the layer's normed input x (1, T, d): (T, KV, hd)."""
    attn = block.self_attn if hasattr(block, "self_attn") else block.attn
    if hasattr(attn, "k_proj"):
        k = attn.k_proj(x)[0]
        return k.view(k.shape[0], -1, attn.head_dim)
    d = model.config.n_embd
    w, b = attn.c_attn.weight[:, d : 2 * d], attn.c_attn.bias[d : 2 * d]  # Conv1D: x @ W + b
    k = (x[0] @ w + b).view(x.shape[1], model.config.n_head, -1)
    return k


def _random_norms(model, seed: int = 0):
    """Random norm weights: freshly initialised ones (all 1, Gemma all 0) preserve every cosine,
    so a test could not tell the attention input from the residual stream."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if "Norm" in type(mod).__name__ and getattr(mod, "weight", None) is not None:
                mod.weight.add_(torch.randn(mod.weight.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(4, 500, (1, 24), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("family", FAMILIES)
def test_three_sites_equal_an_independent_computation(family, ids):
    model = _random_norms(make_tiny_model(family, n_layers=3))
    geo = geometry(model, ids)
    res, att = geo.values["residual"], geo.values["attention_input"]
    assert all(  # the sites differ, so confusing them would fail below
        abs(a - b) > 1e-4  # 10x the tolerance below
        for a, b in zip(res["token_similarity"], att["token_similarity"], strict=True)
    )
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states  # hs[l]: input of layer l
        for layer, block in enumerate(_blocks(model)):
            normed = _input_norm(block)(hs[layer])  # the model's own norm module
            keys = _keys(model, block, normed)
            for site, x in (("residual", hs[layer][0]), ("attention_input", normed[0])):
                first, sim = _brute(x)
                assert geo.values[site]["first_token_cosine"][layer] == pytest.approx(
                    first, abs=1e-5
                )
                assert geo.values[site]["token_similarity"][layer] == pytest.approx(sim, abs=1e-5)
            per_head = [_brute(keys[:, g]) for g in range(keys.shape[1])]
            first = sum(p[0] for p in per_head) / len(per_head)
            sim = sum(p[1] for p in per_head) / len(per_head)
            assert geo.values["key"]["first_token_cosine"][layer] == pytest.approx(first, abs=1e-5)
            assert geo.values["key"]["token_similarity"][layer] == pytest.approx(sim, abs=1e-5)
        # final: before the final norm (the last block's output) and after it (hs[-1] here)
        out = {}
        handle = _blocks(model)[-1].register_forward_hook(lambda m, a, o: out.setdefault("h", o))
        model(ids)
        handle.remove()
        h = out["h"][0] if isinstance(out["h"], tuple) else out["h"]  # (1, T, d)
        base = getattr(model, model.base_model_prefix)
        final_norm = base.norm if hasattr(base, "norm") else base.ln_f
        after = final_norm(h)
    assert geo.final["residual"]["token_similarity"] == pytest.approx(_brute(h[0])[1], abs=1e-5)
    assert geo.final["attention_input"]["first_token_cosine"] == pytest.approx(
        _brute(after[0])[0], abs=1e-5
    )
    assert geo.key_note is None
    # the attention input differs from the residual (the norm's weight / centering acts)
    layers = geo.layers_json()
    assert set(layers[0]["first_token_cosine"]) == set(SITES) and len(layers) == 3


def test_hooks_are_always_removed(ids):
    model = make_tiny_model("llama", n_layers=2)
    with torch.no_grad():
        before = model(ids).logits

    def n_hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    with pytest.raises(RuntimeError, match="boom"), capture_geometry(model):
        assert n_hooks() > 0
        raise RuntimeError("boom")
    assert n_hooks() == 0
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_sites_subset_and_bad_site(ids):
    model = make_tiny_model("llama", n_layers=2)
    geo = geometry(model, ids, sites=("residual",))
    assert geo.values["attention_input"]["token_similarity"] == [None, None]
    assert all(v is not None for v in geo.values["residual"]["token_similarity"])
    with pytest.raises(SinklabError, match="unknown geometry sites"):
        geometry(model, ids, sites=("values",))


def test_pure_functions_per_head_groups():
    x = torch.randn(9, 3, 5, generator=torch.Generator().manual_seed(0))  # (T, G, d)
    groups = [_brute(x[:, g]) for g in range(3)]
    assert first_token_cosine(x) == pytest.approx(sum(g[0] for g in groups) / 3, abs=1e-12)
    assert token_similarity(x) == pytest.approx(sum(g[1] for g in groups) / 3, abs=1e-12)
    assert first_token_cosine(x[:, 0]) == pytest.approx(groups[0][0], abs=1e-12)


def test_middle_third():
    assert middle_third(30) == list(range(10, 20))
    assert middle_third(3) == [1] and middle_third(2) == [0, 1]


def test_probe_reports_the_three_sites(ids):
    from sinklab.probe import probe

    model = make_tiny_model("gpt2", n_layers=2)
    data = probe(model, ids).to_json()
    geo = geometry(model, ids)
    assert data["geometry"]["sites"] == list(SITES)
    for layer in range(2):
        for site in SITES:
            got = data["geometry"]["layers"][layer]["first_token_cosine"][site]
            assert math.isclose(got, geo.values[site]["first_token_cosine"][layer], abs_tol=1e-5)


@pytest.mark.integration
def test_smollm2_attention_input_equals_input_layernorm(smollm2):
    from sinklab.corpus import load_text, token_stream

    model = smollm2.model
    ids = token_stream(load_text(), smollm2.tokenizer, 64)[None]
    geo = geometry(model, ids)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        for layer in (0, 10, 29):
            x = model.model.layers[layer].input_layernorm(hs[layer])[0]
            first, sim = _brute(x)
            got = geo.values["attention_input"]
            assert got["first_token_cosine"][layer] == pytest.approx(first, abs=1e-5)
            assert got["token_similarity"][layer] == pytest.approx(sim, abs=1e-5)
    # Measured (T=64..256): negative at the attention input in layers 12..23, positive on the
    # residual stream in every layer (its common direction).
    att, res = geo.values["attention_input"], geo.values["residual"]
    assert max(att["first_token_cosine"][12:20]) < 0 < min(res["first_token_cosine"])


def test_unreachable_keys_are_null_with_a_reason(ids):
    from torch import nn

    from sinklab.probe.geometry import _key_source

    model = make_tiny_model("llama", n_layers=2)
    reason = _key_source(nn.Module(), model.config)
    assert isinstance(reason, str) and "not reachable" in reason
    attn = model.model.layers[0].self_attn
    module, to_heads = _key_source(attn, model.config)
    assert module is attn.k_proj and to_heads(torch.zeros(1, 5, 16)).shape == (1, 5, 2, 8)
