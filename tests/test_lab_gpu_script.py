"""benchmarks/lab_gpu.py (the GPU length sweep on text) on its tiny CPU configuration: the
lengths see equal tokens per step, every run's trajectory and convergence are in the JSON.
Untested on a GPU: this checks everything else of it."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "lab_gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("lab_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_uniform_first_mass_is_the_mean_of_one_over_t(bench):
    assert bench.uniform_first_mass(1) == 1.0
    assert bench.uniform_first_mass(4) == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)


def test_the_tiny_sweep_writes_equal_tokens_per_step_and_trajectories(bench, tmp_path):
    import torch

    torch.set_num_threads(1)
    out = tmp_path / "lab_gpu.json"
    assert bench.main(["--tiny", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert [r["config"]["seq_len"] for r in runs] == [16, 32]
    assert [r["tokens_per_step"] for r in runs] == [128, 128]  # constant tokens per step
    assert [r["config"]["batch_size"] for r in runs] == [8, 4]
    for r in runs:
        assert r["config"]["task"] == "text" and r["config"]["data"] == "packed-bos"
        steps = [t["step"] for t in r["trajectory"]]
        assert steps[0] == 0 and steps[-1] == 6
        last = r["trajectory"][-1]
        u = bench.uniform_first_mass(r["config"]["seq_len"])
        assert last["relative_mass"] == pytest.approx(last["first_token_mass"] / u)
        assert isinstance(r["convergence"]["met"], bool) and r["convergence"]["criterion"]
    (cmp,) = data["comparison"]
    want = math.log(
        runs[1]["trajectory"][-1]["relative_mass"] / runs[0]["trajectory"][-1]["relative_mass"]
    )
    assert cmp["lengths"] == [16, 32] and cmp["log_relative_mass_ratio"] == pytest.approx(want)
    assert data["untested_on_gpu"] and data["params"]["tokens_per_step"] == 128


def test_lengths_must_divide_the_tokens_per_step(bench, tmp_path, capsys):
    code = bench.main(["--tiny", "--lengths", "16,24", "--out", str(tmp_path / "x.json")])
    assert code == 2 and "multiple of every length" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_tiny_depth_sweep_compares_the_deepest_with_the_shallowest(bench, tmp_path):
    """``--depths``: the way to decide sinks-grow-depth (docs/claims.md); one length, the layer
    counts differ and nothing else, the effect is the deepest run's first-token mass minus the
    shallowest's."""
    import torch

    torch.set_num_threads(1)
    out = tmp_path / "depth.json"
    assert bench.main(["--tiny", "--depths", "1,2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert [r["config"]["layers"] for r in runs] == [1, 2]
    assert [r["config"]["seq_len"] for r in runs] == [16, 16]  # the shortest length only
    (cmp,) = data["comparison"]
    want = (
        runs[1]["trajectory"][-1]["first_token_mass"]
        - runs[0]["trajectory"][-1]["first_token_mass"]
    )
    assert cmp["depths"] == [1, 2] and cmp["effect"] == pytest.approx(want)
    bad = bench.main(["--tiny", "--depths", "2", "--out", str(tmp_path / "x.json")])
    assert bad == 2
