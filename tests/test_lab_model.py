"""The lab decoder: every variant runs through the hooks seam; checkpoints load and probe."""

from __future__ import annotations

import pytest
import torch

from helpers import Recorder
from sinklab.errors import SinklabError
from sinklab.lab.model import LAB_VARIANTS, LabConfig, LabForCausalLM
from sinklab.seam import sinklab_attention


def tiny(variant: str, seed: int = 0) -> LabForCausalLM:
    torch.manual_seed(seed)
    cfg = LabConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        attention_variant=variant,
    )
    return LabForCausalLM(cfg)


@pytest.mark.parametrize("variant", LAB_VARIANTS)
def test_hooks_path_equals_default_and_sees_every_layer(variant):
    model = tiny(variant).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    plain = model(ids).logits
    rec = Recorder()
    with sinklab_attention(model, rec):
        assert model.config._attn_implementation == "sinklab"
        hooked = model(ids).logits
    torch.testing.assert_close(hooked, plain, atol=1e-5, rtol=1e-5)
    seen = {layer: rec.weights(layer) for layer in rec.chunks}
    assert sorted(seen) == [0, 1] and seen[0].shape == (2, 4, 12, 12)
    rows = seen[0].sum(-1)
    if variant in ("softmax", "gated"):
        torch.testing.assert_close(rows, torch.ones_like(rows))
    elif variant in ("softmax1", "sink"):
        assert (rows < 1).all()
    assert torch.triu(seen[1][0, 0], diagonal=1).abs().max() == 0  # causal


def test_gradients_reach_sink_logits_and_gates():
    for variant, name in (("sink", "sink_logit"), ("gated", "gate.weight")):
        model = tiny(variant)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
        model(ids, labels=ids).loss.backward()
        for layer in model.model.layers:
            grad = layer.self_attn.get_parameter(name).grad
            assert grad is not None and grad.abs().sum() > 0, (variant, name)


def test_bool_4d_mask_blocks_keys():
    model = tiny("softmax").eval()
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(3))
    doc = torch.tensor([[0] * 4 + [1] * 6])
    from sinklab.lab.data import document_mask

    masked = model(ids, attention_mask=document_mask(doc)).logits
    alone = model(ids[:, 4:]).logits  # the second document on its own (RoPE: relative)
    torch.testing.assert_close(masked[:, 4:], alone, atol=1e-5, rtol=1e-4)


def test_bad_config_is_one_sinklab_error():
    with pytest.raises(SinklabError, match="variant"):
        LabConfig(attention_variant="nope")
    with pytest.raises(SinklabError, match="multiple"):
        LabConfig(hidden_size=30, num_attention_heads=4)


def test_checkpoint_loads_through_load_model(tmp_path, tiny_tokenizer):
    from sinklab.lab import register
    from sinklab.models.loading import load_model
    from sinklab.probe import probe

    register()  # explicit: the core never imports the lab (the CLI registers it)
    model = tiny("sink").eval()
    with torch.no_grad():
        model.model.layers[0].self_attn.sink_logit.fill_(1.5)
    model.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.info.model_type == "sinklab-tiny" and loaded.info.n_layers == 2
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(loaded.model(ids).logits, model(ids).logits)
    result = probe(loaded.model, ids[0])
    assert tuple(result.sink_mass.shape) == (2, 4)


def test_an_unregistered_lab_type_is_a_one_line_refusal(tmp_path):
    from sinklab.models.loading import load_model

    (tmp_path / "config.json").write_text('{"model_type": "sinklab-nosuch"}')
    with pytest.raises(SinklabError, match=r"call sinklab\.lab\.register\(\) before loading"):
        load_model(str(tmp_path))


def test_the_cli_loads_a_saved_lab_checkpoint_in_a_fresh_process(tmp_path, tiny_tokenizer):
    """A fresh interpreter has registered nothing: the command line registers the lab's types."""
    from helpers import run_process

    model = tiny("softmax").eval()
    model.save_pretrained(tmp_path / "ckpt")
    tiny_tokenizer.save_pretrained(tmp_path / "ckpt")
    run = run_process("info", "--model", str(tmp_path / "ckpt"), "--format", "json")
    assert run.returncode == 0, run.stderr
    assert '"model_type": "sinklab-tiny"' in run.stdout
