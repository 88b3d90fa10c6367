"""--dtype and --device: an accelerate device map that offloads a layer to disk gives the
undispatched model's numbers; bfloat16 stays within a stated tolerance of float32; bad values are
one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_model
from helpers import assert_one_line_error, run_main
from sinklab.cli import main
from sinklab.models.loading import load_model
from sinklab.probe import probe
from sinklab.stream.evaluate import StreamConfig, streaming_perplexity

OFFLOAD = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "lm_head": "cpu",
}
#: bfloat16 keeps 8 bits of mantissa: attention masses of the tiny model move by at most this
BF16_MASS_TOL = 0.02
#: largest per-target |NLL - NLL(float32)| in nats of a 32-token stream of the tiny model
#: (measured: bfloat16 0.049, float16 0.0056 nats), and of its perplexity, relative (0.28 %, 0.03 %)
STREAM_NLL_TOL = {"bfloat16": 0.15, "float16": 0.03}
STREAM_PPL_TOL = {"bfloat16": 0.01, "float16": 0.002}


def _ids() -> torch.Tensor:
    return torch.randint(3, 500, (48,), generator=torch.Generator().manual_seed(0))


def test_disk_offloaded_layer_gives_the_same_numbers(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SINKLAB_CACHE", str(tmp_path / "cache"))  # the offload folder
    folder = str(tiny_model_dir("llama"))
    plain, spread = load_model(folder), load_model(folder, device=OFFLOAD)
    assert spread.model.hf_device_map["model.layers.1"] == "disk"
    assert all(p.device.type == "meta" for p in spread.model.model.layers[1].parameters())
    ids = _ids()
    with torch.no_grad():
        want, got = plain.model(ids[None]).logits, spread.model(ids[None]).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    a, b = probe(plain.model, ids), probe(spread.model, ids)
    for name in ("sink_mass", "diagonal_mass", "entropy", "sink_output_share"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), atol=1e-6, rtol=1e-6)


def test_bfloat16_within_tolerance_of_float32(tiny_model_dir):
    folder = str(tiny_model_dir("llama"))
    fp32, bf16 = load_model(folder), load_model(folder, dtype="bfloat16")
    assert bf16.info.dtype == "bfloat16"
    ids = _ids()
    a, b = probe(fp32.model, ids), probe(bf16.model, ids)
    diff = (a.sink_mass - b.sink_mass.float()).abs().max()
    assert 0 < float(diff) <= BF16_MASS_TOL


@pytest.fixture(scope="module")
def positional_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama whose weights are large enough that attention (and so the policies) differ."""
    folder = tmp_path_factory.mktemp("tiny-positional")
    make_tiny_model("llama", seed=3, n_layers=3, initializer_range=0.2).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def float32_streams() -> dict:
    return {}  # method -> the float32 StreamResult, computed once


@pytest.mark.parametrize(
    ("dtype", "method"), [("bfloat16", "chunked"), ("bfloat16", "step"), ("float16", "chunked")]
)
def test_stream_in_half_precision_within_tolerance(positional_dir, float32_streams, dtype, method):
    """Every policy (the sink cache's key re-rotation, the band, the oracle) runs in the model's
    dtype and stays within the stated tolerance of float32."""
    # step: the two policies with their own step loops (bf16 steps are slow on a CPU)
    policies = (
        ("sink", "recompute") if method == "step" else ("dense", "window", "sink", "recompute")
    )
    ids = _ids()[:32]
    cfg = StreamConfig(policies=policies, n_sink=2, window=8, n_tokens=32, method=method, chunk=8)
    if method not in float32_streams:
        fp32 = load_model(str(positional_dir)).model
        float32_streams[method] = streaming_perplexity(fp32, ids, cfg)
    want = float32_streams[method]
    half = load_model(str(positional_dir), dtype=dtype).model
    assert next(half.parameters()).dtype == getattr(torch, dtype)
    got = streaming_perplexity(half, ids, cfg)
    for p in policies:
        a, b = torch.tensor(want.policies[p].nll), torch.tensor(got.policies[p].nll)
        diff = float((a - b).abs().max())
        assert 0 < diff <= STREAM_NLL_TOL[dtype], (p, diff)
        assert got.policies[p].ppl == pytest.approx(want.policies[p].ppl, rel=STREAM_PPL_TOL[dtype])
    ppl = [want.policies[p].ppl for p in policies]
    assert len({round(x, 1) for x in ppl}) == len(policies)  # the policies see different keys


def test_cli_dtype_and_device(tiny_model_dir, tmp_path, capsys):
    folder = str(tiny_model_dir("llama"))
    base = ["probe", "--model", folder, "--tokens", "32"]
    assert main([*base, "--dtype", "bfloat16", "--out", str(tmp_path / "a")]) == 0
    data = json.loads((tmp_path / "a" / "probe.json").read_text())
    assert data["meta"]["model"]["dtype"] == "bfloat16"
    for flag, value, needle in (("--dtype", "float64", "--dtype must be one of"),) + (
        () if torch.cuda.is_available() else (("--device", "cuda", "no CUDA device"),)
    ):
        run = run_main(capsys, *base, flag, value, "--out", str(tmp_path / value))
        assert_one_line_error(run, needle)


MODEL_COMMANDS = (
    "info",
    "probe",
    "stream",
    "ablate",
    "generate",
    "report",
    "chat",
    "claims",
    "serve",
)
NO_PRETRAINED_MODEL = ("train", "cost")  # lab models from scratch; synthetic fits (README)


def test_every_command_is_a_model_command_or_a_stated_exception():
    from sinklab.cli import app

    names = {c.name for c in app.registered_commands}
    assert names == set(MODEL_COMMANDS) | set(NO_PRETRAINED_MODEL)


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_every_command_takes_dtype_and_device(command, capsys):
    """Every command that loads a pretrained model; ``train`` and ``cost`` load none (README)."""
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--dtype" in out and "--device" in out
