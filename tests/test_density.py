"""Density protocols: identities (lam = 0, tau = 1), lam = 1 against a hand-written uniform-causal
attention, scoping, the verdict rule, the experiment's JSON and the CLI."""

import json

import pytest
import torch

from conftest import make_tiny_model
from helpers import assert_one_line_error, run_main
from sinklab.ablate import AblationConfig, run_experiment
from sinklab.ablate.density import after_group, density_verdict
from sinklab.errors import SinklabError
from sinklab.seam.interventions import (
    AttentionMix,
    AttentionReplace,
    AttentionTemperature,
    attention_mix,
    attention_temperature,
    intervene,
)

LAYERS = (1, 2)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", n_layers=4)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(4, 500, (1, 21), generator=torch.Generator().manual_seed(5))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize(
    "make",
    [lambda m: attention_mix(m, 0.0, layers=LAYERS), lambda m: attention_temperature(m, 1.0)],
    ids=["mix lam=0", "temperature tau=1"],
)
def test_identity_conditions_leave_logits_unchanged(model, ids, make):
    before = _logits(model, ids)
    with make(model):
        during = _logits(model, ids)
    torch.testing.assert_close(during, before, atol=1e-5, rtol=0)


def _uniform_reference(layers: tuple[int, ...]):
    """A hand-written attention: in ``layers`` each query's output is the mean of the values of
    keys 0..t (uniform causal); elsewhere transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        if module.layer_idx not in layers:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw
            )
        rep = query.shape[1] // value.shape[1]
        v = value.repeat_interleave(rep, dim=1)  # (B, H, T, D)
        count = torch.arange(1, v.shape[2] + 1, dtype=v.dtype).view(1, 1, -1, 1)
        return (v.cumsum(dim=2) / count).transpose(1, 2).contiguous(), None

    return forward


def test_mix_lam_1_equals_hand_written_uniform_causal_attention(model, ids):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("test_uniform", _uniform_reference(LAYERS))
    AttentionMaskInterface.register("test_uniform", sdpa_mask)
    model.set_attn_implementation("test_uniform")
    try:
        reference = _logits(model, ids)
    finally:
        model.set_attn_implementation("sdpa")
    with attention_mix(model, 1.0, layers=LAYERS):
        mixed = _logits(model, ids)
    torch.testing.assert_close(mixed, reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(mixed, _logits(model, ids), atol=1e-3)  # it did change the model


def test_temperature_is_softmax_of_scaled_scores(model, ids):
    # tau -> large tends to uniform causal: the same logits as mix lam=1, within a bound
    with attention_temperature(model, 1e6, layers=LAYERS):
        hot = _logits(model, ids)
    with attention_mix(model, 1.0, layers=LAYERS):
        uniform = _logits(model, ids)
    torch.testing.assert_close(hot, uniform, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "handler",
    [
        AttentionMix(frozenset(LAYERS), lam=0.5),
        AttentionTemperature(frozenset(LAYERS), tau=2.0),
        AttentionReplace(frozenset(LAYERS), lam=0.5),
    ],
    ids=["mix", "temperature", "replace"],
)
def test_interventions_are_scoped(model, ids, handler):
    from sinklab.probe.geometry import capture_geometry

    before = _logits(model, ids)
    with intervene(model, handler), capture_geometry(model):
        during = _logits(model, ids)
    assert not torch.allclose(during, before)
    assert torch.equal(_logits(model, ids), before)
    assert model.config._attn_implementation == "sdpa"
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_density_verdict_rule():
    assert density_verdict([0.1, 0.2, 0.3]) == ("rises", pytest.approx(0.2))
    assert density_verdict([0.1, 0.3, 0.25, 0.4])[0] == "rises in trend"
    assert density_verdict([0.1, 0.105, 0.108])[0] == "no change"
    assert density_verdict([0.4, 0.3, 0.2])[0] == "falls"
    assert density_verdict([0.1, 0.095, 0.3])[0] == "rises"  # a dip within the tolerance
    assert after_group([1.0, 2.0, 3.0, 4.0, 5.0], [1, 2]) == pytest.approx(4.5)


@pytest.mark.parametrize("protocol", ["mix", "temperature", "replace"])
def test_density_experiment_json(model, tiny_tokenizer, ids, protocol):
    cfg = AblationConfig(
        protocol=protocol, layers=(1,), lams=(0.0, 0.5, 1.0), temperatures=(0.5, 1.0, 4.0)
    )
    data = json.loads(
        json.dumps(run_experiment("density", model, tiny_tokenizer, ids, cfg).to_json())
    )
    param = "tau" if protocol == "temperature" else "lam"
    assert data["protocol"] == protocol and data["modified_layers"] == [1]
    assert set(data["conditions"]) == {"unmodified", *(f"{param}={v:g}" for v in data["values"])}
    base = data["conditions"]["unmodified"]
    for name, c in data["conditions"].items():
        assert set(c["token_similarity"]) == {"residual", "attention_input"}
        assert all(len(v) == 5 for v in c["token_similarity"].values())  # 4 layers + final
        assert c["ppl"] > 1 and c[param] == (None if name == "unmodified" else c[param])
        # only the layers after the modified one change (layer 0, 1 inputs are untouched)
        for site in ("residual", "attention_input"):
            assert c["token_similarity"][site][:2] == pytest.approx(
                base["token_similarity"][site][:2], abs=1e-6
            )
    identity = "tau=1" if protocol == "temperature" else "lam=0"
    if protocol != "replace":
        assert data["conditions"][identity]["ppl"] == pytest.approx(base["ppl"], rel=1e-5)
    assert "Súkeník et al." in data["finding"] and "seed" not in data["finding"]
    assert ("confound" in data["finding"]) == (protocol == "replace")
    assert data["curve_shapes"]["attention_input"] in (
        "rises",
        "rises in trend",
        "no change",
        "falls",
    )
    # the claim's verdict is the claims rule's, on the mix at lam 0.5 only (one text: too few)
    claim = data["claim"]
    if protocol == "mix":
        assert claim["id"] == "density-oversmooths" and claim["verdict"] == "inconclusive"
        assert (
            "too few samples" in claim["reason"] and "`density-oversmooths` is" in data["finding"]
        )
    else:
        assert claim is None and "not run here" in data["finding"]


def test_default_layers_are_the_middle_third(tiny_tokenizer):
    model = make_tiny_model("llama", n_layers=6)
    ids = torch.randint(4, 500, (1, 16), generator=torch.Generator().manual_seed(1))
    res = run_experiment("density", model, tiny_tokenizer, ids, AblationConfig(lams=(0.0, 1.0)))
    assert res.extra["modified_layers"] == [2, 3] and res.extra["after_layers"][-1] == "final"


def test_cli_temperature_with_a_layer_range(capsys, tiny_model_dir, tmp_path):
    proc = run_main(
        capsys, "ablate", "-e", "density", "--protocol", "temperature", "--layers", "0-1",
        "--temperatures", "0.5,2", "--model", str(tiny_model_dir("llama")), "--tokens", "16",
        "--out", str(tmp_path), "--format", "json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["modified_layers"] == [0, 1] and set(data["conditions"]) == {
        "unmodified", "tau=0.5", "tau=2"
    }  # fmt: skip
    assert (tmp_path / "density.png").is_file()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--protocol", "shuffle"], "unknown density protocol 'shuffle'"),
        (["--layers", "3-1"], "must be A-B with A <= B"),
    ],
)
def test_cli_bad_density_inputs(capsys, tiny_model_dir, args, needle):
    model = ["--model", str(tiny_model_dir("llama")), "--tokens", "16"]
    assert_one_line_error(run_main(capsys, "ablate", "-e", "density", *model, *args), needle)


def test_config_rejects_bad_protocol_values():
    with pytest.raises(SinklabError, match="unknown density protocol"):
        AblationConfig(protocol="dense")
    with pytest.raises(SinklabError, match="temperatures must be finite"):
        AblationConfig(temperatures=(float("nan"),))


@pytest.mark.integration
def test_smollm2_denser_middle_layers_raise_later_similarity(smollm2):
    # Measured on SmolLM2, shakespeare, T=128, layers 10..19 mixed: similarity after them (layers
    # 20..29 + final) 0.528 -> 0.637 at the attention input, 0.564 -> 0.669 at the residual;
    # perplexity 26.4 -> 82.5; lam=0 equals the unmodified model.
    from sinklab.corpus import load_text, token_stream

    ids = token_stream(load_text(), smollm2.tokenizer, 128)
    cfg = AblationConfig(lams=(0.0, 1.0))
    res = run_experiment("density", smollm2.model, smollm2.tokenizer, ids, cfg)
    c = res.conditions
    assert res.extra["modified_layers"] == list(range(10, 20))
    assert c["lam=0"]["ppl"] == pytest.approx(c["unmodified"]["ppl"], rel=1e-5)
    for site in ("attention_input", "residual"):
        before, after = (c[k]["after_group_similarity"][site] for k in ("lam=0", "lam=1"))
        assert after > before + 0.05
    assert c["lam=1"]["ppl"] > 2 * c["lam=0"]["ppl"]


def test_temperature_refuses_a_non_softmax_variant(ids):
    model = make_tiny_model("llama", n_layers=2)
    attn = model.model.layers[1].self_attn
    attn.attention_variant = "softmax1"
    try:
        needle = "needs softmax attention; layer 1 uses 'softmax1'"
        with pytest.raises(SinklabError, match=needle), attention_temperature(model, 2.0, [1]):
            _logits(model, ids)
    finally:
        del attn.attention_variant
