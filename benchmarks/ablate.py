"""Benchmark ``sinklab ablate`` on SmolLM2: wall time per experiment at T tokens (default 256).

Usage: python benchmarks/ablate.py [--tokens 256] [--experiments a,b] [--model DIR] [--out DIR]
Prints one JSON object: seconds and finding per experiment, nproc, threads, versions, params.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch

from sinklab.ablate import EXPERIMENTS, AblationConfig, run_experiment
from sinklab.corpus import documents, token_stream
from sinklab.meta import attach_meta, versions
from sinklab.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--experiments", default=",".join(EXPERIMENTS))
    ap.add_argument("--model", default=None)
    ap.add_argument("--grid", type=int, default=16)
    ap.add_argument("--probes", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    load_s = time.perf_counter() - t0
    docs = documents()
    config = AblationConfig(grid=args.grid, probes=args.probes)
    report: dict = {
        "model": loaded.info.name,
        "tokens": args.tokens,
        "nproc": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "versions": versions(),
        "params": {"grid": args.grid, "probes": args.probes},
        "load_seconds": round(load_s, 2),
        "load_average_at_start": list(os.getloadavg()),  # > nproc means the times are inflated
        "experiments": {},
    }
    for name in args.experiments.split(","):
        rows = 4 if name == "geometry" else 1
        ids = torch.stack([token_stream(d, loaded.tokenizer, args.tokens) for d in docs[:rows]])
        start = time.perf_counter()
        res = run_experiment(name, loaded.model, loaded.tokenizer, ids, config)
        seconds = time.perf_counter() - start
        attach_meta(res, loaded.info, docs[:rows], res.params(), seconds)
        report["experiments"][name] = {"seconds": round(seconds, 2), "finding": res.finding}
        if args.out is not None:
            res.save(args.out / name)
            res.figure(args.out / name / f"{name}.png")
    report["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
