import json
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sinklab.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and needle in lines[0], proc.stderr


def test_help_lists_examples():
    proc = run_cli("--help")
    assert proc.returncode == 0 and "sinklab probe" in proc.stdout


def test_info_json_on_tiny_model(tiny_model_dir):
    proc = run_cli(
        "info",
        "--model",
        str(tiny_model_dir("llama")),
        "--text",
        "shakespeare:hamlet",
        "--format",
        "json",
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["model"]["n_layers"] == 2 and data["text"]["tokens"] > 10_000


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--text", "/no/such/file.txt"], "does not exist"),
        (["--model", "/no/such/model"], "no model folder"),
    ],
)
def test_bad_inputs_exit_2_with_one_line(args, needle):
    assert_one_line_error(run_cli("info", *args), needle)


def test_bad_text_files_exit_2(tmp_path: Path, tiny_model_dir):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\x00\x01\x02\xff")
    for path, needle in ((empty, "empty"), (binary, "binary")):
        assert_one_line_error(run_cli("info", "--text", str(path)), needle)


def test_not_causal_lm_exit_2(bert_dir: Path):
    assert_one_line_error(run_cli("info", "--model", str(bert_dir)), "not a causal language model")
