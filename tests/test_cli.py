"""The CLI's entry point: ``info`` and user errors in process (``sinklab.cli.main``), and two
end-to-end runs as a real ``python -m sinklab.cli`` process (help; a one-line error, exit 2)."""

import json
from pathlib import Path

import pytest

from helpers import assert_one_line_error, run_main, run_process


def test_help_lists_examples():
    proc = run_process("--help")
    assert proc.returncode == 0 and "sinklab probe" in proc.stdout


def test_not_causal_lm_exit_2(bert_dir: Path):
    """End to end: a real process prints one line and exits 2."""
    proc = run_process("info", "--model", str(bert_dir))
    assert_one_line_error(proc, "not a causal language model")


def test_info_json_on_tiny_model(capsys, tiny_model_dir):
    proc = run_main(
        capsys,
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
def test_bad_inputs_exit_2_with_one_line(capsys, args, needle):
    assert_one_line_error(run_main(capsys, "info", *args), needle)


def test_bad_text_files_exit_2(capsys, tmp_path: Path, tiny_model_dir):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\x00\x01\x02\xff")
    for path, needle in ((empty, "empty"), (binary, "binary")):
        assert_one_line_error(run_main(capsys, "info", "--text", str(path)), needle)
