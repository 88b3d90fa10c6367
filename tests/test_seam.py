"""The attention seam: outputs as transformers, weights as eager, handlers scoped to a model."""

import pytest
import torch

from conftest import FAMILIES, make_tiny_model
from helpers import Recorder
from sinklab.seam import AttentionHandler, binding, blocks, sinklab_attention


def eager_attentions(model, ids):
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_equal_eager_and_logits_unchanged(family, monkeypatch):
    model = make_tiny_model(family)
    ids = torch.randint(3, 500, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids).logits
    eager = eager_attentions(model, ids)
    monkeypatch.setattr(blocks, "CHUNK_BYTES", 4 * 4 * 2 * 37 * 5)  # 5 query rows a chunk
    rec = Recorder()
    with sinklab_attention(model, rec), torch.no_grad():
        probed = model(ids).logits
    assert len(rec.chunks[0]) > 1  # really chunked
    torch.testing.assert_close(probed, base, atol=1e-5, rtol=0)
    for layer, ref in enumerate(eager):
        torch.testing.assert_close(rec.weights(layer), ref, atol=1e-6, rtol=0)
    assert model.config._attn_implementation == "sdpa"


def test_decoding_with_cache_matches_sdpa():
    model = make_tiny_model("llama")
    ids = torch.randint(3, 500, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits[:, -1]
        with sinklab_attention(model, Recorder()):
            out = model(ids[:, :-1], use_cache=True)
            step = model(ids[:, -1:], cache=out.past_key_values).logits[:, -1]
    torch.testing.assert_close(step, ref, atol=1e-5, rtol=0)


class Zeroer(AttentionHandler):
    def transform(self, chunk) -> None:
        chunk.weights = torch.zeros_like(chunk.weights)


def test_handlers_are_scoped_even_on_error():
    model = make_tiny_model("qwen2")
    ids = torch.randint(3, 500, (1, 12))
    with torch.no_grad():
        before = model(ids).logits
        with pytest.raises(RuntimeError), sinklab_attention(model, Zeroer()):
            changed = model(ids).logits
            assert not torch.allclose(changed, before)
            raise RuntimeError("boom")
        after = model(ids).logits
    assert torch.equal(before, after)
    assert not any(binding.bound_handlers(m) for m in model.modules())
    assert model.config._attn_implementation == "sdpa"


def test_handlers_bind_to_their_model_and_layers():
    a, b = make_tiny_model("llama", seed=0), make_tiny_model("llama", seed=1)
    rec = Recorder()
    rec.layers = frozenset({1})
    ids = torch.randint(3, 500, (1, 9))
    with sinklab_attention(a, rec), sinklab_attention(b), torch.no_grad():
        b(ids)
        assert rec.chunks == {}
        a(ids)
    assert set(rec.chunks) == {1}


def test_nested_blocks_run_outer_handlers_first_and_unbind_exactly_their_own():
    model = make_tiny_model("llama")
    attn = next(m for m in model.modules() if getattr(m, "layer_idx", None) == 0)
    outer, inner = Recorder(), Zeroer()
    with sinklab_attention(model, outer):
        assert binding.bound_handlers(attn) == [outer]
        with sinklab_attention(model, inner, outer):  # the same handler twice: two bindings
            assert binding.bound_handlers(attn) == [outer, inner, outer]
        assert binding.bound_handlers(attn) == [outer]
    assert binding.bound_handlers(attn) == []
    rec = Recorder()
    rec.layers = frozenset({1})
    with sinklab_attention(model, rec):
        assert binding.bound_handlers(attn, layer=0) == [] and binding.bound_handlers(attn, 1)


def test_bindings_hold_the_model_weakly():
    """A model dropped inside a block leaves no binding behind (they key the module objects)."""
    import gc

    before = len(binding._BOUND)
    model = make_tiny_model("llama")
    block = sinklab_attention(model, Recorder())
    block.__enter__()
    n_modules = len(list(model.modules()))
    assert len(binding._BOUND) == before + n_modules
    del model, block
    gc.collect()
    assert len(binding._BOUND) == before
