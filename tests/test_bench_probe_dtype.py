"""benchmarks/probe_dtype.py runs on a tiny model (so the benchmark cannot rot unseen): its worker's
sink mass is the probe's, in the dtype asked for, and its diff is the plain one."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from sinklab.corpus import load_text, token_stream
from sinklab.models.loading import load_model
from sinklab.probe import ProbeConfig, probe

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_dtype.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("probe_dtype", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_worker_writes_the_probes_sink_mass(bench, tiny_model_dir, tmp_path):
    folder = str(tiny_model_dir("llama"))
    threads = torch.get_num_threads()  # the worker sets it: keep the suite's
    outs = {}
    for dtype in bench.DTYPES:
        path = tmp_path / f"{dtype}.json"
        res = bench.worker(dtype, 24, folder, threads, 2, path)
        assert res["model_dtype"] == dtype and res["seconds"] > 0 and res["peak_rss_mb"] > 0
        lm = load_model(folder, dtype=dtype)
        ids = token_stream(load_text("shakespeare"), lm.tokenizer, 24)
        want = probe(lm.model, ids, ProbeConfig(q0=2)).sink_mass.double()
        got = torch.tensor(json.loads(path.read_text()), dtype=torch.float64)
        assert torch.equal(got, want)
        assert res["sink_rate"]["0.3"] == float((want > 0.3).double().mean())
        outs[dtype] = want
    diff = bench.mass_diff(tmp_path / "float32.json", tmp_path / "bfloat16.json")
    plain = (outs["bfloat16"] - outs["float32"]).abs()
    assert diff["max_abs"] == pytest.approx(float(plain.max()), abs=1e-15)
    assert diff["mean_abs"] == pytest.approx(float(plain.mean()), abs=1e-15)
    assert 0 < diff["max_abs"] < 0.02 and diff["n_heads"] == plain.numel()


def test_rounds_alternate_and_compare(bench, tiny_model_dir, tmp_path):
    """The driver's bookkeeping, its launcher in this process (the real one spawns one process
    per measurement, which the suite need not pay for)."""
    args = argparse.Namespace(tokens=16, rounds=2, threads=1, q0=2, model=str(tiny_model_dir()))
    threads, order = torch.get_num_threads(), []

    def here(args, dtype, out):
        order.append(dtype)
        return bench.worker(dtype, args.tokens, args.model, threads, args.q0, out)

    res = bench.run(args, tmp_path, launch=here)
    assert order == list(bench.DTYPES) * 2
    fp32 = res["runs"]["float32"]
    assert res["median"]["float32"]["seconds"] == pytest.approx(
        (fp32[0]["seconds"] + fp32[1]["seconds"]) / 2, abs=1e-3
    )
    assert res["bf16_over_fp32"]["seconds"] == round(
        res["median"]["bfloat16"]["seconds"] / res["median"]["float32"]["seconds"], 2
    )
    want = bench.mass_diff(tmp_path / "mass-float32-0.json", tmp_path / "mass-bfloat16-0.json")
    assert res["sink_mass_diff"] == want and 0 < want["max_abs"] < 0.02
    assert res["bf16_rounds_identical"] is True
