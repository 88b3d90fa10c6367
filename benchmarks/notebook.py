"""Wall time of examples/quickstart.ipynb (probe, plot, mask the sink, stream, claims on the
embedded SmolLM2), executed top to bottom with nbclient in a fresh kernel: the target is under
2 minutes on 2 idle cores. Each round is its own kernel (a fresh process); the load average seen
is recorded beside the times, since a busy machine stretches them.

Usage: python benchmarks/notebook.py [--rounds 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
TARGET_S = 120.0


def run_once() -> float:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=900, kernel_name="python3").execute(cwd=str(NOTEBOOK.parent))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    seconds, loads = [], []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        seconds.append(round(run_once(), 2))
    from sinklab.meta import versions, write_json_atomic

    result = {
        "benchmark": "notebook",
        "notebook": str(NOTEBOOK.relative_to(ROOT)),
        "seconds": seconds,
        "median_s": statistics.median(seconds),
        "target_s": TARGET_S,
        "meets_target": statistics.median(seconds) < TARGET_S,
        "load_average_1min": loads,
        "nproc": os.cpu_count(),
        "versions": versions(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if args.out is not None:
        write_json_atomic(args.out, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
