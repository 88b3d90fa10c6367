"""The claims' lab runs trained from an empty cache: wall time of ``train_lab_runs`` for a plan,
one source tree against another (e.g. a commit before a change to the worker processes).

Each arm is a fresh process (``python -c`` with ``PYTHONPATH`` set to the arm's ``src``) that
trains the plan into an empty, temporary lab cache with the claims' default workers; arms
alternate A B A B ... for --rounds rounds; medians and the ratio of medians are printed as JSON.

Usage: python benchmarks/lab_workers.py --arm NAME=SRC [--arm NAME=SRC ...] [--plan quick]
       [--rounds 3] [--steps N] [--out FILE.json]
       (SRC: a folder holding the ``sinklab`` package, e.g. ``src`` or a worktree's ``src``)
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sinklab.meta import dumps_json, write_json_atomic

#: what one arm runs in its fresh process: the plan trained into an empty cache, timed inside
ARM = """
import json, sys, time
from dataclasses import replace
from sinklab.claims.lab_runs import LAB_SIZES, train_lab_runs
plan = LAB_SIZES[sys.argv[1]]
if sys.argv[2] != "0":
    plan = replace(plan, steps=int(sys.argv[2]))
t0 = time.perf_counter()
runs, facts = train_lab_runs(plan)
print(json.dumps({"seconds": time.perf_counter() - t0, "runs": len(runs),
                  "trained": facts["trained"], "workers": facts["workers"]}))
"""


def run_arm(src: Path, plan: str, steps: int) -> dict:
    """One arm in a fresh process with an empty lab cache -> its timing (and the process's)."""
    with tempfile.TemporaryDirectory(prefix="lab-workers-") as cache:
        env = {**os.environ, "PYTHONPATH": str(src), "SINKLAB_LAB_CACHE": cache}
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", ARM, plan, str(steps)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        wall = time.perf_counter() - t0
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process_s": round(wall, 2)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", action="append", required=True, help="NAME=SRC")
    p.add_argument("--plan", default="quick")
    p.add_argument("--steps", type=int, default=0, help="override the plan's steps (0: keep)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    arms = dict(a.split("=", 1) for a in args.arm)
    rounds: list[dict] = []
    for r in range(args.rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))  # A B, then B A
        rounds.append({name: run_arm(Path(arms[name]), args.plan, args.steps) for name in order})
    med = {n: statistics.median(r[n]["seconds"] for r in rounds) for n in arms}
    first = next(iter(arms))
    report = {
        "benchmark": "lab_workers",
        "params": {**vars(args), "out": str(args.out) if args.out else None},
        "arms": arms,
        "median_seconds": {n: round(s, 2) for n, s in med.items()},
        "ratio_to_first": {n: round(s / med[first], 3) for n, s in med.items()},
        "rounds": rounds,
        "nproc": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()),
    }
    print(dumps_json(report))
    if args.out:
        write_json_atomic(args.out, report)
    return report


if __name__ == "__main__":
    main()
