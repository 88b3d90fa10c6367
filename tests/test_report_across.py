"""``sinklab report --model a,b``: one full report per model and an index page with the claims
across models, written as one output."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import one_line_error, run_main
from sinklab.outputs import MARKER
from sinklab.report.across import folder_name

SIZES = ["--set", "probe_tokens=32", "--set", "q0=4", "--set", "stream_tokens=40",
         "--set", "window=14", "--set", "ablate_tokens=24"]  # fmt: skip


def test_two_models_two_reports_and_an_index(capsys, tmp_path, tiny_model_dir):
    a, b = str(tiny_model_dir("llama")), str(tiny_model_dir("gemma"))
    out = tmp_path / "rep"
    code, stdout, err = run_main(
        capsys, "report", "--quick", "--model", f"{a},{b}", "--stages", "probe",
        *SIZES, "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    assert stdout.strip().endswith("index.html")
    data = json.loads((out / "results.json").read_text())
    assert [m["model"] for m in data["models"]] == [a, b]
    sink_rates = []
    for m in data["models"]:
        sub = json.loads((out / m["folder"] / "results.json").read_text())
        assert sub["summary"] == m["summary"] and sub["stages"]["probe"]["status"] == "ok"
        assert sub["meta"]["model"]["model_type"] == ("llama", "gemma")[len(sink_rates)]
        sink_rates.append(sub["stages"]["probe"]["json"]["sink_mass"])
        assert (out / m["folder"] / "index.html").is_file()
    assert sink_rates[0] != sink_rates[1]  # two different models, not one twice
    # each section's reproduce command writes beside the whole folder (nothing may be written
    # inside an output), and runs as printed
    command = json.loads((out / data["models"][0]["folder"] / "results.json").read_text())
    command = command["stages"]["probe"]["command"]
    target = Path(command[command.index("--out") + 1])
    assert out not in target.parents and target.parent.parent.name == "rep-reproduce"
    code, _, err = run_main(capsys, *command[1:])
    assert code == 0, err
    assert data["claims_table"] is None  # the claims stage did not run
    page = (out / "index.html").read_text()
    assert f'href="{folder_name(a)}/index.html"' in page
    assert json.loads((out / MARKER).read_text())["command"] == "report"


def test_the_index_puts_each_models_claims_stage_side_by_side():
    from types import SimpleNamespace

    from sinklab.report.across import _index_data, _index_page

    def report(effect, verdict):
        row = {"id": "c", "statement": "s", "site": "w", "direction": "above", "threshold": 0.3,
               "effect": effect, "interval": [effect - 0.1, effect + 0.1], "verdict": verdict,
               "n_valid": 3, "n_samples": 3, "reason": "r"}  # fmt: skip
        stage = {"status": "ok", "json": {"claims": [row]}}
        return SimpleNamespace(data={"summary": ["x"], "stages": {"claims": stage}}, seconds=1.0)

    reports = [("m1", report(0.5, "supported")), ("m2", report(0.1, "not supported"))]
    data = _index_data(reports, ["m1", "m2"])
    row = data["claims_table"][0]
    assert (
        row["models"]["m1"]["effect"] == 0.5 and row["models"]["m2"]["verdict"] == "not supported"
    )
    page = _index_page(data, reports, ["m1", "m2"])
    assert "0.5 [0.4, 0.6] supported" in page and "c differs between models" in page


def test_folder_names_and_refusals(capsys, tmp_path):
    assert folder_name("/x/y/tiny-llama0/") == "tiny-llama0" and folder_name("a b") == "a_b"
    code, _, err = run_main(capsys, "report", "--model", "a,,b", "--out", str(tmp_path / "r"))
    one_line_error(code, err, "has an empty name")
