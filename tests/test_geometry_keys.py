"""The key site on every family: keys before RoPE, per KV head, wherever the model keeps them.

Each normalised-key family (Gemma 3, Qwen3, OLMo 2, Cohere, StableLM) is pinned against keys
normalised here by the norm's own formula written out by hand, on what the attention module
received; fused projections against a hand split of the fused output. Norm weights are randomised,
since fresh ones (all 1, Gemma's all 0) would leave every cosine unchanged."""

import math

import pytest
import torch
import torch.nn.functional as F

from archs import FAMILIES, arch_model
from sinklab.probe.geometry import geometry, normed_key_heads
from test_geometry import _brute, _random_norms

IDS = torch.randint(4, 120, (1, 16), generator=torch.Generator().manual_seed(3))


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _hand_keys(family: str, attn, x: torch.Tensor) -> torch.Tensor:
    """Keys before RoPE (T, KV, hd) from the attention's input x (T, d), by hand."""
    if family == "gpt_neox":
        hd = attn.head_size
        return (x @ attn.query_key_value.weight.T + attn.query_key_value.bias).view(
            x.shape[0], -1, 3 * hd
        )[..., hd : 2 * hd]
    if family == "falcon":  # new decoder architecture: per KV group [q ... q | k | v]
        qkv = x @ attn.query_key_value.weight.T
        per = attn.num_heads // attn.num_kv_heads + 2
        return qkv.view(x.shape[0], attn.num_kv_heads, per, attn.head_dim)[:, :, -2]
    if family == "bloom":
        qkv = x @ attn.query_key_value.weight.T + attn.query_key_value.bias
        return qkv.view(x.shape[0], attn.num_heads, 3, attn.head_dim)[:, :, 1]
    if family == "mpt":
        d = x.shape[-1]
        return (x @ attn.Wqkv.weight.T)[:, d : 2 * d].view(x.shape[0], attn.n_heads, -1)
    hd = attn.head_dim
    k = x @ attn.k_proj.weight.T + (attn.k_proj.bias if attn.k_proj.bias is not None else 0)
    heads = k.view(x.shape[0], -1, hd)
    if family == "gemma3_text":  # Gemma RMSNorm: (1 + w), per head
        return _rms(heads, attn.k_norm.eps) * (1 + attn.k_norm.weight)
    if family == "qwen3":  # RMSNorm, per head
        return _rms(heads, attn.k_norm.variance_epsilon) * attn.k_norm.weight
    if family == "olmo2":  # RMSNorm over all KV heads at once
        return (_rms(k, attn.k_norm.variance_epsilon) * attn.k_norm.weight).view_as(heads)
    if family == "cohere":  # LayerNorm per head, its weight (KV, hd), no bias
        centred = heads - heads.mean(-1, keepdim=True)
        return _rms(centred, attn.k_norm.variance_epsilon) * attn.k_norm.weight
    if family == "stablelm":  # one LayerNorm per KV head
        norms = attn.k_layernorm.norms
        return torch.stack(
            [
                F.layer_norm(heads[:, g], (hd,), n.weight, n.bias, n.eps)
                for g, n in enumerate(norms)
            ],
            dim=1,
        )
    raise ValueError(family)


CASES = {
    "gemma3_text": dict(num_key_value_heads=1),  # as Gemma 3 270M: one KV head
    "qwen3": {},
    "olmo2": {},
    "cohere": dict(use_qk_norm=True),
    "stablelm": dict(qk_layernorm=True),
    "gpt_neox": {},
    "falcon": {},
    "bloom": {},
    "mpt": {},
}


@pytest.mark.parametrize("family", list(CASES))
def test_key_site_equals_hand_normed_or_split_keys(family):
    model = _random_norms(arch_model(family, **CASES[family]), seed=1)
    geo = geometry(model, IDS)
    assert geo.key_note is None
    got = geo.values["key"]
    seen: dict[int, torch.Tensor] = {}
    attns = [
        m for m in model.modules() if hasattr(m, "layer_idx") and "Attention" in type(m).__name__
    ]

    def keep(i: int):
        def hook(module, args, kwargs) -> None:
            seen[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    hooks = [a.register_forward_pre_hook(keep(i), with_kwargs=True) for i, a in enumerate(attns)]
    with torch.no_grad():
        model(IDS)
        for h in hooks:
            h.remove()
        assert len(seen) == 2
        for layer, attn in enumerate(attns):
            keys = _hand_keys(family, attn, seen[layer][0]).double()
            per_head = [_brute(keys[:, g]) for g in range(keys.shape[1])]
            first = sum(p[0] for p in per_head) / len(per_head)
            sim = sum(p[1] for p in per_head) / len(per_head)
            assert math.isfinite(got["first_token_cosine"][layer])
            assert got["first_token_cosine"][layer] == pytest.approx(first, abs=1e-5)
            assert got["token_similarity"][layer] == pytest.approx(sim, abs=1e-5)


def test_gemma3_key_norm_changes_the_cosine():
    """The norm's (1 + w) acts: the key site is not k_proj's output on Gemma 3."""
    model = _random_norms(arch_model("gemma3_text", num_key_value_heads=1), seed=1)
    geo = geometry(model, IDS)
    seen = {}
    attn = model.model.layers[0].self_attn
    h = attn.k_proj.register_forward_hook(lambda m, a, o: seen.setdefault("k", o))
    with torch.no_grad():
        model(IDS)
    h.remove()
    raw = _brute(seen["k"][0].double())[0]  # one KV head: the flat keys are the head's
    assert abs(geo.values["key"]["first_token_cosine"][0] - raw) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_reaches_its_keys(family):
    """Every family sinklab lists gets finite keys at every layer (no family left at None)."""
    geo = geometry(arch_model(family), IDS)
    assert geo.key_note is None
    for metric in ("first_token_cosine", "token_similarity"):
        assert all(v is not None and math.isfinite(v) for v in geo.values["key"][metric])


def test_normed_key_layouts_are_found_by_value():
    keys = torch.randn(1, 5, 3, 4, generator=torch.Generator().manual_seed(0))  # (B, T, KV, hd)
    out = torch.randn_like(keys)
    assert torch.equal(normed_key_heads(keys, out, keys), out)
    trans = normed_key_heads(keys.transpose(1, 2), out.transpose(1, 2), keys)
    assert torch.equal(trans, out)
    flat = normed_key_heads(keys.reshape(1, 5, 12), out.reshape(1, 5, 12), keys)
    assert torch.equal(flat, out)
    assert normed_key_heads(keys + 1, out, keys) is None  # not the projection's output
    # T == KV: the shapes agree, the values decide
    sq = torch.randn(1, 3, 3, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(normed_key_heads(sq.transpose(1, 2), sq.transpose(1, 2), sq), sq)


@pytest.fixture(scope="module")
def gemma3():
    from sinklab.errors import SinklabError
    from sinklab.models.loading import load_model

    try:
        return load_model("gemma3-270m")
    except SinklabError as exc:  # make test installs the zoo: a missing model is a failure
        pytest.fail(
            f"gemma3-270m is not installed ({exc}); run `sinklab models install gemma3-270m`"
        )


@pytest.mark.integration
def test_real_gemma3_keys_are_finite_and_equal_hand_normed_keys(gemma3):
    """Gemma 3 270M (one KV head, k_norm on (B, KV, T, hd)): the key site was nan in every
    layer; now finite and equal to k_proj's output normed by hand with the model's weights."""
    from sinklab.corpus import load_text, token_stream

    model, tok = gemma3.model, gemma3.tokenizer
    text = token_stream(load_text(), tok, 47)
    ids = torch.cat([torch.tensor([tok.bos_token_id]), text])[None]  # Gemma's own first token
    geo = geometry(model, ids)
    keys = geo.values["key"]
    assert geo.key_note is None
    assert all(v is not None and math.isfinite(v) for v in keys["first_token_cosine"])
    seen = {}
    layers = (0, 8, 17)
    hooks = [
        model.model.layers[i].self_attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: seen.__setitem__(i, a[0] if a else kw["hidden_states"]),
            with_kwargs=True,
        )
        for i in layers
    ]
    with torch.no_grad():
        model(ids)
        for h in hooks:
            h.remove()
        for i in layers:
            attn = model.model.layers[i].self_attn
            hand = _hand_keys("gemma3_text", attn, seen[i][0]).double()
            first, sim = _brute(hand[:, 0])
            assert keys["first_token_cosine"][i] == pytest.approx(first, abs=1e-4)
            assert keys["token_similarity"][i] == pytest.approx(sim, abs=1e-4)
