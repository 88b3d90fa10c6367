"""Lab findings: the variant and data sweeps and the cost experiment, printed as one JSON object.

Usage: python benchmarks/lab.py [--steps N] [--small] [--out DIR] [--skip-cost]
``--small`` is the shrunk CPU configuration the first findings used (2 layers, d_model 64,
seq_len 64, vocab 512, the first 200 scenes); without it the ``cpu`` preset runs as is.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--out", type=Path, default=Path("lab-bench"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-cost", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from sinklab.lab.cost import CostConfig, run_cost
    from sinklab.lab.presets import preset
    from sinklab.lab.sweep import run_sweep
    from sinklab.meta import versions

    small = dict(
        layers=2,
        d_model=64,
        heads=4,
        seq_len=64,
        vocab_size=512,
        warmup=20,
        lr=3e-3,
        n_checkpoints=4,
        eval_windows=48,
        max_docs=200,
    )
    overrides = {**(small if args.small else {}), "keep_checkpoints": False}
    if args.steps:
        overrides["steps"] = args.steps
    base = preset(args.preset, **overrides)
    t0 = time.perf_counter()
    report: dict = {"params": {**vars(args), "out": str(args.out)}, "versions": versions()}
    report["machine"] = {"nproc": os.cpu_count(), "threads": args.threads}
    report["variants"] = run_sweep("variants", base, args.out / "variants").rows
    # the data sweep's run for the base data strategy is the variant sweep's base-variant run
    shared = args.out / "data" / base.data
    if not shared.exists():
        shutil.copytree(args.out / "variants" / base.variant, shared)
    report["data"] = run_sweep("data", base, args.out / "data").rows
    if not args.skip_cost:
        cost = run_cost(CostConfig())
        report["cost"] = {"rows": cost.rows, "fits": cost.fits}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    json.dump(report, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
