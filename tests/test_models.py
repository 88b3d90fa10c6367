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

    from sinklab.models.checkpoint import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([[1, 504, 3289, 30, 198, 3911, 3945, 63]])
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, smollm2.model(ids).logits)


def _tied_tiny(tiny_tokenizer, folder):
    """A tiny tied Llama (tie_word_embeddings: the head is the embedding) written as the zoo
    cache writes a model: config, standard safetensors, tokenizer."""
    from conftest import make_tiny_model
    from sinklab.models.checkpoint import save_standard

    lm = make_tiny_model("llama", tie_word_embeddings=True)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight  # really tied
    folder.mkdir(parents=True, exist_ok=True)
    lm.config.architectures = [type(lm).__name__]  # as the cache's config names it
    lm.config.save_pretrained(folder)
    save_standard(lm, folder / "model.safetensors")
    tiny_tokenizer.save_pretrained(folder)
    return lm


def test_tied_checkpoint_is_standard(tmp_path, tiny_tokenizer):
    """The cache writes what save_pretrained of a tied model writes: the embedding, no head
    (docs/models.md#cache-format); it loads back to the same logits."""
    from safetensors import safe_open

    lm = _tied_tiny(tiny_tokenizer, tmp_path / "ours")
    lm.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
        ours = set(f.keys())
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        theirs = set(f.keys())
    assert "model.embed_tokens.weight" in ours and "lm_head.weight" not in ours
    assert ours == theirs
    back = load_model(str(tmp_path / "ours")).model
    ids = torch.tensor([[1, 5, 9, 44, 3, 100]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, lm(ids).logits)
    assert torch.equal(back.model.embed_tokens.weight, lm.model.embed_tokens.weight)


def test_untied_checkpoint_keeps_both(tmp_path, tiny_tokenizer):
    from safetensors import safe_open

    from conftest import make_tiny_model
    from sinklab.models.checkpoint import save_standard

    lm = make_tiny_model("llama")  # tie_word_embeddings False: two matrices
    save_standard(lm, tmp_path / "m.safetensors")
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= keys


def test_tied_config_with_differing_tensors_is_refused(tmp_path):
    from conftest import make_tiny_model
    from sinklab.models.checkpoint import save_standard

    lm = make_tiny_model("llama", tie_word_embeddings=True)
    lm.lm_head.weight = torch.nn.Parameter(lm.lm_head.weight.detach().clone() + 1)
    with pytest.raises(SinklabError, match=r"ties lm_head\.weight"):
        save_standard(lm, tmp_path / "m.safetensors")


def test_old_format_cache_is_rebuilt(tmp_path, tiny_tokenizer, monkeypatch):
    """A copy in the previous format (v2: the head saved, no embedding) is never used: the
    current format's copy is built beside it, in a temporary folder renamed into place, and the
    old one (sinklab's marker) goes once the new one is whole. A same-named copy whose marker
    names the old format is rebuilt in place."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_model

    from sinklab.models import zoo
    from sinklab.models.checkpoint import cached_build, save_standard

    monkeypatch.setenv("SINKLAB_CACHE", str(tmp_path))
    model = zoo.SMOLLM2
    target = zoo.dequantized_dir(model)
    assert target.name.endswith(f"-v{zoo.CACHE_FORMAT}") and zoo.CACHE_FORMAT >= 3
    old = target.parent / target.name.replace(f"-v{zoo.CACHE_FORMAT}", "-v2")
    lm = _tied_tiny(tiny_tokenizer, old)
    (old / "model.safetensors").unlink()
    save_model(lm, str(old / "model.safetensors"))  # the old writer: keeps the head
    with safe_open(str(old / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in set(f.keys())  # the v2 layout, as the old cache had it
    (old / zoo.READY).write_text(json.dumps({"format": 2, "files": {"model.safetensors": {}}}))
    facts = {"gguf_sha256": model.sha256}
    built = []

    def build(folder):
        built.append(folder)
        assert folder.parent == target.parent and folder.name.startswith(f".{target.name}.tmp-")
        lm.config.save_pretrained(folder)
        save_standard(lm, folder / "model.safetensors")

    assert cached_build(target, build, facts, "the tiny model") == target
    assert len(built) == 1 and not built[0].exists() and not old.exists()
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in set(f.keys())
    assert cached_build(target, build, facts, "the tiny model") == target and len(built) == 1
    marker = json.loads((target / zoo.READY).read_text())
    marker["format"] = 2
    (target / zoo.READY).write_text(json.dumps(marker))
    cached_build(target, build, facts, "the tiny model")
    assert len(built) == 2 and json.loads((target / zoo.READY).read_text())["format"] == 3


@pytest.mark.integration
def test_zoo_cache_holds_the_embedding(smollm2):
    """The real cached SmolLM2 (tied) is standard: vLLM and other loaders read its embedding."""
    from safetensors import safe_open

    from sinklab.models.checkpoint import smollm2_gguf_path
    from sinklab.models.zoo import SMOLLM2, dequantized_dir, file_sha256

    cached = dequantized_dir(SMOLLM2, file_sha256(smollm2_gguf_path()))
    with safe_open(str(cached / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
