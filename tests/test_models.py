import math

import pytest
import torch

from sinklab.corpus import load_text, token_stream
from sinklab.errors import SinklabError
from sinklab.models.loading import load_model
from sinklab.models.rotary import ABSOLUTE, ROPE


def test_local_folder_loads_with_facts(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("llama")))
    info = loaded.info
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.head_dim) == (2, 4, 2, 8)
    assert info.position_scheme == ROPE and info.weights_sha256 and len(info.weights_sha256) == 64
    assert not loaded.model.training


def test_gpt2_is_absolute_positions(tiny_model_dir):
    assert load_model(str(tiny_model_dir("gpt2"))).info.position_scheme == ABSOLUTE


def test_unknown_path_and_uncached_id_are_clear_errors(tmp_path):
    with pytest.raises(SinklabError, match="no model folder"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(SinklabError, match="never downloads"):
        load_model("nobody-here/not-a-model-xyz")


def test_non_causal_model_is_refused(bert_dir):
    with pytest.raises(SinklabError, match="not a causal language model"):
        load_model(str(bert_dir))


@pytest.mark.integration
def test_embedded_smollm2_predicts_english(smollm2):
    info = smollm2.info
    assert (info.n_layers, info.n_heads, info.n_kv_heads) == (30, 9, 3)
    ids = token_stream(load_text(), smollm2.tokenizer, 512)
    with torch.no_grad():
        out = smollm2.model(ids[None], labels=ids[None])
    ppl = math.exp(out.loss.item())
    assert ppl < 100, ppl  # real English: a random 49k-vocab model would be ~49,000


@pytest.mark.integration
def test_cached_load_is_bit_identical_to_gguf(smollm2):
    from transformers import AutoModelForCausalLM

    from sinklab.models.loading import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([[1, 504, 3289, 30, 198, 3911, 3945, 63]])
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, smollm2.model(ids).logits)
