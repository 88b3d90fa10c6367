"""The small-model sink table: every zoo model measured the same way, with 95 % intervals.

Usage: python benchmarks/zoo.py [--models smollm2-135m,gemma3-270m,qwen2.5-0.5b] [--windows 10]
       [--tokens 256] [--density-tokens 256] [--stream-tokens 2000] [--stream-windows 10]
       [--n-sink 4] [--window 252] [--arms sinks,probe,density,stream] [--threads 1]
       [--parallel] [--out FILE] [--markdown FILE ...]

--models takes NAME or NAME=FOLDER (a folder holding that model, e.g. its dequantized zoo copy).

Per model, over ``--windows`` consecutive windows of the Shakespeare plays (each starting the way
the model's tokenizer starts a sequence, docs/models.md), each arm in its own fresh process:

* ``sinks``: the ``gu`` and ``barbero`` sink rates (docs/metrics.md#protocols) on each window's
  first 64 tokens;
* ``probe``: sinklab's probe at ``--tokens`` (q0 0, eps 0.3): sink rate, first layer with a sink
  head, value-norm ratio and output share of the sink heads (as ``sinklab claims`` computes them),
  massive-activation ratio (the largest ``first_token_norm_ratio`` over layers) and the
  first-token cosine at the three sites (mean over the middle third of the layers);
* ``density``: the density effect of ``sinklab claims`` (``density-oversmooths``) at
  ``--density-tokens``;
* ``stream``: streaming perplexity, window vs sink (``--n-sink`` + ``--window``) over
  ``--stream-tokens`` of each of ``--stream-windows`` windows (``sinklab stream --method auto``).

Every number is a mean over windows with its seeded percentile-bootstrap 95 % interval
(sinklab.claims.rules, the rule's interval). The parent prints one JSON object (and writes it to
``--out``): per model and arm the per-window values, means, intervals and seconds, plus threads,
load average and versions. ``--markdown FILE`` renders a written JSON as docs/models.md's table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ARMS = ("sinks", "probe", "density", "stream")
MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-0.5b")
SITES = ("residual", "attention_input", "key")


def _interval(values: list[float | None]) -> dict[str, Any]:
    """Mean and 95 % bootstrap interval of the finite values (None when there are none)."""
    from sinklab.claims.rules import bootstrap_interval, valid_samples

    xs = valid_samples(values)
    if not xs:
        return {"mean": None, "ci95": None, "n": 0}
    iv = bootstrap_interval(xs, seed=0)
    return {"mean": iv.mean, "ci95": [iv.low, iv.high], "n": iv.n}


def _windows(tokenizer: Any, n_tokens: int, n: int):
    """``n`` consecutive windows of the plays, (n, n_tokens), each started as the tokenizer does."""
    from sinklab.corpus import load_text
    from sinklab.probe.protocols import sample_windows

    return sample_windows(load_text("shakespeare"), tokenizer, n_tokens, n)


def _summary(per_window: dict[str, list[float | None]]) -> dict[str, Any]:
    return {k: {"per_window": v, **_interval(v)} for k, v in per_window.items()}


def arm_sinks(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    from sinklab.probe.protocols import PROTOCOLS, protocol_result, sample_alphas

    ids = _windows(loaded.tokenizer, PROTOCOLS["gu"].tokens, args.windows)
    alpha = sample_alphas(loaded.model, ids)
    per = {name: protocol_result(alpha, p).by_sample for name, p in PROTOCOLS.items()}
    return {"tokens": int(ids.shape[1]), "first_token": int(ids[0, 0]), **_summary(per)}


def arm_probe(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    from sinklab.claims.effects import first_token_cosine_effect
    from sinklab.claims.measure_model import sink_head_numbers
    from sinklab.probe import ProbeConfig, probe

    eps = 0.3
    ids = _windows(loaded.tokenizer, args.tokens, args.windows)
    per: dict[str, list[float | None]] = {
        k: []
        for k in (
            "sink_rate",
            "first_sink_layer",
            "value_norm_ratio",
            "output_share",
            "massive_activation_ratio",
            *(f"first_token_cosine.{s}" for s in SITES),
        )
    }
    for row in ids:
        res = probe(loaded.model, row, ProbeConfig(q0=0, eps=(eps,)))
        heads = sink_head_numbers(res, eps)
        layers = (res.sink_mass > eps).any(dim=1).nonzero()
        per["sink_rate"].append(heads["rate"])
        per["first_sink_layer"].append(float(layers[0, 0]) if layers.numel() else None)
        per["value_norm_ratio"].append(heads["value_ratio"])
        per["output_share"].append(heads["output_share"])
        ratios = [x for x in res.first_token_norm_ratio if math.isfinite(x)]
        per["massive_activation_ratio"].append(max(ratios) if ratios else None)
        for site in SITES:
            cos = res.geometry.series("first_token_cosine", site) if res.geometry else []
            per[f"first_token_cosine.{site}"].append(first_token_cosine_effect(cos))
    return {"tokens": args.tokens, "q0": 0, "eps": eps, **_summary(per)}


def arm_density(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    from sinklab.claims.measure_model import measure_density

    ids = _windows(loaded.tokenizer, args.density_tokens, args.windows)
    cfg = SimpleNamespace(density_lam=0.5, probe_tokens=args.density_tokens)
    samples = [(f"w{k}", row) for k, row in enumerate(ids)]
    m = measure_density(loaded.model, samples, cfg, lambda _: None)["density-oversmooths"]
    return {"sizes": m.sizes, **_summary({"density_effect": m.effects()})}


def arm_stream(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    from sinklab.claims.measure_model import measure_stream

    ids = _windows(loaded.tokenizer, args.stream_tokens, args.stream_windows)
    cfg = SimpleNamespace(stream_tokens=args.stream_tokens, n_sink=args.n_sink, window=args.window)
    samples = [(f"w{k}", row) for k, row in enumerate(ids)]
    m = measure_stream(loaded.model, samples, cfg, lambda _: None)["evict-sinks-collapse"]
    per = {
        "ppl_window": [s["ppl_window"] for s in m.samples],
        "ppl_sink": [s["ppl_sink"] for s in m.samples],
        "nll_window_minus_sink": m.effects(),
    }
    return {"sizes": m.sizes, "not_measured": m.not_measured, **_summary(per)}


def worker(model: str, arm: str, args: argparse.Namespace) -> dict[str, Any]:
    """One arm of one model in this process."""
    import resource

    import torch

    from sinklab.lab import register
    from sinklab.models.loading import load_model

    torch.set_num_threads(args.threads)
    register()
    t0 = time.perf_counter()
    loaded = load_model(model)
    load_s = time.perf_counter() - t0
    start = time.perf_counter()
    with torch.no_grad():
        out = {"sinks": arm_sinks, "probe": arm_probe, "density": arm_density}.get(arm, arm_stream)(
            loaded, args
        )
    return {
        **out,
        "model": loaded.info.to_json(),
        "seconds": round(time.perf_counter() - start, 1),
        "load_seconds": round(load_s, 1),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def _run_model(
    model: str, args: argparse.Namespace, arms: list[str], results: dict[str, Any], save: Any
) -> dict[str, Any]:
    """Each arm of ``model`` in a fresh process, into ``results``; ``save()`` after each arm, so
    an arm that outlives the session leaves the others written."""
    for arm in arms:
        cmd = [sys.executable, __file__, "--worker", f"{model}@{arm}", *_sizes(args)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode:
            results[arm] = {"error": proc.stderr.strip().splitlines()[-1:]}
        else:
            results[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{model} {arm}: {results[arm].get('seconds', 'error')}", file=sys.stderr)
        save()
    return results


def _sizes(args: argparse.Namespace) -> list[str]:
    keys = ("windows", "tokens", "density_tokens", "stream_tokens", "stream_windows")
    out = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    return [*out, f"--n-sink={args.n_sink}", f"--window={args.window}", f"--threads={args.threads}"]


def _fmt(entry: dict[str, Any] | None, digits: int = 3) -> str:
    if not entry or entry.get("mean") is None:
        return "-"
    lo, hi = entry["ci95"]
    return f"{entry['mean']:.{digits}g} [{lo:.{digits}g}, {hi:.{digits}g}]"


ROWS = (  # (label, arm, key)
    ("sink rate, gu (eps 0.3, 64 tokens), %", "sinks", "gu"),
    ("sink rate, barbero (eps 0.8, 64 tokens), %", "sinks", "barbero"),
    ("sink rate at 256 tokens (q0 0, eps 0.3)", "probe", "sink_rate"),
    ("first layer with a sink head", "probe", "first_sink_layer"),
    ("value-norm ratio of sink heads", "probe", "value_norm_ratio"),
    ("output share of sink heads (per unit of sink mass)", "probe", "output_share"),
    ("massive-activation ratio (max over layers)", "probe", "massive_activation_ratio"),
    ("first-token cosine, residual (middle third)", "probe", "first_token_cosine.residual"),
    ("first-token cosine, attention input", "probe", "first_token_cosine.attention_input"),
    ("first-token cosine, keys", "probe", "first_token_cosine.key"),
    ("density effect (similarity, mix 0.5 - unmodified)", "density", "density_effect"),
    ("streaming ppl, window (no sinks)", "stream", "ppl_window"),
    ("streaming ppl, 4 sinks + window", "stream", "ppl_sink"),
)


def merged(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs (e.g. one per model, or the stream arm apart) as one report: each model's
    arms from whichever run measured them (a later run wins)."""
    models: dict[str, dict[str, Any]] = {}
    arms: list[str] = []
    for rep in reports:
        arms += [a for a in rep["arms"] if a not in arms]
        for name, res in rep["models"].items():
            models.setdefault(name, {}).update(res)
    return {"arms": [a for a in ARMS if a in arms], "models": models}


def markdown(report: dict[str, Any]) -> str:
    """The table of docs/models.md: one row per number, one column per model."""
    models = list(report["models"])
    lines = ["| | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for label, arm, key in ROWS:
        cells = [_fmt(report["models"][m].get(arm, {}).get(key)) for m in models]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    secs = [
        " + ".join(str(report["models"][m].get(a, {}).get("seconds", "-")) for a in report["arms"])
        for m in models
    ]
    lines.append(
        "| seconds per arm (" + ", ".join(report["arms"]) + ") | " + " | ".join(secs) + " |"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--windows", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--density-tokens", type=int, default=256)
    ap.add_argument("--stream-tokens", type=int, default=2000)
    ap.add_argument("--stream-windows", type=int, default=10)
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=252)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parallel", action="store_true", help="one process per model at once")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--markdown", type=Path, nargs="+", default=None, help="render written JSON file(s)"
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.markdown:
        print(markdown(merged([json.loads(f.read_text()) for f in args.markdown])))
        return
    if args.worker:
        model, arm = args.worker.rsplit("@", 1)
        print(json.dumps(worker(model, arm, args)))
        return
    arms = args.arms.split(",")
    if bad := [a for a in arms if a not in ARMS]:
        sys.exit(f"unknown arm(s) {bad}; use: {', '.join(ARMS)}")
    from concurrent.futures import ThreadPoolExecutor

    from sinklab.meta import versions, write_json_atomic

    # NAME or NAME=WHERE (a folder holding that model's weights, e.g. its dequantized cache)
    specs = dict(m.split("=", 1) if "=" in m else (m, m) for m in args.models.split(","))
    models = list(specs)
    report: dict[str, Any] = {
        "text": "shakespeare (embedded Gutenberg plays), consecutive windows",
        "arms": arms,
        "params": {k: v for k, v in vars(args).items() if k not in ("out", "markdown", "worker")},
        "nproc": os.cpu_count(),
        "versions": versions(),
        "load_average_at_start": list(os.getloadavg()),  # > nproc: times are inflated
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    report["loaded_from"] = specs
    report["models"] = {m: {} for m in models}
    lock = threading.Lock()

    def save() -> None:
        with lock:
            report["load_average_at_end"] = list(os.getloadavg())
            if args.out is not None:
                write_json_atomic(args.out, report)

    with ThreadPoolExecutor(len(models) if args.parallel else 1) as pool:
        list(
            pool.map(lambda m: _run_model(specs[m], args, arms, report["models"][m], save), models)
        )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
