"""`sinklab cost` and `sinklab train` from the command line."""

from __future__ import annotations

import json

from helpers import assert_one_line_error, run_main


def test_cost_cli_writes_json_and_figure(capsys, tmp_path):
    args = ("--lengths", "8,16", "--task", "sink", "--steps", "20", "--bisections", "1")
    proc = run_main(capsys, "cost", *args, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "cost.json").read_text())
    assert [r["T"] for r in data["rows"]] == [8, 16] and all(r["realised"] for r in data["rows"])
    assert (tmp_path / "cost_loglog.png").is_file() and (tmp_path / "cost_loglog.json").is_file()
    assert {"config", "meta"} <= set(data)  # the result, not overwritten by the figure's numbers
    assert data["config"]["steps"] == 20 and data["config"]["shared"] == 0.0
    assert "realised at every T: True" in proc.stderr
    assert "fro_qk" in data["fits"]["sink"] and "fro_vo" not in data["fits"]["sink"]  # W_VO = 0


def test_train_cli_bad_variant_exits_2_with_one_line(capsys):
    assert_one_line_error(run_main(capsys, "train", "--variant", "relu"), "unknown variant")
