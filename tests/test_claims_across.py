"""``sinklab claims --model a,b``: each model's claims run on their own and are joined into one
claim x model table and figure; each model's column equals that model's own single run."""

from __future__ import annotations

import json

import pytest

from helpers import one_line_error, run_main
from sinklab.claims.across import across_table, cell_text, differences, model_names

FAST = ["--tokens", "32", "--stream-tokens", "40", "--window", "14", "--n-sink", "2"]
SOME = "first-token-sinks,evict-sinks-collapse,first-token-cosine"


@pytest.fixture
def one_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_two_models_one_table(capsys, tmp_path, tiny_model_dir, one_thread):
    a, b = str(tiny_model_dir("llama")), str(tiny_model_dir("qwen2"))
    out = tmp_path / "across"
    args = ["claims", "--claims", SOME, *FAST]
    code, stdout, err = run_main(
        capsys, *args, "--model", f"{a},{b}", "--format", "json", "--out", str(out)
    )
    assert code == 0, err
    data = json.loads(stdout)
    assert data["models"] == [a, b] and [r["model"] for r in data["runs"]] == [a, b]
    assert [r["id"] for r in data["table"]] == SOME.split(",")
    assert [m["n_layers"] for m in data["meta"]["model"]] == [2, 2]
    for name in (a, b):  # each column is that model's own run, alone
        code, single, err = run_main(capsys, *args, "--model", name, "--format", "json")
        assert code == 0, err
        for row in json.loads(single)["claims"]:
            cell = next(r for r in data["table"] if r["id"] == row["id"])["models"][name]
            assert cell["effect"] == pytest.approx(row["effect"], abs=1e-9)
            assert cell["interval"] == pytest.approx(row["interval"], abs=1e-9)
            assert cell["verdict"] == row["verdict"]
    saved = json.loads((out / "claims.json").read_text())
    assert saved["table"] == data["table"]
    points = json.loads((out / "claims_models.json").read_text())["points"]
    assert sorted({p["model"] for p in points}) == sorted([a, b]) and len(points) == 6
    assert (out / "claims_models.png").stat().st_size > 1000
    code, stdout, err = run_main(capsys, *args, "--model", f"{a},{b}")  # text: the table
    assert code == 0, err
    first = data["table"][0]
    line = next(ln for ln in stdout.splitlines() if first["id"] in ln)
    assert cell_text(first["models"][a]).split(" [")[0] in line


def test_table_rows_and_differences():
    def run(effect, verdict):
        row = {"id": "c", "statement": "s", "site": "w", "direction": "above", "threshold": 0.3,
               "effect": effect, "interval": [effect - 0.1, effect + 0.1], "verdict": verdict,
               "n_valid": 3, "n_samples": 3, "reason": "r"}  # fmt: skip
        return {"claims": [row]}

    table = across_table([("m1", run(0.5, "supported")), ("m2", run(0.1, "not supported"))])
    assert table[0]["claimed"] == "> 0.3" and not table[0]["agree"]
    assert cell_text(table[0]["models"]["m1"]) == "0.5 [0.4, 0.6] supported"
    assert differences(table, ["m1", "m2"]) == [
        "c differs between models (m1: supported; m2: not supported)"
    ]
    same = across_table([("m1", run(0.5, "supported")), ("m2", run(0.6, "supported"))])
    assert same[0]["agree"] and differences(same, ["m1", "m2"]) == []


def test_model_lists(capsys):
    assert model_names(None) is None and model_names("smollm2-135m") is None
    assert model_names("a, b") == ["a", "b"]
    code, _, err = run_main(capsys, "claims", "--model", "a,,b")
    one_line_error(code, err, "has an empty name")
    code, _, err = run_main(capsys, "claims", "--model", "a,b,a")
    one_line_error(code, err, "names a more than once")
    code, _, err = run_main(capsys, "claims", "--model", "a,b", "--claims", "sink-cheaper")
    one_line_error(code, err, "read none; pass one model")
