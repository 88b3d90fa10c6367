"""The three model families of the zoo, real weights (``make test`` installs them first with
``sinklab models install``): the probe equals eager ``output_attentions`` on each model's own
default ids, Gemma finds its sink heads with no option (its tokenizer's ``<bos>``) and loses them
without it, Qwen2.5's first real token is its sink, and ``meta.first_token`` says what came first.
Short inputs: the whole file takes well under a minute and a half on 2 cores once cached."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import run_main
from sinklab.corpus import first_token, load_text, token_stream
from sinklab.models.loading import load_model
from sinklab.models.zoo import ZOO, dequantized_dir, is_ready
from sinklab.probe import ProbeConfig, probe

pytestmark = pytest.mark.integration

NAMES = ("smollm2-135m", "gemma3-270m", "qwen2.5-0.5b")


def _installed(name: str) -> None:
    """A zoo model the suite needs and this machine lacks is a failure that says what to run
    (``make test`` installs them), not a skip."""
    if not ZOO[name].embedded and not is_ready(dequantized_dir(ZOO[name])):
        pytest.fail(
            f"{name} is not installed: run `sinklab models install {name}` (make test does)"
        )


@pytest.fixture(scope="module")
def zoo_models(smollm2):
    loaded = {"smollm2-135m": smollm2}
    for name in NAMES[1:]:
        _installed(name)
        loaded[name] = load_model(name)
    return loaded


def _eager(model, ids):
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(ids[None], output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)


@pytest.mark.parametrize("name", NAMES)
def test_probe_equals_eager_on_the_tokenizers_default_ids(zoo_models, name):
    loaded = zoo_models[name]
    tok = loaded.tokenizer
    ids = token_stream(load_text(), tok, 40)
    text_ids = tok(load_text().text[:400], add_special_tokens=False).input_ids
    own = tok("x", add_special_tokens=True).input_ids[:1]  # what the tokenizer puts first
    if name == "gemma3-270m":
        assert ids[0].item() == tok.bos_token_id == own[0] and ids[1:5].tolist() == text_ids[:4]
    else:  # SmolLM2 and Qwen2.5 add nothing: the text's own first token comes first
        assert ids[:5].tolist() == text_ids[:5]
    q0 = 4
    result = probe(loaded.model, ids, ProbeConfig(q0=q0))
    eager = torch.stack([a[0] for a in _eager(loaded.model, ids)])  # (L, H, T, T)
    assert eager.shape[:2] == result.sink_mass.shape
    by_hand = eager[:, :, q0:, 0].double().mean(-1)  # mean attention on key 0, queries >= q0
    torch.testing.assert_close(result.sink_mass.double(), by_hand, atol=1e-4, rtol=0)
    diag = eager.diagonal(dim1=-2, dim2=-1)[:, :, q0:].double().mean(-1)
    torch.testing.assert_close(result.diagonal_mass.double(), diag, atol=1e-4, rtol=0)


def test_gemma_finds_its_sink_heads_by_default(zoo_models, capsys, tmp_path):
    """`sinklab probe --model gemma3-270m` with no first-token option: the tokenizer's <bos>
    comes first and most heads sink on it; the same text without it has almost none."""
    out = tmp_path / "probe"
    args = ["--model", "gemma3-270m", "--tokens", "128", "--no-figures", "--format", "json"]
    run = run_main(capsys, "probe", *args, "--out", str(out))
    assert run.returncode == 0, run.stderr
    data = json.loads((out / "probe.json").read_text())
    first = data["meta"]["first_token"]
    assert (first["text"], first["prepend"], first["tokenizer_default"]) == (
        "<bos>",
        "default",
        True,
    )
    assert data["sink_rate"]["0.3"] > 0.3, data["sink_rate"]
    gemma = zoo_models["gemma3-270m"]
    ids = token_stream(load_text(), gemma.tokenizer, 128, "none")
    without = probe(gemma.model, ids, ProbeConfig(q0=0))
    assert without.sink_rate["0.3"] < 0.1, without.sink_rate


def test_qwens_first_real_token_is_its_sink(zoo_models):
    qwen = zoo_models["qwen2.5-0.5b"]
    first = first_token(qwen.tokenizer)
    assert (first.added, first.tokenizer_default) == ((), True)
    ids = token_stream(load_text(), qwen.tokenizer, 128, first)
    assert ids[0].item() not in qwen.tokenizer.all_special_ids  # a real token of the text
    result = probe(qwen.model, ids, ProbeConfig(q0=16))
    received = result.received[1:].mean(dim=(0, 1))  # (T,): layers >= 1, every head
    assert received.argmax().item() == 0  # the first token draws the most attention
    assert result.sink_mass[1:].mean().item() > 0.2, result.sink_mass[1:].mean()  # about 0.3
    record = first.record(qwen.tokenizer, ids)
    assert record["id"] == ids[0].item() and record["added"] == []
    assert record["text"] == qwen.tokenizer.decode([ids[0].item()])
