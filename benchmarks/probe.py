"""Benchmark: ``sinklab probe`` vs eager ``output_attentions=True`` vs a plain SDPA forward.

Each measurement runs in its own fresh process (model load excluded from the timed part, one
forward in fp32), alternating probe / eager / sdpa per round; peak RSS is the process's own
``ru_maxrss``. Eager is skipped where its ``L x H x T^2`` fp32 weights would exceed the memory
limit (reported as skipped). Prints one JSON object.

    python benchmarks/probe.py                       # T = 1024 2048 4096 8192, 3 rounds
    python benchmarks/probe.py --lengths 1024 --rounds 1 --model DIR   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, resource, sys, time, torch
mode, n, threads, model_spec = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
from sinklab.corpus import load_text, token_stream
from sinklab.models.loading import load_model
lm = load_model(None if model_spec == "default" else model_spec)
m = lm.model
ids = token_stream(load_text("shakespeare"), lm.tokenizer, n)
t = time.perf_counter()
with torch.no_grad():
    if mode == "probe":
        from sinklab.probe import ProbeConfig, probe
        probe(m, ids, ProbeConfig(q0=16))
    elif mode == "eager":
        m.set_attn_implementation("eager")
        out = m(ids[None], output_attentions=True, use_cache=False)
    else:
        out = m(ids[None], use_cache=False)
s = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"seconds": s, "rss_gb": rss}))
"""


def run_child(mode: str, n: int, threads: int, model: str, timeout: float) -> dict:
    t = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(n), str(threads), model],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f}s"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"error": tail[0][:200]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_seconds"] = round(time.perf_counter() - t, 2)
    return out


def eager_bytes(n: int, layers: int = 30, heads: int = 9) -> float:
    return 4.0 * layers * heads * n * n * 2  # weights kept for output + one softmax temporary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="default")
    ap.add_argument("--mem-limit-gb", type=float, default=20.0)
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    results: dict = {}
    for n in lengths:
        modes = ["probe", "sdpa"]
        skipped = None
        if eager_bytes(n) / 2**30 < args.mem_limit_gb:
            modes.insert(1, "eager")
        else:
            skipped = f"eager skipped: needs ~{eager_bytes(n) / 2**30:.0f} GiB"
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                runs[mode].append(run_child(mode, n, args.threads, args.model, args.timeout))
        row: dict = {}
        for mode, rs in runs.items():
            ok = [r for r in rs if "seconds" in r]
            row[mode] = {
                "median_seconds": round(statistics.median(r["seconds"] for r in ok), 2)
                if ok
                else None,
                "peak_rss_gb": round(max(r["rss_gb"] for r in ok), 2) if ok else None,
                "runs": rs,
            }
        if row["probe"]["median_seconds"] and row["sdpa"]["median_seconds"]:
            row["probe_over_sdpa"] = round(
                row["probe"]["median_seconds"] / row["sdpa"]["median_seconds"], 2
            )
        if skipped:
            row["eager"] = {"skipped": skipped}
        results[str(n)] = row
        print(
            json.dumps({"progress": n, **{k: v for k, v in row.items() if k != "runs"}}),
            file=sys.stderr,
            flush=True,
        )
    import torch
    import transformers

    print(
        json.dumps(
            {
                "benchmark": "probe",
                "nproc": os.cpu_count(),
                "threads": args.threads,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "params": vars(args),
                "load_average": os.getloadavg(),
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
