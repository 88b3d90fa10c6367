"""benchmarks/probe.py runs on a tiny model (so the benchmark cannot rot unseen): each arm's
worker measures, the probe arms say which path each layer took, and the summary's ratios are the
medians' ratios."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "probe.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("probe_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_arm_runs_and_reports_its_path(bench, tiny_model_dir):
    folder = str(tiny_model_dir("llama"))
    threads = torch.get_num_threads()  # the worker sets it: keep the suite's
    arms = ("probe", "fast", "sdpa", "block")
    got = {arm: bench.worker(arm, 32, folder, threads) for arm in arms}
    for res in got.values():
        assert res["seconds"] > 0 and res["cpu_seconds"] > 0 and res["rss_gb"] > 0
    assert got["probe"]["paths"] == {"fused": 2} and got["fast"]["paths"] == {"fused": 2}
    assert list(got["block"]["paths"]) == [
        "block: AttentionHandler reads or changes the weights block by block"
    ]
    assert "paths" not in got["sdpa"]


def test_summary_ratios_are_the_medians_ratios(bench):
    run = {"rss_gb": 1.0}
    runs = {
        "sdpa": [{**run, "seconds": s, "cpu_seconds": s} for s in (1.0, 2.0, 9.0)],
        "probe": [{**run, "seconds": s, "cpu_seconds": s, "rss_gb": 1.5} for s in (3.0, 3.0, 1.0)],
    }
    row = bench.summarise(runs)
    assert row["sdpa"]["median_seconds"] == 2.0 and row["probe"]["median_seconds"] == 3.0
    assert row["probe_over_sdpa"] == {
        "median_seconds": 1.5, "median_cpu_seconds": 1.5, "peak_rss_gb": 1.5
    }  # fmt: skip
