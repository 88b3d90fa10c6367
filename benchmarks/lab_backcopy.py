"""Backcopy sweeps (variants, data, length, depth) at the backcopy ``cpu`` preset, one JSON object.

Usage: python benchmarks/lab_backcopy.py --kind variants|data|length|depth [--out DIR]
[--threads 1] [--steps N] [--only NAME,...]. Each kind is one resumable sweep
(``sinklab.lab.sweep.run_sweep``) in ``OUT/KIND``; run the kinds as separate processes to use
several cores. ``--only`` trains just those runs of the sweep (e.g. ``--only gated,sigmoid,relu``
in a second process); the sweep without ``--only`` then reuses them. Every run's wall time,
process CPU time and the load average are recorded (the machine may be shared).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", required=True, choices=["variants", "data", "length", "depth"])
    ap.add_argument("--out", type=Path, default=Path("lab-backcopy-bench"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--only", default=None, help="comma-separated run names of the sweep")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from sinklab.lab.presets import preset
    from sinklab.lab.sweep import run_sweep, sweep_values
    from sinklab.lab.train import train
    from sinklab.meta import versions
    from sinklab.outputs import output_dir

    overrides = {"task": "backcopy", "keep_checkpoints": False}
    if args.steps:
        overrides["steps"] = args.steps
    base = preset(args.preset, **overrides)
    runs: list[dict] = []
    clock = {"t": time.perf_counter(), "cpu": time.process_time()}

    def progress_for(name: str) -> Callable[[float, float, str], None]:
        """Run ``name``'s progress: records its wall and CPU time when it finishes."""
        return lambda step, _steps, _note: finished(name, step)

    def finished(name: str, step: float) -> None:
        if step == base.steps:  # a run finished: its wall and CPU time, the load
            now, cpu = time.perf_counter(), time.process_time()
            runs.append(
                {
                    "name": name,
                    "wall_s": round(now - clock["t"], 1),
                    "cpu_s": round(cpu - clock["cpu"], 1),
                    "loadavg": os.getloadavg(),
                }
            )
            clock.update(t=now, cpu=cpu)

    t0 = time.perf_counter()
    if args.only:
        field, values = sweep_values(args.kind, base.task)
        wanted = dict(values)
        for name in args.only.split(","):
            config = dataclasses.replace(base, **{field: wanted[name]})
            with output_dir(args.out / args.kind / name, "train") as folder:
                train(config, folder, progress=progress_for(name))
        json.dump({"only": args.only, "timing": runs}, sys.stdout, indent=1)
        return 0
    sweep = run_sweep(args.kind, base, args.out / args.kind, progress_for=progress_for)
    report = {
        "kind": args.kind,
        "params": {**vars(args), "out": str(args.out)},
        "base": sweep.to_json()["base"],
        "rows": sweep.rows,
        "timing": runs,
        "versions": versions(),
        "machine": {"nproc": os.cpu_count(), "threads": args.threads},
        "seconds": round(time.perf_counter() - t0, 1),
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    json.dump(report, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
