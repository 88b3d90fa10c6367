"""sinklab.models.arch's one way to read a model's decoder config, its shape and its attention
modules."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from archs import arch_model
from sinklab.models.arch import (
    attention_modules,
    block_attention,
    decoder_config,
    decoder_layers,
    model_shape,
)

SEEN: list[torch.nn.Module] = []


def _recording_attention(module, *args, **kwargs):
    SEEN.append(module)
    return sdpa_attention_forward(module, *args, **kwargs)


class _Wrapper:
    """A multimodal-style config: the decoder's config sits inside."""

    def __init__(self, text) -> None:
        self.text = text

    def get_text_config(self):
        return self.text


def test_decoder_config_of_a_model_a_config_and_a_wrapper():
    model = arch_model("llama", num_hidden_layers=3)
    assert decoder_config(model) is decoder_config(model.config)
    assert decoder_config(_Wrapper(model.config)) is model.config
    assert model_shape(model) == model_shape(model.config) == (3, 4)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_neox", "phi", "qwen3_moe"])
def test_attention_modules_are_what_transformers_calls_attention_with(family):
    """Independent: a registered attention function records the module transformers passes
    it, layer by layer; arch's list must be exactly those (Gemma 3's block has a layer_idx of
    its own, and is not the attention module)."""
    AttentionInterface.register("sinklab_test_record", _recording_attention)
    AttentionMaskInterface.register("sinklab_test_record", sdpa_mask)
    model = arch_model(family)  # 2 layers
    model.set_attn_implementation("sinklab_test_record")
    SEEN.clear()
    with torch.no_grad():
        model(torch.arange(3, 9)[None])
    found = attention_modules(model)
    assert found is not None and len(found) == 2
    assert [id(m) for m in found] == [id(m) for m in SEEN]
    blocks = decoder_layers(model, 2)
    assert [block_attention(b) for b in blocks] == found


def test_no_decoder_list_gives_none():
    model = arch_model("llama", num_hidden_layers=3)
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:2])  # not 0..n-1
    assert decoder_layers(model, 3) is None
    assert attention_modules(model) is None
