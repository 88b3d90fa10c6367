"""Hostile inputs: files that are not files, configs that lie, stdin that is not text, numbers past
any machine. Each case is one line on stderr, exit 2, no traceback, and nothing hangs (every
process runs under a timeout; a FIFO would block ``open`` forever).

The outputs side (atomic swaps, full disks, caches, signals) is in ``tests/test_hostile.py``."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from conftest import CHAT_TEMPLATE
from helpers import assert_one_line_error, one_line_error, run_main, run_process
from sinklab import safeio
from sinklab.errors import SinklabError

TIMEOUT = 120  # a process that would block on a FIFO or read /dev/zero is killed, and fails


# --------------------------------------------------------------------------- safeio, pure
def test_check_regular_refuses_fifo_device_and_folder(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(SinklabError, match="FIFO"):
        safeio.read_bytes(fifo, "text file", "text")  # returns at once, never opens the FIFO
    with pytest.raises(SinklabError, match="a device"):
        safeio.read_bytes("/dev/zero", "text file", "text")
    link = tmp_path / "zero"
    link.symlink_to("/dev/zero")
    with pytest.raises(SinklabError, match="a device"):
        safeio.read_bytes(link, "text file", "text")  # links are followed
    with pytest.raises(SinklabError, match="a folder"):
        safeio.read_bytes(tmp_path, "text file", "text")
    with pytest.raises(SinklabError, match="does not exist"):
        safeio.read_bytes(tmp_path / "nope", "text file", "text")


def test_read_bytes_refuses_one_byte_past_the_limit(tmp_path, monkeypatch):
    monkeypatch.setitem(safeio.LIMITS, "text", 10)
    (tmp_path / "ok").write_bytes(b"x" * 10)
    (tmp_path / "big").write_bytes(b"x" * 11)
    assert safeio.read_bytes(tmp_path / "ok", "text file", "text") == b"x" * 10
    with pytest.raises(SinklabError, match="over sinklab's limit"):
        safeio.read_bytes(tmp_path / "big", "text file", "text")


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("[" * 64 + "]" * 64, True),
        ("[" * 65 + "]" * 65, False),
        ('{"a": "' + "[" * 1000 + '"}', True),  # brackets inside a string do not nest
        ('["\\"[[[[", 1]', True),  # an escaped quote does not end the string
        ("{" * 100_000, False),
    ],
)
def test_json_depth(text, ok):
    assert safeio.json_depth_ok(text) is ok


def test_parse_json_deep_and_broken_are_one_line():
    with pytest.raises(SinklabError, match="nests deeper than 64"):
        safeio.parse_json("[" * 100_000, "x.json")
    with pytest.raises(SinklabError, match="not valid JSON"):
        safeio.parse_json('{"a": ', "x.json")
    assert safeio.parse_json('{"loss": NaN}', "x.json")["loss"] != 0  # NaN read as a float


# --------------------------------------------------------------------------- model folders
@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tiny_tokenizer):
    from conftest import make_tiny_model

    folder = tmp_path_factory.mktemp("hostile-base")
    make_tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def _variant(base: Path, where: Path, **config) -> Path:
    shutil.copytree(base, where)
    path = where / "config.json"
    raw = json.loads(path.read_text())
    raw.update(config)
    path.write_text(json.dumps(raw))
    return where


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"num_hidden_layers": 100_000}, "num_hidden_layers is 100000, outside 1..1024"),
        ({"num_hidden_layers": -5}, "num_hidden_layers is -5"),
        ({"num_hidden_layers": 3}, "the weights"),  # in bounds, but the weights hold 2 layers
        ({"num_attention_heads": 4.5}, "num_attention_heads is 4.5, not a whole number"),
        ({"hidden_size": 10**9}, "hidden_size is 1000000000"),
        ({"intermediate_size": 10**12}, "intermediate_size is 1000000000000"),
        ({"vocab_size": 10**10}, "vocab_size is 10000000000"),
        ({"vocab_size": 64}, "input embedding"),  # in bounds, but not the embedding's rows
        ({"max_position_embeddings": 0}, "max_position_embeddings is 0"),
        ({"intermediate_size": 48}, "do not fit its config"),  # a shape only transformers sees
    ],
)
def test_lying_configs_are_one_line_before_anything_is_built(
    capsys, base_dir, tmp_path, config, needle
):
    folder = _variant(base_dir, tmp_path / "m", **config)
    run = run_main(capsys, "info", "--model", str(folder))
    assert_one_line_error(run, needle)
    assert "LOAD REPORT" not in run.stderr and "Notes:" not in run.stderr


def test_fifo_weights_do_not_block(base_dir, tmp_path):
    folder = _variant(base_dir, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    run = run_process("info", "--model", str(folder), timeout=TIMEOUT)
    assert_one_line_error(run, "is a FIFO (named pipe), not a regular file")


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("config.json", "[" * 100_000, "nests deeper than 64"),
        ("tokenizer.json", "[" * 100_000, "nests deeper than 64"),
        ("tokenizer_config.json", "{", "not valid JSON"),
    ],
)
def test_broken_model_json_is_one_line(capsys, base_dir, tmp_path, name, content, needle):
    folder = _variant(base_dir, tmp_path / "m")
    (folder / name).write_text(content)
    assert_one_line_error(run_main(capsys, "info", "--model", str(folder)), needle)


def test_tokenizer_without_added_tokens_is_one_line(capsys, base_dir, tmp_path):
    folder = _variant(base_dir, tmp_path / "m")
    raw = json.loads((folder / "tokenizer.json").read_text())
    del raw["added_tokens"]
    (folder / "tokenizer.json").write_text(json.dumps(raw))
    run = run_main(capsys, "info", "--model", str(folder))
    assert_one_line_error(run, "has no usable tokenizer (KeyError")


CUSTOM_CODE = """
from transformers import LlamaConfig, LlamaForCausalLM


class CustomConfig(LlamaConfig):
    model_type = "custom-tiny"


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""


def test_custom_code_causal_lm_loads_with_trust_remote_code(base_dir, tmp_path):
    """A causal LM defined by the folder's own code: refused without --trust-remote-code, loaded
    with it (the causal-LM check reads the config's auto_map, not only built-in types)."""
    folder = _variant(
        base_dir,
        tmp_path / "custom",
        model_type="custom-tiny",
        architectures=["CustomForCausalLM"],
        auto_map={
            "AutoConfig": "modeling_custom.CustomConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
        },
    )
    (folder / "modeling_custom.py").write_text(CUSTOM_CODE)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    refused = run_process("info", "--model", str(folder), timeout=TIMEOUT, env=env)
    assert_one_line_error(refused, "--trust-remote-code")
    run = run_process(
        "info", "--model", str(folder), "--trust-remote-code", "--format", "json", env=env
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["model"]["model_type"] == "custom-tiny"


# --------------------------------------------------------------------------- texts and lab runs
def test_fifo_and_device_texts_do_not_hang(base_dir, tmp_path):
    fifo = tmp_path / "text.txt"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.txt"
    zero.symlink_to("/dev/zero")
    for path, needle in ((fifo, "FIFO"), (zero, "a device")):
        run = run_process(
            "probe", "--model", str(base_dir), "--text", str(path), "--tokens", "16",
            "--out", str(tmp_path / "p"), timeout=TIMEOUT,
        )  # fmt: skip
        assert_one_line_error(run, needle)
        assert not (tmp_path / "p").exists()


def test_lab_runs_that_are_fifos_devices_or_deep_json_are_skipped(tmp_path):
    """claims --lab reads every train.json below a folder: a FIFO, a link to /dev/zero or JSON
    nested 100,000 deep is skipped with a warning, at once, and the readable runs are read."""
    from sinklab.claims.measure_lab import load_lab_runs

    good = {"config": {"task": "backcopy", "seed": 0}, "checkpoints": [{"step": 1}], "val": {}}
    for name in ("fifo", "zero", "deep", "good"):
        (tmp_path / name).mkdir()
    os.mkfifo(tmp_path / "fifo" / "train.json")
    (tmp_path / "zero" / "train.json").symlink_to("/dev/zero")
    (tmp_path / "deep" / "train.json").write_text("[" * 100_000)
    (tmp_path / "good" / "train.json").write_text(json.dumps(good))
    runs = load_lab_runs(tmp_path)
    assert [r.path.name for r in runs] == ["good"]


def test_a_deep_lab_run_is_no_finished_run(tmp_path):
    from sinklab.lab.train import load_result

    (tmp_path / "train.json").write_text("[" * 100_000)
    assert load_result(tmp_path) is None


# --------------------------------------------------------------------------- chat's stdin
@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tiny_tokenizer):
    import copy

    from conftest import make_tiny_model

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    folder = tmp_path_factory.mktemp("hostile-chat")
    make_tiny_model("llama").save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _chat(folder: Path, stdin) -> object:
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "sinklab.cli", "chat", "--model", str(folder),
         "--max-new-tokens", "2", "--n-sink", "2", "--window", "10"],
        stdin=stdin, capture_output=True, timeout=TIMEOUT,
    )  # fmt: skip
    return proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode()


@pytest.mark.parametrize(
    ("feed", "needle"),
    [
        ("zero", "longer than 65536 bytes"),
        (b"to be or not\n\xff\xfe bad\n", "is not UTF-8"),
        (b"to be\x00 or not\n", "NUL bytes"),
        (b"x" * 70_000 + b"\n", "longer than 65536 bytes"),
    ],
)
def test_chat_stdin_that_is_not_text_is_one_line(chat_dir, tmp_path, feed, needle):
    if feed == "zero":
        with open("/dev/zero", "rb") as stdin:
            code, _, err = _chat(chat_dir, stdin)
    else:
        path = tmp_path / "in"
        path.write_bytes(feed)
        with open(path, "rb") as stdin:
            code, _, err = _chat(chat_dir, stdin)
    one_line_error(code, err, needle)


def test_chat_with_closed_stdin_is_one_line(chat_dir):
    import subprocess

    cmd = f"exec {sys.executable} -m sinklab.cli chat --model {chat_dir} <&-"
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=TIMEOUT)
    one_line_error(proc.returncode, proc.stderr, "stdin is closed")


# --------------------------------------------------------------------------- numbers and lists
BIG = str(2**64)


@pytest.mark.parametrize("command", ["generate", "chat", "train", "cost", "claims"])
def test_seed_past_torch_is_one_line(capsys, command):
    run = run_main(capsys, command, "--seed", BIG)
    assert_one_line_error(run, f"--seed {BIG} is outside the seeds torch accepts")


def test_largest_torch_seed_works(capsys, tmp_path):
    args = ("--lengths", "4,8", "--task", "sink", "--steps", "10", "--bisections", "1")
    run = run_main(capsys, "cost", *args, "--seed", str(2**64 - 1), "--out", str(tmp_path / "c"))
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "c" / "cost.json").is_file()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("cost", "--dim", "100000000"), "--dim must be in 2..4096"),
        (("cost", "--steps", "100000000000"), "--steps must be in 10..100000"),
        (("cost", "--bisections", "100000"), "--bisections must be in 1..64"),
        (("train", "--d-model", "0"), "--d-model must be >= 2, got 0"),
        (("generate", "--temperature", "inf"), "temperature must be a finite number >= 0"),
        (("report", "--set", "window=5", "--set", "window=6"), "--set window is given twice"),
        (("report", "--set", "probe_lengths=128,,256"), "has an empty item"),
        (("claims", "--texts", "a,,b"), "has an empty item"),
    ],
)
def test_out_of_range_and_malformed_options_are_one_line(capsys, tmp_path, args, needle):
    run = run_main(capsys, *args, "--out", str(tmp_path / "o"))
    assert_one_line_error(run, needle)
    assert not (tmp_path / "o").exists()


def test_bounds_are_stated_in_help(capsys):
    run = run_main(capsys, "cost", "--help")
    text = " ".join(run.stdout.split())
    assert "2..4096" in text and "10..100000" in text and "1..64" in text


def test_negative_positions_say_so(capsys, base_dir, tmp_path):
    run = run_main(
        capsys, "ablate", "-e", "mask-sink", "--positions", "-1", "--model", str(base_dir),
        "--out", str(tmp_path / "a"),
    )  # fmt: skip
    assert_one_line_error(run, "--positions '-1' has a negative number")


@pytest.mark.parametrize(
    ("claims", "option"),
    [
        ((), "--sensitivity-tokens 128"),  # the larger of the model claims' windows
        (("--claims", "evict-sinks-collapse"), "--stream-tokens"),  # its own 1,280-token windows
    ],
)
def test_a_short_claims_text_names_the_option(capsys, base_dir, tmp_path, claims, option):
    text = tmp_path / "short.txt"
    text.write_text("to be or not to be that is the question\n")
    run = run_main(
        capsys, "claims", "--model", str(base_dir), "--texts", str(text), "--tokens", "64",
        *claims, "--out", str(tmp_path / "c"),
    )  # fmt: skip
    line = assert_one_line_error(run, "fewer than the")
    assert option in line and "lower " + option.split()[0] in line
    assert not (tmp_path / "c").exists()  # nothing half-written


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--steps", "100000000"), "--steps must be at most 10000000"),
        (("--seq-len", "100000"), "--seq-len must be at most 8192"),
        (("--batch-size", "100000"), "--batch-size must be at most 4096"),
        (("--batch-size", "4096", "--seq-len", "8192"), "tokens a step, over 1048576"),
        (("--nproc", "1000"), "--nproc must be in 1..64"),
    ],
)
def test_train_sizes_past_one_machine_are_one_line(capsys, tmp_path, args, needle):
    run = run_main(capsys, "train", *args, "--out", str(tmp_path / "t"))
    assert_one_line_error(run, needle)
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("claims", "--windows", "1000"), "windows must be at most 100"),
        (("claims", "--grid", "1000"), "grid must be at most 64"),
        (("claims", "--cost-seeds", "1000"), "cost_seeds must be at most 20"),
        (("claims", "--stream-tokens", "100000000"), "stream_tokens must be at most 1048576"),
        (("ablate", "-e", "sensitivity", "--probes", "100000"), "probes must be in 0..256"),
        (("ablate", "-e", "geometry", "--texts", "1000"), "--texts must be in 1..64"),
    ],
)
def test_claims_and_ablate_sizes_past_one_machine_are_one_line(capsys, tmp_path, args, needle):
    run = run_main(capsys, *args, "--out", str(tmp_path / "o"))
    assert_one_line_error(run, needle)
    assert not (tmp_path / "o").exists()
