"""``sinklab stream`` and ``sinklab generate`` end to end on a tiny model, and their user errors
(one line, exit 2). Run in-process through ``sinklab.cli.main`` (the entry point's own code), so
each case costs no interpreter start-up (test_cli.py checks the subprocess path)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from archs import save_arch_model
from helpers import one_line_error, run_main
from sinklab.meta import restore_non_finite  # the JSON writes NaN (an unscored target) as null

STREAM = ["--tokens", "40", "--n-sink", "2", "--window", "8"]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny random Gemma 2: a sliding-window layer (window 6) and a global layer."""
    return save_arch_model("gemma2", tmp_path_factory.mktemp("tiny-gemma2"), tiny_tokenizer)


def test_stream_all_policies_writes_json_and_figure(capsys, tmp_path: Path, tiny_model_dir):
    out = tmp_path / "s"
    code, stdout, err = run_main(
        capsys,
        "stream",
        "--model",
        str(tiny_model_dir("llama")),
        "--text",
        "shakespeare:hamlet",
        "--tokens",
        "40",
        "--policy",
        "all",
        "--n-sink",
        "2",
        "--window",
        "8",
        "--recompute-every",
        "5",
        "--segment",
        "10",
        "--out",
        str(out),
    )
    assert code == 0, err
    data = restore_non_finite(json.loads((out / "stream.json").read_text()))
    assert set(data["policies"]) == {"dense", "window", "sink", "recompute", "sink-auto"}
    # llama: the default method (auto) picks chunked, says so on one line and in the JSON
    assert data["meta"]["params"]["method"] == "auto" and data["method"] == "chunked"
    assert data["method_reason"].startswith("auto: chunked serves this model")
    flat = " ".join(stdout.split())  # the result on stdout (it was stderr before issue 28)
    assert flat.startswith(f"method: chunked ({data['method_reason']}) ")
    # --segment: blocks of 10 targets, each the exp of its mean NLL (the JSON's rounded NLLs)
    assert data["meta"]["params"]["segment"] == 10
    for r in data["policies"].values():  # recompute: its scored (every 5th) targets
        want = []
        for i in range(0, 39, 10):
            scored = [x for x in r["nll"][i : i + 10] if not math.isnan(x)]
            want.append(math.exp(sum(scored) / len(scored)))
        assert r["segment_ppl"] == pytest.approx(want, rel=1e-4)
    dense, sink = data["policies"]["dense"]["segment_ppl"], data["policies"]["sink"]["segment_ppl"]
    at = next((i * 10 for i, (d, s) in enumerate(zip(dense, sink, strict=True)) if d > 2 * s), None)
    assert data["dense_collapse"]["block"] == 10 and data["dense_collapse"]["at_token"] == at
    plotted = json.loads((out / "block_ppl.json").read_text())
    assert plotted["x"] == [10, 20, 30, 40]
    assert set(plotted["series"]) == {"dense", "window", "sink", "sink-auto"}
    assert plotted["series"]["sink"] == sink
    assert data["meta"]["params"]["window"] == 8 and data["meta"]["text"]["name"]
    for r in data["policies"].values():
        assert len(r["nll"]) == 39 and r["ppl"] > 1 and r["peak_rss_mb"] > 0
    assert data["policies"]["sink"]["max_cache_len"] == 10
    assert data["on_recompute_targets"]["recompute_every"] == 5
    assert "max cache none (a fresh forward per target)" in flat
    assert "on the 8 targets the oracle scored (every 5th): dense " in flat
    assert (out / "running_ppl.png").stat().st_size > 1000
    assert (out / "block_ppl.png").stat().st_size > 1000
    plotted = json.loads((out / "running_ppl.json").read_text())
    assert set(plotted["series"]) == set(data["policies"])


def test_generate_streams_text_with_a_bounded_cache(capsys, tmp_path: Path, tiny_model_dir):
    code, out, err = run_main(
        capsys,
        "generate",
        "--model",
        str(tiny_model_dir("llama")),
        "--prompt",
        "To be or not",
        "--max-new-tokens",
        "30",
        "--n-sink",
        "2",
        "--window",
        "6",
        "--ignore-eos",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    data = json.loads((tmp_path / "generate.json").read_text())
    assert data["n_new_tokens"] == 30 and data["max_cache_len"] == 8
    assert out.strip() == data["text"].strip() and out.strip()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["stream", "--n-sink", "0"], "n_sink must be a positive"),
        (["stream", "--window", "-5"], "window must be a positive"),
        (["stream", "--tokens", "0"], "at least 2"),
        (["stream", "--policy", "sinky"], "unknown policy"),
        (["stream", "--recompute-every", "0"], "recompute_every"),
        (["stream", "--segment", "0"], "segment must be a positive"),
        (["stream", "--method", "fast"], "unknown method"),
        (["stream", "--text", "/no/such.txt"], "does not exist"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", "--prompt", "hi", "--window", "0"], "window must be a positive"),
        (["generate"], "exactly one of --prompt"),
        (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    ],
)
def test_cheap_mistakes_fail_before_the_model_loads(capsys, args, needle, monkeypatch):
    import sinklab.models.loading

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before a cheap check")

    monkeypatch.setattr(sinklab.models.loading, "load_model", no_load)
    code, _, err = run_main(capsys, *args)
    one_line_error(code, err, needle)


@pytest.mark.parametrize(
    ("family", "args", "needle"),
    [
        ("llama", ["--window", "600"], "max positions"),
        ("gpt2", [], "absolute position"),
    ],
)
def test_model_mistakes_exit_2(capsys, tiny_model_dir, family, args, needle):
    for cmd in (["stream", "--tokens", "20"], ["generate", "--prompt", "hi"]):
        code, _, err = run_main(capsys, *cmd, "--model", str(tiny_model_dir(family)), *args)
        one_line_error(code, err, needle)


def _stream_both(capsys, tmp_path, folder, methods) -> dict:
    """``sinklab stream`` on ``folder`` once per method ("auto": no --method) -> JSON per method;
    each says on stdout, with its result, which method ran and why."""
    got = {}
    for method in methods:
        out = tmp_path / method
        args = [*STREAM, "--policy", "dense,sink,recompute", "--recompute-every", "5"]
        args += ["--out", str(out)]
        extra = [] if method == "auto" else ["--method", method]
        code, stdout, err = run_main(capsys, "stream", "--model", str(folder), *args, *extra)
        assert code == 0, err
        got[method] = restore_non_finite(json.loads((out / "stream.json").read_text()))
        ran, reason = got[method]["method"], got[method]["method_reason"]
        assert " ".join(stdout.split()).startswith(f"method: {ran} ({reason}) ")  # the result
        assert (out / "block_ppl.png").stat().st_size > 1000
    return got


def test_hybrid_model_streams_by_default_chunked_with_the_step_nlls(capsys, tmp_path, hybrid_dir):
    """Gemma 2 (sliding + global layers): the default (auto) runs chunked (sliding layers read
    the model's own window band), says why, and gives ``--method step``'s numbers (1e-4)."""
    got = _stream_both(capsys, tmp_path, hybrid_dir, ("auto", "step"))
    auto, step = got["auto"], got["step"]
    assert (auto["method"], step["method"]) == ("chunked", "step")
    assert auto["method_reason"].startswith("auto: chunked serves this model")
    assert step["method_reason"] == "asked for"
    for name, r in step["policies"].items():
        a, b = (torch.tensor(x["nll"], dtype=torch.float64) for x in (auto["policies"][name], r))
        assert len(a) == len(b) == 39, name
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, equal_nan=True)
        assert auto["policies"][name]["segment_ppl"] == pytest.approx(r["segment_ppl"], rel=1e-4)


@pytest.fixture(scope="module")
def falcon_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny random Falcon (RoPE): the sink cache serves it, but its attention does not go
    through transformers' AttentionInterface, so chunked streaming refuses it."""
    return save_arch_model("falcon", tmp_path_factory.mktemp("tiny-falcon"), tiny_tokenizer)


def test_a_model_chunked_refuses_streams_by_default_with_the_step_nlls(
    capsys, tmp_path, falcon_dir
):
    """Falcon: chunked refuses it, so the default (auto) runs step, says why, and gives exactly
    ``--method step``'s numbers."""
    got = _stream_both(capsys, tmp_path, falcon_dir, ("auto", "step"))
    auto, step = got["auto"], got["step"]
    assert auto["method"] == step["method"] == "step"
    assert auto["method_reason"].startswith("auto: FalconForCausalLM does not dispatch attention")
    for name, r in step["policies"].items():
        assert auto["policies"][name]["nll"] == r["nll"] and len(r["nll"]) == 39, name
        assert auto["policies"][name]["segment_ppl"] == r["segment_ppl"], name


def test_method_chunked_on_a_model_it_refuses_is_refused_before_any_work(
    capsys, tmp_path, falcon_dir, monkeypatch
):
    import sinklab.stream.evaluate

    def no_run(*a, **k):
        raise AssertionError("the stream ran before the refusal")

    monkeypatch.setattr(sinklab.stream.evaluate, "streaming_perplexity", no_run)
    code, _, err = run_main(
        capsys, "stream", "--model", str(falcon_dir), *STREAM, "--method", "chunked",
        "--out", str(tmp_path / "s"),
    )  # fmt: skip
    one_line_error(code, err, "AttentionInterface, so sinklab cannot capture")
    assert not (tmp_path / "s").exists()
