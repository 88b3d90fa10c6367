"""Chunked vs step streaming, and the batched recompute oracle vs one window per forward: the
comparison behind ``benchmarks/results/2026-12-01/stream-methods.json``.

Each measurement is its own process (``stream_bench.py --worker`` with ``method`` step or chunked;
``oracle_time`` below for the oracle). This script compares what they wrote: per-token NLL
agreement of step and chunked over the longest prefix both reached, wall and CPU time per token,
and the oracle's seconds per target. The machine is shared, so CPU seconds (``ps``/``process_time``)
are given beside wall seconds.

    python benchmarks/stream_methods.py --step STEP.json --chunked CHUNKED.json \
        [--dense DENSE.json] [--oracle-one ONE.json --oracle-batched BATCHED.json] --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path


def agreement(step: list[float], chunked: list[float]) -> dict:
    """Per-token NLL agreement over the targets both scored (the step run may be a prefix)."""
    n = min(len(step), len(chunked))
    pairs = [(a, b) for a, b in zip(step[:n], chunked[:n], strict=True) if a == a and b == b]
    diff = [abs(a - b) for a, b in pairs]
    ppl = [math.exp(statistics.fmean(x)) for x in zip(*pairs, strict=True)]
    return {
        "n_targets": len(pairs),
        "max_abs_dnll": max(diff),
        "median_abs_dnll": statistics.median(diff),
        "ppl_step": ppl[0],
        "ppl_chunked": ppl[1],
        "ppl_equal_to_4_decimals": round(ppl[0], 4) == round(ppl[1], 4),
    }


def oracle_time(mode: str, ids_file: str, threads: int, batch: int = 16) -> dict:
    """Seconds per late target (t >= n_sink + window, full 513-token windows) of the oracle,
    SmolLM2 4 + 508, every 97th target of the first 2,000 tokens: T(all) - T(early targets)."""
    import torch

    from sinklab.models.loading import load_model
    from sinklab.stream.oracle import recompute_nll, recompute_nll_batched

    torch.set_num_threads(threads)
    model = load_model().model
    ids = torch.tensor(json.loads(Path(ids_file).read_text()))[:2000]

    def run(x):
        c0, t0 = time.process_time(), time.perf_counter()
        if mode == "one":
            nll, _, _ = recompute_nll(model, x, 4, 508, 97)
        else:
            nll, _, _ = recompute_nll_batched(model, x, 4, 508, 97, batch)
        return nll, time.perf_counter() - t0, time.process_time() - c0

    early, t_early, c_early = run(ids[:513])
    nll, t_all, c_all = run(ids)
    scored = ~nll.isnan()
    n_late = int(scored.sum()) - int((~early.isnan()).sum())
    return {
        "mode": mode,
        "batch": batch if mode != "one" else 1,
        "n_late": n_late,
        "s_per_late_target": (t_all - t_early) / n_late,
        "cpu_s_per_late_target": (c_all - c_early) / n_late,
        "targets": scored.nonzero()[:, 0].tolist(),
        "nll": nll[scored].tolist(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--oracle-worker", nargs=3, metavar=("MODE", "IDS", "THREADS"))
    ap.add_argument("--step", type=Path, help="step run: progress JSON (done, seconds, nll)")
    ap.add_argument("--step-cpu-s", type=float, help="CPU seconds of the step run at 'done'")
    ap.add_argument("--chunked", type=Path, help="chunked run: result JSON")
    ap.add_argument("--chunked-nll", type=Path)
    ap.add_argument("--chunked-cpu-s", type=float, help="CPU seconds of the chunked run")
    ap.add_argument("--dense", type=Path)
    ap.add_argument("--oracle-one", type=Path)
    ap.add_argument("--oracle-batched", type=Path)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.oracle_worker:
        mode, ids, threads = args.oracle_worker
        print(json.dumps(oracle_time(mode, ids, int(threads))))
        return
    read = lambda p: json.loads(Path(p).read_text())  # noqa: E731
    report: dict = {"note": args.note}
    if args.step and args.chunked and args.chunked_nll:
        step, chunked = read(args.step), read(args.chunked)
        nll_c = read(args.chunked_nll)["nll"]
        cmp = agreement(step["nll"], nll_c)
        n = len(nll_c)
        per_tok = {
            "step_wall_ms": 1e3 * step["seconds"] / step["done"],
            "chunked_wall_ms": 1e3 * chunked["seconds"] / n,
        }
        chunked_cpu = args.chunked_cpu_s or chunked.get("cpu_s")
        if args.step_cpu_s and chunked_cpu:
            per_tok["step_cpu_ms"] = 1e3 * args.step_cpu_s / step["done"]
            per_tok["chunked_cpu_ms"] = 1e3 * chunked_cpu / n
            per_tok["cpu_ratio_step_over_chunked"] = (
                per_tok["step_cpu_ms"] / per_tok["chunked_cpu_ms"]
            )
        per_tok["wall_ratio_step_over_chunked"] = (
            per_tok["step_wall_ms"] / per_tok["chunked_wall_ms"]
        )
        report["sink_4_508"] = {
            "chunked": chunked,
            "step": {"done": step["done"], "seconds": step["seconds"]},
            "agreement_on_step_prefix": cmp,
            "per_token": per_tok,
        }
    if args.dense:
        report["dense_chunked"] = read(args.dense)
    if args.oracle_one and args.oracle_batched:
        one, bat = read(args.oracle_one), read(args.oracle_batched)
        same = one["targets"] == bat["targets"]
        report["oracle"] = {
            "one_per_forward": {k: v for k, v in one.items() if k not in ("nll", "targets")},
            "batched": {k: v for k, v in bat.items() if k not in ("nll", "targets")},
            "same_targets": same,
            "max_abs_dnll": max(abs(a - b) for a, b in zip(one["nll"], bat["nll"], strict=True)),
            "wall_speedup": one["s_per_late_target"] / bat["s_per_late_target"],
            "cpu_speedup": one["cpu_s_per_late_target"] / bat["cpu_s_per_late_target"],
        }
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text, file=sys.stdout)


if __name__ == "__main__":
    main()
