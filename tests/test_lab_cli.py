"""`sinklab cost` and `sinklab train` from the command line."""

from __future__ import annotations

import json

from helpers import assert_one_line_error, run_main
from sinklab.meta import META_KEYS


def test_cost_cli_writes_json_and_figure(capsys, tmp_path):
    args = ("--lengths", "8,16", "--task", "sink", "--steps", "20", "--bisections", "1")
    proc = run_main(capsys, "cost", *args, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "cost.json").read_text())
    assert [r["T"] for r in data["rows"]] == [8, 16] and all(r["realised"] for r in data["rows"])
    assert (tmp_path / "cost_loglog.png").is_file() and (tmp_path / "cost_loglog.json").is_file()
    assert {"config", "meta"} <= set(data)  # the result, not overwritten by the figure's numbers
    assert data["config"]["steps"] == 20 and data["config"]["shared"] == 0.0
    assert "realised at every T" in proc.stdout.splitlines()  # CostResult.summary_lines
    assert "fro_qk" in data["fits"]["sink"] and "fro_vo" not in data["fits"]["sink"]  # W_VO = 0


def test_train_cli_bad_variant_exits_2_with_one_line(capsys):
    assert_one_line_error(run_main(capsys, "train", "--variant", "relu2"), "unknown variant")
    assert_one_line_error(
        run_main(capsys, "train", "--task", "backcopy", "--data", "packed"), "no-bos"
    )


def test_train_cli_backcopy_writes_the_backcopy_metrics(capsys, tmp_path):
    sizes = ("--steps", "3", "--d-model", "32", "--seq-len", "16", "--batch-size", "4")
    proc = run_main(
        capsys, "train", "--task", "backcopy", "--data", "no-bos", *sizes, "-o", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "train.json").read_text())
    assert data["config"]["task"] == "backcopy" and data["config"]["layers"] == 1  # the preset
    bc = data["checkpoints"][-1]["backcopy"]
    keys = {"first_token_mass_nontrigger", "first_token_mass_trigger", "prev_token_mass_trigger"}
    keys |= {"null_mass_nontrigger", "gate_nontrigger", "bos_value_norm", "backcopy_loss"}
    keys |= {"output_norm_nontrigger", "output_norm_trigger"}
    assert keys <= set(bc) and bc["head"] == [0, 0] and bc["gate_nontrigger"] is None
    assert "first-token mass at non-trigger queries" in proc.stdout
    assert tuple(data["meta"]) == META_KEYS and data["meta"]["params"] == data["config"]
    assert data["run"]["triggers"] == [" ", "e", "t"] and data["run"]["processes"] == 1
    assert (tmp_path / "checkpoints" / "step-3" / "tokenizer.json").is_file()
