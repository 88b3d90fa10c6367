"""Bad CLI inputs: each is refused in one line (exit 2, no traceback), mostly in process
(tests/helpers.run_main); closed and broken stdout need a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import assert_one_line_error, one_line_error, run_main

LONG = "x" * 5000


@pytest.fixture(scope="module")
def short_models(tmp_path_factory, tiny_tokenizer) -> dict[str, str]:
    """A 64-position GPT-2 and a 64-position Llama, saved with the tiny tokenizer."""
    from conftest import make_tiny_model

    made = {}
    for family, key in (("gpt2", "n_positions"), ("llama", "max_position_embeddings")):
        folder = tmp_path_factory.mktemp(f"short-{family}")
        make_tiny_model(family, **{key: 64}).save_pretrained(folder)
        tiny_tokenizer.save_pretrained(folder)
        made[family] = str(folder)
    return made


# (args, needle): refused before any model loads (--model points nowhere, or is the case itself)
CHEAP = {
    "model-name-5000-chars": (["info", "--model", LONG], "not a usable file or folder name"),
    "text-name-5000-chars": (["info", "--text", LONG], "not a usable file or folder name"),
    "model-unknown-user": (["info", "--model", "~nosuchuser-sl/x"], "not a usable file or folder"),
    "text-unknown-user": (["info", "--text", "~nosuchuser-sl/x"], "not a usable file or folder"),
    "model-empty": (["info", "--model", ""], "--model is empty"),
    "text-empty": (["probe", "--text", " "], "--text is empty"),
    "prepend-broken-escape": (["probe", "--prepend", "\\x", "--model", "/nowhere"],
                              "has a broken escape"),
    "train-device-auto": (["train", "--device", "auto"], "a lab model fits one device"),
    "train-vocab-1e8": (["train", "--vocab-size", "100000000"], "--vocab-size must be in 1..65536"),
    "train-huge-model": (["train", "--d-model", "65536", "--heads", "4"], "lab models are tiny"),
    "ablate-lams-on-first-token": (["ablate", "-e", "first-token", "--lams", "0.5", "--model",
                                    "/nowhere"], "--lams has no effect on -e first-token"),
    "ablate-eps-out-of-range": (["ablate", "-e", "first-token", "--eps", "0.3,1.5", "--model",
                                 "/nowhere"], "eps must lie strictly between 0 and 1"),
    "ablate-eps-on-density": (["ablate", "-e", "density", "--eps", "0.5", "--model", "/nowhere"],
                              "--eps has no effect on -e density"),
    "claims-eps-out-of-range": (["claims", "--eps", "1", "--model", "/nowhere"],
                                "eps must be in (0, 1)"),
    "ablate-grid-on-density": (["ablate", "-e", "density", "--grid", "4", "--model", "/nowhere"],
                               "--grid has no effect on -e density"),
    "train-sweep-variants-with-variant": (["train", "--sweep", "variants", "--variant", "sink"],
                                          "--variant has no effect with --sweep variants"),
    "train-sweep-data-with-data": (["train", "--sweep", "data", "--data", "packed"],
                                   "--data has no effect with --sweep data"),
    "stages-trailing-comma": (["report", "--stages", "probe,", "--model", "/nowhere"],
                              "has an empty item"),
    "policy-trailing-comma": (["stream", "--policy", "sink,", "--model", "/nowhere"],
                              "has an empty item"),
    "lengths-double-comma": (["probe", "--lengths", "16,,32", "--model", "/nowhere"],
                             "has an empty item"),
    "usage-unknown-option": (["probe", "--bogus"], "No such option: --bogus"),
    "usage-bad-integer": (["probe", "--tokens", "abc"], "Invalid value for '--tokens'"),
    "usage-unknown-command": (["nosuch"], "No such command 'nosuch'"),
    "usage-missing-option": (["ablate"], "Missing option '--experiment'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CHEAP))
def test_cheap_mistakes_are_one_line(capsys, monkeypatch, case):
    import sinklab.models.loading

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before a cheap check")

    monkeypatch.setattr(sinklab.models.loading, "load_model", no_load)
    args, needle = CHEAP[case]
    assert_one_line_error(run_main(capsys, *args), needle)


# positions past the model's limit: one rule, stated in the error, for every command
POSITIONS = {
    "ablate-gpt2": ("gpt2", ["ablate", "-e", "first-token", "--tokens", "100"], "--tokens 100"),
    "ablate-llama": ("llama", ["ablate", "-e", "mask-sink", "--tokens", "65"], "--tokens 65"),
    "probe": ("llama", ["probe", "--tokens", "100"], "--tokens 100"),
    "probe-lengths": ("llama", ["probe", "--tokens", "32", "--lengths", "16,80"], "--lengths 80"),
    "stream-dense": ("llama", ["stream", "--tokens", "100", "--policy", "dense,sink",
                               "--n-sink", "2", "--window", "8"], "--tokens 100"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(POSITIONS))
def test_positions_past_the_limit_one_rule(capsys, tmp_path, short_models, case):
    family, args, needle = POSITIONS[case]
    run = run_main(capsys, *args, "--model", short_models[family], "--out", str(tmp_path / "o"))
    assert_one_line_error(run, needle)
    assert "has 64, and sinklab never runs a model on more positions than it has" in run.stderr
    assert not (tmp_path / "o").exists()


def test_no_meaningless_bound_in_a_length_error(capsys, tiny_model_dir):
    run = run_main(capsys, "probe", "--model", str(tiny_model_dir("llama")),
                   "--lengths", "99999999999999999999")  # fmt: skip
    assert_one_line_error(run, "--lengths 99999999999999999999 needs")
    assert "4611686018427387904" not in run.stderr


def test_sink_policies_may_stream_past_the_limit(capsys, tmp_path, short_models):
    """The rule is about positions a forward sees at once: the bounded caches stay below it."""
    run = run_main(capsys, "stream", "--model", short_models["llama"], "--tokens", "80",
                   "--policy", "sink", "--n-sink", "2", "--window", "8",
                   "--out", str(tmp_path / "o"))  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "o" / "stream.json").read_text())["meta"]["params"]["n_tokens"]


def _interrupt(*a, **k):
    os.kill(os.getpid(), signal.SIGINT)
    raise AssertionError("SIGINT did not interrupt")


@pytest.mark.parametrize(
    ("args", "target"),
    [
        (["probe", "--tokens", "16"], "sinklab.probe.run.probe"),
        (["generate", "--prompt", "To be", "--window", "8"], "sinklab.stream.generation.generate"),
    ],
)
def test_ctrl_c_prints_one_line(capsys, monkeypatch, tmp_path, tiny_model_dir, args, target):
    monkeypatch.setattr(target, _interrupt)
    run = run_main(capsys, *args, "--model", str(tiny_model_dir("llama")),
                   "--out", str(tmp_path / "o"))  # fmt: skip
    assert_one_line_error(run, "sinklab: interrupted", exit_code=130)
    assert not (tmp_path / "o").exists()


def test_report_clamps_a_length_past_the_model_and_says_so(capsys, tmp_path, tiny_model_dir):
    out = tmp_path / "r"
    run = run_main(capsys, "report", "--model", str(tiny_model_dir("llama")), "--quick",
                   "--stages", "probe-lengths", "--set", "probe_lengths=32,99999",
                   "--set", "probe_tokens=24", "--out", str(out))  # fmt: skip
    assert run.returncode == 0, run.stderr
    note = "probe_lengths 99999 is past the 512 positions of"
    assert "Sizes: " in run.stderr and note in " ".join(run.stderr.split())
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["params"]["probe_lengths"] == [32, 512]  # what ran, not what was asked
    assert data["summary"][0].startswith("Sizes: ") and note in data["summary"][0]
    stage = data["stages"]["probe-lengths"]
    assert stage["status"] == "ok", stage["traceback"]
    assert [r["tokens"] for r in stage["json"]["by_length"]] == [32, 512]


def _process(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sinklab.cli", *args], stderr=subprocess.PIPE, text=True, **kw
    )


def test_closed_stdout_is_one_line():
    """``sinklab info --format json >&-``."""
    proc = subprocess.run(
        ["bash", "-c", f"exec {sys.executable} -m sinklab.cli info --format json >&-"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    one_line_error(proc.returncode, proc.stderr, "standard output is closed")


def test_broken_pipe_is_one_line(tiny_model_dir: Path):
    """``sinklab info --format json | head -c1``: the reader is gone before sinklab writes."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = _process(["info", "--format", "json", "--model", str(tiny_model_dir("llama"))],
                        stdout=write)  # fmt: skip
    finally:
        os.close(write)
    _, err = proc.communicate(timeout=180)
    one_line_error(proc.returncode, err, "standard output was closed")
