"""The published protocols (``gu``, ``barbero``) pinned against a hand-written re-implementation
of Gu et al.'s ``eval_sink_open_source.py`` computation on eager ``output_attentions``."""

import pytest
import torch

from archs import arch_model
from sinklab.errors import SinklabError
from sinklab.probe.protocols import (
    PROTOCOLS,
    Protocol,
    get_protocol,
    protocol_result,
    run_protocol,
    sample_alphas,
    sample_windows,
)


def _script_alphas(model, ids: torch.Tensor) -> torch.Tensor:
    """As the script does it: eager attentions of each sample (N, L, H, T, T), every weight
    divided by T - k for its key k (a ratio vector arange(T, 0, -1) laid along the key axis),
    summed over the query axis."""
    with torch.no_grad():
        att = model(ids, output_attentions=True).attentions  # L x (N, H, T, T)
    scores = torch.stack(att, dim=1).double()  # (N, L, H, T, T)
    t = scores.shape[-1]
    ratios = torch.arange(t, 0, -1, dtype=torch.float64).expand(*scores.shape)
    return (scores / ratios).sum(dim=-2)  # (N, L, H, T)


def _script_metric(alphas: torch.Tensor, eps: float) -> torch.Tensor:
    """The script's printed vector: (alpha > eps) averaged over samples, layers, heads, in %."""
    return (alphas > eps).float().mean(dim=(0, 1, 2)) * 100


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
def test_gu_equals_the_scripts_computation_on_eager_attentions(family):
    model = arch_model(family, n_layers=3) if family == "gpt2" else arch_model(family)
    ids = torch.randint(3, 120, (5, 16), generator=torch.Generator().manual_seed(11))
    ref = _script_alphas(model, ids)
    got = sample_alphas(model, ids, batch=2)  # 3 forwards, the last one short
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # query 0 is included: key 0 receives at least 1 / T (query 0 sees only itself)
    assert float(got[..., 0].min()) >= 1 / 16 - 1e-6
    # a threshold that splits the heads (so the rate can be wrong), midway between two alphas
    vals = ref[..., 0].flatten().sort().values
    mid = vals.numel() // 2
    eps = float(vals[mid - 1] + vals[mid]) / 2
    res = protocol_result(got, Protocol("t", eps, 16, "test"))
    assert 0 < res.sink_rate < 100
    want = _script_metric(ref, eps)
    assert res.sink_rate == pytest.approx(float(want[0]), abs=1e-4)
    assert res.rate_by_key == pytest.approx(want.tolist(), abs=1e-4)  # the script: float32
    per_sample = (ref[..., 0] > eps).double().mean(dim=(1, 2)) * 100
    assert res.by_sample == pytest.approx(per_sample.tolist(), abs=1e-9)
    for name in ("gu", "barbero"):  # the published thresholds, on the same alphas
        p = get_protocol(name)
        res = protocol_result(got, p)
        assert res.sink_rate == pytest.approx(float(_script_metric(ref, p.eps)[0]), abs=1e-4)


def test_protocols_and_json():
    assert (PROTOCOLS["gu"].eps, PROTOCOLS["barbero"].eps) == (0.3, 0.8)
    assert PROTOCOLS["gu"].tokens == PROTOCOLS["barbero"].tokens == 64
    alpha = torch.zeros(2, 3, 2, 4, dtype=torch.float64)  # (N, L, H, T)
    alpha[0, 1, 0, 0] = alpha[1, 1, 0, 0] = 0.9  # layer 1, head 0: a sink in both samples
    alpha[0, 2, 1, 0] = 0.5  # layer 2 head 1: a gu sink in sample 0 only
    gu = protocol_result(alpha, get_protocol("gu")).to_json()
    assert gu["sink_rate_pct"] == pytest.approx(100 * 3 / 12)
    assert gu["by_sample_pct"] == pytest.approx([100 * 2 / 6, 100 * 1 / 6])
    assert gu["by_layer_pct"] == pytest.approx([0, 50, 25])
    assert gu["first_sink_layer"] == 1 and gu["published_pct"]["Llama3-8B"] == 99.02
    barbero = protocol_result(alpha, get_protocol("barbero")).to_json()
    assert barbero["sink_rate_pct"] == pytest.approx(100 * 2 / 12)
    assert "published_pct" not in barbero


def test_bad_inputs_are_refused():
    with pytest.raises(SinklabError, match="unknown protocol 'gv'; use one of q0, gu, barbero"):
        get_protocol("gv")
    model = arch_model("llama")
    with pytest.raises(SinklabError, match=r"token ids \(N, T\)"):
        run_protocol(model, torch.zeros(8, dtype=torch.long), "gu")
    with pytest.raises(SinklabError, match="batch must be >= 1"):
        run_protocol(model, torch.zeros(2, 8, dtype=torch.long), "gu", batch=0)


def test_probe_protocol_command(capsys, tmp_path, tiny_model_dir, tiny_tokenizer):
    """``sinklab probe --protocol gu``: the JSON is run_protocol's on the same windows, each
    started as the tokenizer starts a sequence; a figure beside it."""
    import json

    from helpers import run_main
    from sinklab.corpus import load_text
    from sinklab.models.loading import load_model

    folder = str(tiny_model_dir("llama"))
    out = tmp_path / "gu"
    args = ["probe", "--model", folder, "--protocol", "gu", "--samples", "3", "--tokens", "16"]
    code, stdout, err = run_main(capsys, *args, "--format", "json", "--out", str(out))
    assert code == 0, err
    data = json.loads(stdout)
    loaded = load_model(folder)
    ids = sample_windows(load_text(), loaded.tokenizer, 16, 3)
    want = run_protocol(loaded.model, ids, "gu")
    assert data["sink_rate_pct"] == pytest.approx(want.sink_rate, abs=1e-9)
    assert data["by_sample_pct"] == pytest.approx(want.by_sample, abs=1e-9)
    assert data["meta"]["params"]["protocol"] == "gu" and data["tokens"] == 16
    assert data["first_token"]["id"] == int(ids[0, 0])
    assert (out / "protocol_by_layer.png").stat().st_size > 1000
    code, stdout, err = run_main(capsys, *args[:-2], "--out", str(out))  # 64 tokens by default
    assert code == 0, err
    assert "gu protocol" in stdout and "Llama3-8B 99.02" in stdout


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--protocol", "gv"], "unknown protocol 'gv'"),
        (["--protocol", "gu", "--q0", "4"], "--q0 belongs to sinklab's own probe"),
        (["--protocol", "barbero", "--eps", "0.5"], "fixes its own (all queries, eps 0.8)"),
        (["--protocol", "gu", "--lengths", "8,16"], "drop --lengths or use --protocol q0"),
    ],
)
def test_probe_protocol_refusals(capsys, extra, needle):
    from helpers import one_line_error, run_main

    code, _, err = run_main(capsys, "probe", *extra)
    one_line_error(code, err, needle)


def test_samples_start_as_the_tokenizer_starts_a_sequence(tiny_tokenizer):
    """Each sample: the tokenizer's own start, then the next stretch of the text."""
    from sinklab.corpus import load_text, token_stream

    text = load_text()
    plain = sample_windows(text, tiny_tokenizer, 8, 3)  # this tokenizer adds nothing
    stream = token_stream(text, tiny_tokenizer, 24)
    assert torch.equal(plain, stream.view(3, 8))
    bos = sample_windows(text, tiny_tokenizer, 8, 3, prepend="bos")
    assert (bos[:, 0] == tiny_tokenizer.bos_token_id).all()
    assert torch.equal(bos[:, 1:], token_stream(text, tiny_tokenizer, 21).view(3, 7))


def test_samples_of_a_bos_tokenizer_start_with_one_bos(bos_tokenizer):
    """A tokenizer that puts <s> first (as Gemma's does): every sample starts with exactly one
    <s> by default (and with "default"), none with "none", and never with the literal text."""
    from sinklab.corpus import load_text

    text, bos = load_text(), bos_tokenizer.bos_token_id
    default = sample_windows(text, bos_tokenizer, 8, 3)
    assert (default[:, 0] == bos).all() and (default[:, 1] != bos).all()
    assert torch.equal(sample_windows(text, bos_tokenizer, 8, 3, prepend="default"), default)
    none = sample_windows(text, bos_tokenizer, 8, 3, prepend="none")
    assert (none != bos).all()
    assert torch.equal(none[0, :7], default[0, 1:])  # the same text after the start
