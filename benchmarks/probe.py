"""Benchmark: ``sinklab probe`` (every metric, and ``--metrics fast``) against a plain SDPA forward.

Arms, each measured in its own fresh process (model load not timed; one forward in float32):

* ``probe``: :func:`sinklab.probe.probe` with its default metric set (what ``sinklab probe``
  reports): the observation path (``sinklab.seam.observe``), hidden-state and geometry hooks;
* ``fast``: the same with ``metrics="fast"`` (no entropy, received attention, sink positions);
* ``sdpa``: the model's own SDPA forward on the same ids, ``logits_to_keep=1`` as the probe (the
  probe needs no logits: a forward that computed all T x vocab logits would flatter the ratio);
* ``block`` (opt-in): the probe forced onto the block path (the path of every layer before the
  observation path), for contrast;
* ``eager`` (opt-in): eager attention with ``output_attentions=True``, where its L x H x T^2
  float32 weights fit in ``--mem-limit-gb``.

Rounds alternate the arms (each round starts one arm later), >= 3 rounds, medians; peak RSS is the
process's own ``ru_maxrss``. Wall and CPU seconds are both recorded with the load average before
and after each run: on a shared machine CPU seconds are what the ratios should rest on
(docs/benchmarks.md#protocol). Prints one JSON object (and writes it to ``--out``).

    python benchmarks/probe.py --lengths 2048,4096,8192 --rounds 3 --out probe.json
    python benchmarks/probe.py --lengths 1024 --rounds 1 --model DIR      # quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ARMS = ("probe", "fast", "sdpa", "block", "eager")
DEFAULT_ARMS = "probe,fast,sdpa"


def worker(arm: str, n: int, model: str, threads: int) -> dict[str, Any]:
    """One arm at ``n`` tokens in this process: seconds, CPU seconds, peak RSS (GiB) and, for the
    probe arms, how many layers took each path."""
    import resource

    import torch

    torch.set_num_threads(threads)
    from sinklab.corpus import load_text, token_stream
    from sinklab.models.loading import load_model
    from sinklab.probe import ProbeConfig, probe
    from sinklab.probe.core import _forward_kwargs
    from sinklab.seam import AttentionHandler, sinklab_attention

    lm = load_model(None if model == "default" else model)
    m = lm.model
    ids = token_stream(load_text("shakespeare"), lm.tokenizer, n)
    paths: list[str] = []
    load0 = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        if arm in ("probe", "fast"):
            config = ProbeConfig(q0=16, metrics="all" if arm == "probe" else "fast")
            paths = probe(m, ids, config).attention_path
        elif arm == "block":  # a bound handler that does not opt in: every layer by blocks
            with sinklab_attention(m, AttentionHandler()):
                paths = probe(m, ids, ProbeConfig(q0=16)).attention_path
        elif arm == "eager":
            m.set_attn_implementation("eager")
            m(ids[None], output_attentions=True, use_cache=False)
        elif arm == "sdpa":
            m(ids[None], **_forward_kwargs(m))
        else:
            raise SystemExit(f"unknown arm {arm!r}; use one of {', '.join(ARMS)}")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    out = {
        "seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "load_before": round(load0, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    if paths:
        out["paths"] = {p: paths.count(p) for p in sorted(set(paths))}
    return out


#: ``--malloc fixed``: glibc returns every block over 128 KiB to the system when it is freed
#: (a fixed mmap threshold instead of its dynamic one, which grows to 32 MiB and keeps freed
#: blocks in the heap). Peak RSS then tracks the memory a run really holds at once, not what the
#: allocator kept; every large allocation pays its page faults, so wall times rise.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def run_child(
    arm: str, n: int, threads: int, model: str, timeout: float, malloc: str = "default"
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", arm, str(n), model, str(threads)]
    env = {**os.environ, **(FIXED_MALLOC if malloc == "fixed" else {})}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f}s"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"error": tail[0][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def eager_gb(n: int, layers: int = 30, heads: int = 9) -> float:
    return 4.0 * layers * heads * n * n * 2 / 2**30  # weights kept + one softmax temporary


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per arm, and each arm's ratios to ``sdpa`` (wall, CPU, peak RSS)."""
    row: dict[str, Any] = {}
    for arm, rs in runs.items():
        ok = [r for r in rs if "seconds" in r]
        row[arm] = {
            "median_seconds": round(statistics.median(r["seconds"] for r in ok), 2) if ok else None,
            "median_cpu_seconds": round(statistics.median(r["cpu_seconds"] for r in ok), 2)
            if ok
            else None,
            "peak_rss_gb": round(max(r["rss_gb"] for r in ok), 3) if ok else None,
            "runs": rs,
        }
    base = row.get("sdpa", {})
    for arm in runs:
        if arm == "sdpa" or not base.get("median_seconds") or not row[arm]["median_seconds"]:
            continue
        row[f"{arm}_over_sdpa"] = {
            key: round(row[arm][key] / base[key], 3)
            for key in ("median_seconds", "median_cpu_seconds", "peak_rss_gb")
        }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="default")
    ap.add_argument("--mem-limit-gb", type=float, default=12.0)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument(
        "--malloc",
        choices=("default", "fixed"),
        default="default",
        help="fixed: a fixed glibc mmap threshold in the workers (peak RSS without the "
        "allocator's retention; see FIXED_MALLOC)",
    )
    args = ap.parse_args()
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        raise SystemExit(f"unknown arms {unknown}; use {', '.join(ARMS)}")
    results: dict[str, Any] = {}
    for n in (int(x) for x in args.lengths.split(",")):
        here = [a for a in arms if a != "eager" or eager_gb(n) < args.mem_limit_gb]
        runs: dict[str, list[dict[str, Any]]] = {a: [] for a in here}
        for r in range(args.rounds):  # alternate; each round starts one arm later
            for arm in here[r % len(here) :] + here[: r % len(here)]:
                runs[arm].append(
                    run_child(arm, n, args.threads, args.model, args.timeout, args.malloc)
                )
        row = summarise(runs)
        if "eager" in arms and "eager" not in here:
            row["eager"] = {"skipped": f"needs ~{eager_gb(n):.0f} GiB"}
        results[str(n)] = row
        brief = {k: v for k, v in row.items() if k.endswith("_over_sdpa")}
        print(json.dumps({"progress": n, **brief}), file=sys.stderr, flush=True)
    import torch
    import transformers

    from sinklab.meta import versions, write_json_atomic

    data = {
        "benchmark": "probe",
        "nproc": os.cpu_count(),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "versions": versions(),
        "params": vars(args),
        "load_average_at_end": list(os.getloadavg()),  # > nproc: the machine was shared
        "results": results,
    }
    if args.out:
        write_json_atomic(Path(args.out), data)
    print(json.dumps(data, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        arm, n, model, threads = sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
        print(json.dumps(worker(arm, n, model, threads)))
    else:
        main()
