"""benchmarks/geometry_density.py's worker runs on a tiny model (so the benchmark cannot rot)."""

import argparse
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "geometry_density.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("geometry_density", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("part", ["geometry", "temperature"])
def test_worker_on_a_tiny_model(bench, tiny_model_dir, part):
    args = argparse.Namespace(
        tokens=16, texts=2, model=str(tiny_model_dir("llama")), threads=1, out=None
    )
    out = bench.worker(part, args)
    assert out["finding"] and out["seconds"] >= 0
    if part == "geometry":
        assert len(out["layers"]) == 2 and "first_token_cosine.attention_input" in out["layers"][0]
        assert len(out["per_text_middle_attention_input"]) == 2
    else:
        assert out["parameter"] == "tau" and "tau=1" in out["conditions"]
        assert set(out["curve_shapes"]) == {"residual", "attention_input"}
