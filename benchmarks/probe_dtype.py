"""Benchmark: the probe in float32 vs bfloat16 on the CPU (``--dtype`` on every command).

Each measurement is a fresh process (``--worker``) that loads the model in one dtype (the load is
not timed), probes ``T`` tokens of the embedded plays once, and reports the probe's wall and CPU
seconds, the resident set before the probe and the process's peak (``ru_maxrss``), and writes
its per-head sink mass (float64, ``q0``) to a file. Rounds alternate float32 / bfloat16; figures
are medians over rounds, the comparison their ratio, and the numbers' agreement the largest
``|sink mass (bf16) - sink mass (fp32)|`` over every layer and head (plus the sink rate at
eps 0.3 and 0.8 in each dtype). Prints one JSON object.

    python benchmarks/probe_dtype.py                          # SmolLM2, T = 2048, 3 rounds
    python benchmarks/probe_dtype.py --tokens 256 --rounds 1 --model DIR   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16")
EPS = (0.3, 0.8)


def worker(dtype: str, tokens: int, model: str | None, threads: int, q0: int, out: Path) -> dict:
    """One probe in ``dtype`` (this process): timings, memory, sink rates; sink mass -> ``out``."""
    import torch

    torch.set_num_threads(threads)
    from sinklab.corpus import load_text, token_stream
    from sinklab.memory import rss_mb
    from sinklab.models.loading import load_model
    from sinklab.probe import ProbeConfig, probe

    t = time.perf_counter()
    lm = load_model(model, dtype=dtype)
    load_s = time.perf_counter() - t
    ids = token_stream(load_text("shakespeare"), lm.tokenizer, tokens)
    before = rss_mb()
    wall, cpu = time.perf_counter(), time.process_time()
    res = probe(lm.model, ids, ProbeConfig(q0=q0))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    mass = res.sink_mass.double()  # (L, H)
    out.write_text(json.dumps(mass.tolist()))
    return {
        "dtype": dtype,
        "model_dtype": lm.info.dtype,
        "seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "load_seconds": round(load_s, 2),
        "rss_before_probe_mb": round(before, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "sink_rate": {str(e): float((mass > e).double().mean()) for e in EPS},
        "mean_sink_mass": float(mass.mean()),
        "load_average": list(os.getloadavg()),
    }


def mass_diff(a: Path, b: Path) -> dict[str, float]:
    """Largest and mean ``|b - a|`` of two saved (L, H) sink-mass tables."""
    x, y = (json.loads(p.read_text()) for p in (a, b))
    diffs = [abs(v - u) for ra, rb in zip(x, y, strict=True) for u, v in zip(ra, rb, strict=True)]
    return {"max_abs": max(diffs), "mean_abs": sum(diffs) / len(diffs), "n_heads": len(diffs)}


def _median(rows: list[dict], key: str) -> float | None:
    ok = [r[key] for r in rows if key in r]
    return round(statistics.median(ok), 3) if ok else None


def launch(args: argparse.Namespace, dtype: str, out: Path) -> dict:
    """One worker in a fresh process -> its JSON (or ``{"error": last stderr line}``)."""
    cmd = [sys.executable, __file__, "--worker", dtype, "--tokens", str(args.tokens)]
    cmd += ["--threads", str(args.threads), "--q0", str(args.q0), "--mass", str(out)]
    cmd += ["--model", args.model] if args.model else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"error": tail[0][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(
    args: argparse.Namespace, folder: Path, launch: Callable[..., dict] = launch
) -> dict[str, Any]:
    """float32 / bfloat16 alternating for ``args.rounds`` rounds, each a ``launch`` (a fresh
    process); medians, ratios, the sink-mass diff of the first complete round."""
    runs: dict[str, list[dict]] = {d: [] for d in DTYPES}
    for r in range(args.rounds):
        for dtype in DTYPES:
            runs[dtype].append(launch(args, dtype, folder / f"mass-{dtype}-{r}.json"))
            print(json.dumps({"progress": [r, dtype], **runs[dtype][-1]}), file=sys.stderr)
    medians = {
        d: {k: _median(rs, k) for k in ("seconds", "cpu_seconds", "rss_before_probe_mb")}
        | {"peak_rss_mb": max((x["peak_rss_mb"] for x in rs if "peak_rss_mb" in x), default=None)}
        for d, rs in runs.items()
    }
    result: dict[str, Any] = {"median": medians, "runs": runs}
    fp32, bf16 = (medians[d] for d in DTYPES)
    if fp32["seconds"] and bf16["seconds"]:
        result["bf16_over_fp32"] = {
            k: round(bf16[k] / fp32[k], 2) for k in ("seconds", "cpu_seconds") if fp32[k]
        }
    ok = [r for r in range(args.rounds) if all("seconds" in runs[d][r] for d in DTYPES)]
    if ok:
        a, b = (folder / f"mass-{d}-{ok[0]}.json" for d in DTYPES)
        result["sink_mass_diff"] = mass_diff(a, b)
        first = folder / f"mass-bfloat16-{ok[0]}.json"
        same = [mass_diff(first, folder / f"mass-bfloat16-{r}.json") for r in ok[1:]]
        result["bf16_rounds_identical"] = all(s["max_abs"] == 0 for s in same)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--q0", type=int, default=16)
    ap.add_argument("--model", default=None, help="a model folder (default: embedded SmolLM2)")
    ap.add_argument("--worker", choices=DTYPES, help=argparse.SUPPRESS)
    ap.add_argument("--mass", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        assert args.mass is not None
        res = worker(args.worker, args.tokens, args.model, args.threads, args.q0, args.mass)
        print(json.dumps(res))
        return
    import torch

    from sinklab.meta import versions

    report: dict[str, Any] = {
        "benchmark": "probe_dtype",
        "model": args.model or "SmolLM2-135M-Instruct (embedded GGUF, dequantized to float32)",
        "text": "shakespeare (embedded Gutenberg plays)",
        "site": "attention weights (probe): sink mass per layer and head, q0 as given",
        "nproc": os.cpu_count(),
        "threads": args.threads,
        "torch": torch.__version__,
        "versions": versions(),
        "params": {k: v for k, v in vars(args).items() if k not in ("worker", "mass")},
        "load_average_at_start": list(os.getloadavg()),  # > nproc: wall times are inflated
    }
    with tempfile.TemporaryDirectory() as folder:
        report |= run(args, Path(folder))
    report["load_average_at_end"] = list(os.getloadavg())
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
