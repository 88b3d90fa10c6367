"""The stream benchmark's worker runs on a tiny model (so the long benchmark cannot rot unseen)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "stream_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("stream_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spec(tmp_path, model_dir, **kw):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([(7 * i) % 200 + 3 for i in range(60)]))
    base = {"model": str(model_dir), "ids": str(ids), "n_sink": 2, "window": 10, "threads": 1}
    return base | kw


@pytest.mark.parametrize("policy", ["sink", "window", "dense", "recompute", "dynamic-cache"])
def test_stream_worker_on_a_tiny_model(bench, tmp_path, tiny_model_dir, policy):
    progress = tmp_path / "progress.json"
    spec = _spec(
        tmp_path,
        tiny_model_dir("llama"),
        kind="stream",
        policy=policy,
        recompute_every=5,
        checkpoints=[20, 40],
        progress=str(progress),
        curve_every=10,
    )
    res = bench.worker(spec)
    assert math.isfinite(res["ppl"]) and res["ppl"] > 1
    if policy == "recompute":
        assert res["n_scored"] == 12 and res["recompute_every"] == 5  # targets 0, 5, ..., 55
        return
    assert res["n_scored"] == 59
    assert res["max_cache_len"] == (59 if policy in ("dense", "dynamic-cache") else 12)
    assert [c["tokens"] for c in res["checkpoints"]] == [20, 40]
    assert [r[0] for r in res["rss_curve"]] == [10, 20, 30, 40, 50]
    saved = json.loads(progress.read_text())
    assert saved["done"] == 40 and saved["checkpoints"] == res["checkpoints"]


def test_sink_and_recompute_compared_on_the_oracle_targets(bench, tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    files = {p: tmp_path / f"nll-{p}.json" for p in ("sink", "recompute")}
    for policy, f in files.items():
        bench.worker(
            _spec(tmp_path, model, kind="stream", policy=policy, recompute_every=7, nll_file=str(f))
        )
    sink, rec = (json.loads(f.read_text()) for f in files.values())
    assert sink["targets"] == list(range(1, 60)) and rec["targets"] == list(range(1, 60, 7))
    cmp = bench.same_targets(files["sink"], files["recompute"])
    want = math.exp(sum(sink["nll"][t - 1] for t in rec["targets"]) / len(rec["targets"]))
    assert cmp["n_targets"] == 9 and cmp["ppl_a"] == pytest.approx(want, rel=1e-12)
    # the first 12 positions fit the cache: there the sink cache and the oracle see the same tokens
    early = [t for t in rec["targets"] if t <= 12]
    for t in early:
        assert sink["nll"][t - 1] == pytest.approx(rec["nll"][rec["targets"].index(t)], abs=1e-4)


def test_block_timeline_ppl_equals_its_tokens_nll(bench, tmp_path, tiny_model_dir):
    """Each block's PPL is exp(mean NLL) of its own targets, recomputed from the NLL file."""
    nll_file = tmp_path / "nll.json"
    spec = _spec(tmp_path, tiny_model_dir("llama"), kind="stream", policy="sink", block=20)
    res = bench.worker(spec | {"nll_file": str(nll_file), "curve_every": 20})
    nll = json.loads(nll_file.read_text())["nll"]
    assert [b[0] for b in res["ms_per_1000"]] == [20, 40]
    for end, ms, _load, ppl in res["ms_per_1000"]:
        assert ppl == pytest.approx(math.exp(sum(nll[end - 20 : end]) / 20), rel=1e-12)
        assert ms > 0
    assert all(peak > 0 and now > 0 for _, peak, now in res["rss_curve"])


def test_stream_worker_sink_equals_its_own_checkpoint_ppl(bench, tmp_path, tiny_model_dir):
    """A checkpoint's PPL is the running PPL over the tokens so far (the same NLLs)."""
    spec = _spec(tmp_path, tiny_model_dir("llama"), kind="stream", policy="sink")
    full = bench.worker(spec | {"checkpoints": [59]})
    assert full["checkpoints"][0]["ppl"] == pytest.approx(full["ppl"], rel=1e-12)


def test_decode_worker_reports_ms_per_token(bench, tmp_path, tiny_model_dir):
    for cache in ("sink", "dynamic-cache"):
        res = bench.worker(
            _spec(tmp_path, tiny_model_dir("llama"), kind="decode", cache=cache, steps=8)
        )
        assert res["ms_per_token"] > 0 and res["cache_len"] == 12


@pytest.mark.parametrize("policy", ["sink", "recompute"])
def test_stream_worker_methods_agree(bench, tmp_path, tiny_model_dir, policy):
    """The worker drives the library's loops: chunked and step give the same per-target NLLs."""
    got = {}
    for method in ("step", "chunked"):
        nll_file = tmp_path / f"nll-{method}.json"
        spec = _spec(tmp_path, tiny_model_dir("llama"), kind="stream", policy=policy,
                     method=method, recompute_every=4, nll_file=str(nll_file))  # fmt: skip
        res = bench.worker(spec)
        assert res["method"] == method
        got[method] = json.loads(nll_file.read_text())
    assert got["step"]["targets"] == got["chunked"]["targets"]
    for a, b in zip(got["step"]["nll"], got["chunked"]["nll"], strict=True):
        assert abs(a - b) <= 2e-4


def test_stream_methods_agreement_on_the_step_prefix():
    spec = importlib.util.spec_from_file_location(
        "stream_methods", BENCH.parent / "stream_methods.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    got = module.agreement([1.0, 2.0, float("nan")], [1.0, 2.5, 3.0, 4.0])
    assert got["n_targets"] == 2 and got["max_abs_dnll"] == 0.5
    assert got["ppl_step"] == pytest.approx(math.exp(1.5))
    assert got["ppl_chunked"] == pytest.approx(math.exp(1.75))


def test_stream_hybrid_runs_on_a_tiny_hybrid(tmp_path, tiny_tokenizer):
    """benchmarks/stream_hybrid.py end to end (one round, a fresh process per method) on a tiny
    Gemma 2 folder: both methods stream the same text and agree to 1e-4."""
    from archs import save_arch_model

    folder = save_arch_model("gemma2", tmp_path / "gemma2", tiny_tokenizer)
    spec = importlib.util.spec_from_file_location(
        "stream_hybrid", BENCH.parent / "stream_hybrid.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "hybrid.json"
    args = ["--model", str(folder), "--tokens", "30", "--n-sink", "2", "--window", "6"]
    result = module.main([*args, "--rounds", "1", "--threads", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["max_abs_dnll"] <= 1e-4
    assert (
        result["median"]["step"]["max_cache_len"]
        == result["median"]["chunked"]["max_cache_len"]
        == 8
    )
    assert result["speedup_chunked_over_step"] > 0


def test_lab_workers_benchmark_trains_a_plan_from_an_empty_cache(tmp_path):
    """benchmarks/lab_workers.py end to end (one arm, one round, the quick plan cut to 10 steps):
    every run of the plan is trained in the arm's fresh process, none reused."""
    spec = importlib.util.spec_from_file_location("lab_workers", BENCH.parent / "lab_workers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    src = Path(__file__).resolve().parents[1] / "src"
    out = tmp_path / "lab.json"
    sizes = ["--steps", "10", "--rounds", "1"]
    result = module.main(["--arm", f"now={src}", *sizes, "--out", str(out)])
    assert json.loads(out.read_text()) == result
    (arm,) = result["rounds"][0].values()
    assert arm["runs"] == arm["trained"] == 12 and arm["workers"] >= 1
    assert 0 < arm["seconds"] <= arm["process_s"]
    assert result["ratio_to_first"] == {"now": 1.0}


def test_serve_prefill_benchmark_on_a_tiny_model(tmp_path, tiny_model_dir):
    """benchmarks/serve_prefill.py end to end (one round, a fresh process per arm) on a tiny
    model: sessions read alone and in one padded batch give the same logits."""
    path = BENCH.parent / "serve_prefill.py"
    spec = importlib.util.spec_from_file_location("serve_prefill", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "prefill.json"
    sizes = ["--sessions", "3", "--history", "20", "--new", "5", "--n-sink", "2", "--window", "10"]
    model = ["--model", str(tiny_model_dir("llama")), "--threads", "1"]
    result = module.main([*model, *sizes, "--rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["max_abs_logit_diff"] <= 1e-4
    assert set(result["median_seconds"]) == {"alone", "together"}
    assert result["together_over_alone"] > 0


DECODE = Path(__file__).resolve().parents[1] / "benchmarks" / "decode.py"


def test_decode_benchmark_runs_every_arm_on_a_tiny_model(tmp_path, tiny_model_dir):
    """benchmarks/decode.py end to end (fresh processes, 1 round) on a tiny model: every arm at
    N = 1 and 8, the summary's ratios computed from its own medians."""
    import subprocess
    import sys

    out = tmp_path / "decode.json"
    cmd = [sys.executable, str(DECODE), "--models", str(tiny_model_dir("llama")), "--rounds", "1"]
    cmd += ["--steps", "4", "--prompt", "20", "--window", "10", "--threads", "1", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    rows = report["summary"][str(tiny_model_dir("llama"))]
    assert set(rows) == {"float32", "int4", "int8", "dynamic-cache"}
    assert rows["int4"]["path"]["quantize"] == "none"  # random weights are not 4-bit: kept
    assert rows["int8"]["path"]["quantize"] == "int8" and rows["int8"]["path"]["int8"]
    for row in rows.values():
        assert row["ms_per_token_n1"] > 0 and row["tokens_per_s_n8"] > 0
        assert len(row["tokens_n1"]) == 5
        want = rows["float32"]["ms_per_token_n1"] / row["ms_per_token_n1"]
        assert row["speedup_n1_vs_float32"] == pytest.approx(want, abs=1e-3)
    assert rows["float32"]["first_token_unlike_float32"] is None
    assert report["machine"]["nproc"] and "flags" in report["machine"]
    assert len(report["runs"]) == 4 and report["load_average_at_end"]


PROBE_PROFILE = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_profile.py"


def test_probe_profile_names_the_ops_that_grow_from_the_forward(tmp_path, tiny_model_dir):
    """benchmarks/probe_profile.py end to end on a tiny model: both runs profiled, the growth
    of each op computed from the two profiles' own numbers, the ratio from their CPU seconds."""
    import subprocess
    import sys

    out = tmp_path / "profile.json"
    cmd = [sys.executable, str(PROBE_PROFILE), "--model", str(tiny_model_dir("llama")),
           "--length", "64", "--threads", "1", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["sdpa"]["top_ops"] and report["probe"]["top_ops"]
    want = report["probe"]["cpu_seconds"] / report["sdpa"]["cpu_seconds"]
    assert report["ratio_cpu"] == pytest.approx(want, abs=1e-3)
    grown = list(report["grew_most"].values())
    assert grown == sorted(grown, reverse=True) and grown[0] > 0
    assert report["machine"]["cpu"] and isinstance(report["machine"]["flags"], list)
