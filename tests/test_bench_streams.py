"""The many-streams and drift benchmarks run on a tiny model (so they cannot rot unseen)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stream_many_child_on_a_tiny_model(tiny_model_dir):
    bench = _load("stream_many")
    out = bench.child(3, steps=4, n_sink=2, window=10, threads=1, model=str(tiny_model_dir()))
    assert out["b"] == 3 and len(out["step_s"]) == 4 and out["kept"] == 12
    assert all(s > 0 for s in out["step_s"]) and len(out["cpu_s"]) == 4


def test_drift_rows_on_a_tiny_model(tiny_model_factory):
    bench = _load("positions_drift")
    model = tiny_model_factory("llama", seed=2)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(0))
    rows = bench.drift(model, ids, [0, 0, 100])
    assert rows[0]["max_abs_dlogp_vocab"] == 0 and rows[1]["max_abs_dlogp_vocab"] == 0
    assert rows[0]["ppl"] == pytest.approx(rows[1]["ppl"])
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].double()
    nll = torch.logsumexp(logits, -1) - logits.gather(-1, ids[1:, None])[:, 0]
    assert rows[0]["ppl"] == pytest.approx(float(torch.exp(nll.mean())), rel=1e-4)
