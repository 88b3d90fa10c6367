"""The GPU lab: the length sweep (and, with ``--depths``, the depth sweep) on natural text at
constant tokens per step, one JSON file.

Usage (one call of a lent GPU; about 10 minutes on one modern GPU, untested on a GPU so far):

    python benchmarks/lab_gpu.py --out $OUT/lab_gpu.json
    python benchmarks/lab_gpu.py --depths 2,4,8 --lengths 512 --out $OUT/lab_gpu_depth.json
    python benchmarks/lab_gpu.py --tiny --out lab_gpu.json      # the CPU smoke run the tests use

``--depths`` is the way to decide ``sinks-grow-depth`` (docs/claims.md: no CPU-scale set-up can:
backcopy needs one switching head at any depth, and 1-, 2- and 4-layer backcopy models grow
exactly one sink head, in layer 0): the ``gpu`` preset at each number of layers, the shortest
of ``--lengths``, everything else equal; ``comparison_depth`` holds per seed the claim's effect,
the mean first-token sink mass of the deepest run minus the shallowest's, beside the sink rates.

Each length of ``--lengths`` trains the ``gpu`` preset of the ``text`` task (8 layers x 8 heads,
``d_model`` 512, the plays with BOS-prefixed documents packed, ``packed-bos``) with the batch cut
so that every length sees ``--tokens-per-step`` tokens per step (Barbero et al.'s protocol: only
the context changes). Every checkpoint (log-spaced plus the last 20 % of training,
docs/claims.md#lab-validity) records the sink rate (eps 0.3, all heads) and the mean first-token
mass, also relative to uniform attention's (``H_T / T`` over the probed queries); the JSON holds
each run's trajectory and whether it met the convergence criterion (read-out settled, loss
flattened). The file is rewritten after every run, so a call cut short keeps the runs it finished.
What it would add: whether sinks grow with the training context on text, where sinks emerge
(Gu et al. 2025 see them after 1-2k steps of a 60M model on 2,048-token sequences); the CPU lab
only has the backcopy proxy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

TINY = dict(  # a CPU smoke configuration: seconds, no emergence expected
    layers=1,
    d_model=32,
    heads=2,
    vocab_size=512,
    max_docs=24,
    warmup=2,
    eval_windows=4,
    n_checkpoints=3,
    device="cpu",
)


def uniform_first_mass(n: int) -> float:
    """Mean over queries ``t = 0..n-1`` of ``1 / (t + 1)``: uniform causal attention's mass on
    the first token, averaged as the probe averages (q0 = 0)."""
    return sum(1.0 / (t + 1) for t in range(n)) / n


def run_row(result: Any) -> dict[str, Any]:
    """One run: its config, trajectory (step, sink rate, mass, relative mass), convergence,
    validation and seconds."""
    n = int(result.run["probe"]["n_tokens"])
    u = uniform_first_mass(n)
    traj = [
        {
            "step": c["step"],
            "sink_rate": c["sink_rate"].get("0.3"),
            "first_token_mass": c["first_token_sink_mass"],
            "relative_mass": c["first_token_sink_mass"] / u,
        }
        for c in result.checkpoints
    ]
    conv = result.convergence
    return {
        "config": asdict(result.config),
        "tokens_per_step": result.config.seq_len * result.config.batch_size,
        "uniform_first_mass": u,
        "trajectory": traj,
        "convergence": {k: v for k, v in conv.items() if k != "checks"},
        "final_loss": result.loss[-1][1] if result.loss else None,
        "val": result.val,
        "seconds": result.meta.get("seconds"),
        "step_seconds": result.run.get("step_seconds"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default=None, help="comma-separated T (gpu: 512,2048)")
    ap.add_argument("--tokens-per-step", type=int, default=None, help="gpu: 32768")
    ap.add_argument("--steps", type=int, default=None, help="gpu: 2000")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument(
        "--depths", default=None, help="comma-separated layer counts: the depth sweep instead"
    )
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke configuration")
    ap.add_argument("--out", type=Path, default=Path("lab_gpu.json"))
    args = ap.parse_args(argv)

    from sinklab.lab.presets import preset
    from sinklab.lab.train import train
    from sinklab.meta import versions, write_json_atomic

    if args.tiny:
        lengths, tokens, steps, base = (16, 32), 128, 6, dict(TINY)
    else:
        lengths, tokens, steps, base = (512, 2048), 32768, 2000, {}
    if args.lengths:
        lengths = tuple(int(x) for x in args.lengths.split(","))
    tokens = args.tokens_per_step or tokens
    steps = args.steps or steps
    depths = tuple(int(x) for x in args.depths.split(",")) if args.depths else None
    if depths is not None and (len(depths) < 2 or min(depths) < 1):
        print("error: --depths needs two or more layer counts >= 1, e.g. 2,4,8", file=sys.stderr)
        return 2
    if depths is not None:
        lengths = (min(lengths),)
    if any(tokens % t for t in lengths):
        print(
            f"error: --tokens-per-step {tokens} must be a multiple of every length", file=sys.stderr
        )
        return 2
    if not args.tiny and not torch.cuda.is_available():
        print("error: no CUDA device is visible; the gpu preset needs one (or pass --tiny)",
              file=sys.stderr)  # fmt: skip
        return 2
    report: dict[str, Any] = {
        "params": {
            **vars(args),
            "out": str(args.out),
            "lengths": list(lengths),
            "tokens_per_step": tokens,
            "steps": steps,
        },
        "versions": versions(),
        "machine": {
            "nproc": os.cpu_count(),
            "load_avg": list(os.getloadavg()),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "untested_on_gpu": "this script has run on CPU (--tiny) only so far",
        "runs": [],
    }
    t0 = time.perf_counter()
    for seed in range(args.seeds):
        for t in lengths:
            for layers in depths or (None,):
                kw = dict(base) if layers is None else {**base, "layers": layers}
                config = preset(
                    "gpu",
                    task="text",
                    data="packed-bos",
                    seq_len=t,
                    batch_size=tokens // t,
                    steps=steps,
                    keep_checkpoints=False,
                    seed=seed,
                    **kw,
                )
                report["runs"].append(run_row(train(config)))
                report["seconds"] = round(time.perf_counter() - t0, 1)
                write_json_atomic(args.out, report)  # a call cut short keeps what it finished
    if depths is not None:
        report["comparison"] = depth_comparison(report["runs"])
        write_json_atomic(args.out, report)
        print(json.dumps(report["comparison"]))
        return 0
    by_seed: dict[int, dict[int, dict]] = {}
    for r in report["runs"]:
        by_seed.setdefault(r["config"]["seed"], {})[r["config"]["seq_len"]] = r
    report["comparison"] = [
        {
            "seed": seed,
            "lengths": [min(rs), max(rs)],
            "log_relative_mass_ratio": _log_ratio(rs[max(rs)], rs[min(rs)]),
            "sink_rate": {str(t): rs[t]["trajectory"][-1]["sink_rate"] for t in sorted(rs)},
            "all_converged": all(r["convergence"]["met"] for r in rs.values()),
        }
        for seed, rs in sorted(by_seed.items())
        if len(rs) >= 2
    ]
    write_json_atomic(args.out, report)
    print(json.dumps(report["comparison"]))
    return 0


def depth_comparison(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per seed, ``sinks-grow-depth``'s effect (docs/claims.md): the mean first-token sink mass
    of the deepest run minus the shallowest's, at the last checkpoint, beside each depth's mass
    and sink rate and whether every run converged."""
    by_seed: dict[int, dict[int, dict]] = {}
    for r in runs:
        by_seed.setdefault(r["config"]["seed"], {})[r["config"]["layers"]] = r
    out = []
    for seed, rs in sorted(by_seed.items()):
        if len(rs) < 2:
            continue
        last = {d: rs[d]["trajectory"][-1] for d in sorted(rs)}
        out.append(
            {
                "seed": seed,
                "depths": [min(rs), max(rs)],
                "effect": last[max(rs)]["first_token_mass"] - last[min(rs)]["first_token_mass"],
                "first_token_mass": {str(d): v["first_token_mass"] for d, v in last.items()},
                "sink_rate": {str(d): v["sink_rate"] for d, v in last.items()},
                "all_converged": all(r["convergence"]["met"] for r in rs.values()),
            }
        )
    return out


def _log_ratio(long: dict, short: dict) -> float | None:
    a, b = long["trajectory"][-1]["relative_mass"], short["trajectory"][-1]["relative_mass"]
    return math.log(a / b) if a > 0 and b > 0 else None


if __name__ == "__main__":
    sys.exit(main())
