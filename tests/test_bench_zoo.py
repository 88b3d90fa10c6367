"""benchmarks/zoo.py's arms run on a tiny model (so the benchmark cannot rot), and its table
renders the written JSON."""

import argparse
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("zoo_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_arm_on_a_tiny_model(bench, tiny_model_dir):
    args = argparse.Namespace(
        windows=3, tokens=24, density_tokens=24, stream_tokens=40, stream_windows=3,
        n_sink=2, window=14, threads=1,
    )  # fmt: skip
    model = str(tiny_model_dir("llama"))
    report = {"arms": list(bench.ARMS), "models": {"tiny": {}}}
    for arm in bench.ARMS:
        out = bench.worker(model, arm, args)
        assert out["seconds"] >= 0 and out["model"]["n_layers"] == 2
        report["models"]["tiny"][arm] = out
    sinks, probe = report["models"]["tiny"]["sinks"], report["models"]["tiny"]["probe"]
    assert len(sinks["gu"]["per_window"]) == 3 and sinks["tokens"] == 64
    gu = sinks["gu"]
    assert gu["mean"] == pytest.approx(sum(gu["per_window"]) / 3)
    assert gu["ci95"][0] <= gu["mean"] <= gu["ci95"][1]
    assert sinks["barbero"]["mean"] <= gu["mean"]  # a stricter threshold
    assert len(probe["first_token_cosine.key"]["per_window"]) == 3
    assert probe["first_token_cosine.key"]["mean"] is not None
    stream = report["models"]["tiny"]["stream"]
    assert stream["ppl_sink"]["n"] == 3 and stream["sizes"]["first_scored_position"] == 16
    table = bench.markdown(bench.merged([report]))
    assert table.count("\n") == len(bench.ROWS) + 2 and f"{gu['mean']:.3g}" in table
