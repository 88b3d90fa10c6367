"""The model loader's refusals (offline, safetensors only, weights that fit the config, clean
one-line errors) and the attention implementation it picks (Gemma 2, gpt-oss, BLOOM and MPT load;
docs/architectures.md)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from archs import arch_model
from helpers import assert_one_line_error, run_main
from sinklab.models.loading import load_model


@pytest.fixture
def no_network(monkeypatch):
    """Every socket connection or name lookup raises and is recorded; the Hub's offline switches
    are turned off first, so only sinklab's own offline mode can keep it from trying."""
    import huggingface_hub.constants as hub

    attempts: list[tuple] = []

    def refuse(*args, **kwargs):
        attempts.append(args[1:] if args and isinstance(args[0], socket.socket) else args)
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    return attempts


@pytest.mark.parametrize("name", ["gpt2", "nobody-here/not-a-model-xyz"])
def test_uncached_id_makes_no_network_attempt(capsys, no_network, tmp_path, monkeypatch, name):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache: nothing is cached
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    line = assert_one_line_error(run_main(capsys, "info", "--model", name), "never downloads")
    assert no_network == [], no_network
    assert name in line


def _save(model, folder: Path, tokenizer) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tiny_tokenizer, tiny_model_factory) -> Path:
    return _save(tiny_model_factory("llama"), tmp_path_factory.mktemp("llama"), tiny_tokenizer)


def _copy_without_weights(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.ckpt"])
def test_pickle_weights_refused_never_unpickled(capsys, llama_dir, tmp_path, monkeypatch, name):
    folder = _copy_without_weights(llama_dir, tmp_path / "pickled")
    torch.save({"x": torch.zeros(1)}, folder / name)

    def no_unpickle(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_unpickle)
    line = assert_one_line_error(run_main(capsys, "info", "--model", str(folder)), "pickle weights")
    assert name in line and "save_pretrained" in line


def test_config_without_weights_refused(capsys, llama_dir, tmp_path):
    folder = _copy_without_weights(llama_dir, tmp_path / "bare")
    assert_one_line_error(run_main(capsys, "info", "--model", str(folder)), "no weights")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "huge-header", "empty"])
def test_broken_safetensors_refused(capsys, llama_dir, tmp_path, damage):
    folder = _copy_without_weights(llama_dir, tmp_path / damage)
    data = (llama_dir / "model.safetensors").read_bytes()
    broken = {
        "truncated": data[: len(data) // 2],
        "garbage": bytes(range(256)) * 64,
        "huge-header": (10**12).to_bytes(8, "little") + b"{}",
        "empty": b"",
    }[damage]
    (folder / "model.safetensors").write_bytes(broken)
    assert_one_line_error(run_main(capsys, "info", "--model", str(folder)), "model.safetensors")


def test_weights_of_another_model_refused_listing_names(capsys, llama_dir, tmp_path):
    folder = _copy_without_weights(llama_dir, tmp_path / "mixed")
    gpt2 = arch_model("gpt2", vocab_size=512)
    save_file(
        {k: v.contiguous() for k, v in gpt2.state_dict().items()}, folder / "model.safetensors"
    )
    line = assert_one_line_error(
        run_main(capsys, "info", "--model", str(folder)), "do not fit its config"
    )
    assert "missing" in line and "model.layers.0." in line and "unexpected" in line


def test_one_missing_weight_refused(capsys, llama_dir, tmp_path):
    from safetensors.torch import load_file

    folder = _copy_without_weights(llama_dir, tmp_path / "holed")
    state = load_file(llama_dir / "model.safetensors")
    state.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(state, folder / "model.safetensors")
    line = assert_one_line_error(
        run_main(capsys, "info", "--model", str(folder)), "1 weights missing"
    )
    assert "model.layers.1.self_attn.k_proj.weight" in line


def test_config_without_architectures_refused(capsys, llama_dir, tmp_path):
    folder = tmp_path / "noarch"
    folder.mkdir()
    for f in llama_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("architectures")
    (folder / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_main(capsys, "info", "--model", str(folder)), "names no architecture")


def test_good_folder_still_loads(llama_dir):
    loaded = load_model(str(llama_dir))
    assert loaded.model.config._attn_implementation == "sdpa"
    assert loaded.info.weights_sha256 and len(loaded.info.weights_sha256) == 64


@pytest.mark.parametrize(
    ("family", "impl"),
    [("gemma2", "sinklab"), ("gpt_oss", "sinklab"), ("bloom", "eager"), ("mpt", "eager")],
)
def test_models_without_sdpa_load_and_run(tmp_path, tiny_tokenizer, family, impl):
    """These crashed on load with sdpa hard-coded; the loaded model must compute what the
    eager reference computes."""
    ref = arch_model(family, vocab_size=512)
    folder = _save(ref, tmp_path / family, tiny_tokenizer)
    loaded = load_model(str(folder))
    assert loaded.model.config._attn_implementation == impl
    ids = torch.randint(3, 500, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)


def test_falcon_kv_heads_from_its_config(tmp_path, tiny_tokenizer):
    folder = _save(arch_model("falcon", vocab_size=512), tmp_path / "falcon", tiny_tokenizer)
    info = load_model(str(folder)).info
    assert (info.n_heads, info.n_kv_heads) == (4, 2)
