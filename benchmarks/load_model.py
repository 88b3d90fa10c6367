"""Load time of the embedded model: first load (GGUF dequantized, cache written) vs cached load.

Each load runs in its own fresh process; rounds alternate first / cached. Prints one JSON object.
Usage: python benchmarks/load_model.py [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import resource, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
t = time.perf_counter()
from sinklab.models.loading import load_model
loaded = load_model()
seconds = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"{seconds} {rss}")
"""


def run(cache: str, threads: int) -> tuple[float, float]:
    env = {**os.environ, "SINKLAB_CACHE": cache, "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(threads)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[-2]), float(out[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    first, cached, rss_first, rss_cached = [], [], [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            s, r = run(cache, args.threads)  # A: GGUF -> dequantize -> write cache
            first.append(s)
            rss_first.append(r)
            s, r = run(cache, args.threads)  # B: read the cached safetensors
            cached.append(s)
            rss_cached.append(r)
    import torch
    import transformers

    result = {
        "benchmark": "load_model",
        "first_load_s": first,
        "cached_load_s": cached,
        "median_first_s": statistics.median(first),
        "median_cached_s": statistics.median(cached),
        "speedup_cached_vs_first": statistics.median(first) / statistics.median(cached),
        "peak_rss_mb_first": statistics.median(rss_first),
        "peak_rss_mb_cached": statistics.median(rss_cached),
        "target": "cached load >= 3x faster than first",
        "rounds": args.rounds,
        "threads": args.threads,
        "nproc": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
