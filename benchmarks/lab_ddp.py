"""Lab training speed: DDP over 2 processes x 1 thread against 1 process x 2 threads.

Usage: python benchmarks/lab_ddp.py [--steps 50] [--rounds 3] [--preset cpu] [--task text]
       [--arms threads,ddp] (``single``, 1 process x 1 thread, is a reference arm)

Each run is its own fresh process tree, the two arms alternating A B A B ... (docs/benchmarks.md):
``threads``: ``python -m sinklab train`` with ``OMP_NUM_THREADS=2``; ``ddp``: ``torchrun
--standalone --nproc-per-node 2 -m sinklab train`` with ``OMP_NUM_THREADS=1`` (gloo). Both
train the same global batch (the preset's), so their loss curves agree to summation order
(``max_loss_diff``). Tokens/s = ``steps x batch_size x seq_len / run.step_seconds`` (wall time
inside the optimizer steps, rank 0's: no tokenizer, probe or evaluation time). ``cpu_s`` is the
CPU time of the whole process tree (setup included). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
ARMS = {  # arm: (threads per process, command)
    "threads": (2, [sys.executable, "-m", "sinklab", "train"]),
    "ddp": (1, [*TORCHRUN, "2", "-m", "sinklab", "train"]),
    "single": (1, [sys.executable, "-m", "sinklab", "train"]),  # reference: 1 x 1 thread
}


def run_once(arm: str, options: list[str], out: Path) -> dict:
    threads, launcher = ARMS[arm]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(SRC)}
    load = os.getloadavg()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*launcher, *options, "--out", str(out)], env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{arm} run failed:\n{proc.stderr[-2000:]}")
    saved = json.loads((out / "train.json").read_text(encoding="utf-8"))
    c, run = saved["config"], saved["run"]
    tokens = c["steps"] * c["batch_size"] * c["seq_len"]
    return {
        "arm": arm,
        "processes": run["processes"],
        "torch_threads": run["torch_threads"],
        "tokens_per_s": round(tokens / run["step_seconds"], 1),
        "step_seconds": run["step_seconds"],
        "wall_s": round(wall, 2),
        "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2),
        "loadavg_before": [round(x, 2) for x in load],
        "loss": saved["loss"],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--task", default="text")
    ap.add_argument("--arms", default="threads,ddp")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if bad := set(arms) - set(ARMS):
        raise SystemExit(f"unknown arm(s) {sorted(bad)}; use {', '.join(ARMS)}")
    sys.path.insert(0, str(SRC))
    from sinklab.lab.presets import preset
    from sinklab.meta import versions

    config = preset(args.preset, task=args.task, steps=args.steps)
    options = ["--preset", args.preset, "--task", args.task, "--steps", str(args.steps)]
    work = Path(tempfile.mkdtemp(prefix="lab-ddp-"))
    runs: list[dict] = []
    t0 = time.perf_counter()
    try:
        for r in range(args.rounds):
            for arm in arms:
                runs.append(run_once(arm, options, work / f"{arm}-{r}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {
        arm: statistics.median(x["tokens_per_s"] for x in runs if x["arm"] == arm) for arm in arms
    }
    first = [next(x["loss"] for x in runs if x["arm"] == arm) for arm in arms]
    diff = (
        max(abs(a[1] - b[1]) for curve in first[1:] for a, b in zip(first[0], curve, strict=True))
        if len(first) > 1
        else None
    )
    report = {
        "params": vars(args),
        "config": {
            k: getattr(config, k)
            for k in ("task", "layers", "d_model", "heads", "seq_len", "batch_size", "vocab_size")
        },
        "median_tokens_per_s": median,
        "ddp_over_threads": (
            round(median["ddp"] / median["threads"], 3) if {"ddp", "threads"} <= set(arms) else None
        ),
        "max_loss_diff": diff,  # the arms' first runs: same global batch, equal to summation order
        "runs": [{k: v for k, v in x.items() if k != "loss"} for x in runs],
        "versions": versions(),
        "machine": {"nproc": os.cpu_count(), "loadavg_end": list(os.getloadavg())},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    json.dump(report, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
