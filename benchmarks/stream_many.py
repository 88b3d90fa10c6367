"""Decode throughput of B independent streams in one SinkCache (sinklab's own loop,
``sinklab.stream.generation.StreamBatch``) on the embedded SmolLM2, B = 1, 4, 8, 16.

Each stream reads its own prompt from the default corpus (different starts and lengths, longer
than the cache, so every stream is evicting), then every step decodes one greedy token for every
stream. Timed: the decode steps only. Each B runs in its own fresh process; rounds alternate the
B's; the median over rounds is quoted. ``ms_per_token_per_stream`` = one step's wall time (each
stream gets one token per step); ``tokens_per_s`` = B / step time.

Usage: python benchmarks/stream_many.py [--batches 1,4,8,16] [--steps 24] [--rounds 3]
       [--n-sink 4] [--window 124] [--threads 1] [--out FILE.json]
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


def child(
    b: int, steps: int, n_sink: int, window: int, threads: int, model: str | None = None
) -> dict:
    """One process, one batch size: -> {b, step_s (list), prompt_s, kept}."""
    import torch

    from sinklab.corpus import load_text, token_stream
    from sinklab.models.loading import load_model
    from sinklab.stream.cache import CacheConfig
    from sinklab.stream.generation import StreamBatch

    torch.set_num_threads(threads)
    m = load_model(model)
    cap = n_sink + window
    text = token_stream(load_text(), m.tokenizer, 4 * cap + 16 * b + 64)
    batch = StreamBatch(m.model, CacheConfig("sink", n_sink, window))
    prompts = {}
    for i in range(b):  # stream i: its own start and length (cap + 8..)
        sid = batch.add()
        start, length = 16 * i, cap + 8 + (37 * i) % cap
        prompts[sid] = text[start : start + length].tolist()
    t0 = time.perf_counter()
    logits = batch.feed(prompts, last_only=True)
    prompt_s = time.perf_counter() - t0
    nxt = {s: int(x[-1].argmax()) for s, x in logits.items()}
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        logits = batch.feed({s: [t] for s, t in nxt.items()}, last_only=True)
        nxt = {s: int(x[-1].argmax()) for s, x in logits.items()}
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    kept = batch.cache.kept_length()
    return {"b": b, "step_s": times, "cpu_s": cpu, "prompt_s": prompt_s, "kept": kept}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n-sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=124)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        out = child(args.child, args.steps, args.n_sink, args.window, args.threads, args.model)
        print(json.dumps(out))
        return {}
    batches = [int(x) for x in args.batches.split(",")]
    runs: dict[int, list[dict]] = {b: [] for b in batches}
    for r in range(args.rounds):
        for b in batches if r % 2 == 0 else batches[::-1]:  # alternate the order
            cmd = [sys.executable, __file__, "--child", str(b), "--steps", str(args.steps)]
            cmd += ["--n-sink", str(args.n_sink), "--window", str(args.window)]
            cmd += ["--threads", str(args.threads)] + (
                ["--model", args.model] if args.model else []
            )
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[b].append(json.loads(out.strip().splitlines()[-1]))
            print(
                f"round {r} B={b}: {statistics.median(runs[b][-1]['step_s']):.4f} s/step",
                file=sys.stderr,
            )
    rows = []
    for b in batches:
        step = statistics.median(statistics.median(x["step_s"][2:]) for x in runs[b])  # 2 warm-up
        rows.append(
            {
                "streams": b,
                "ms_per_token_per_stream": round(1e3 * step, 2),
                "tokens_per_s": round(b / step, 2),
                "prompt_s_median": round(statistics.median(x["prompt_s"] for x in runs[b]), 2),
                "kept": runs[b][0]["kept"],
                "cpu_ms_per_step": round(
                    1e3 * statistics.median(statistics.median(x["cpu_s"][2:]) for x in runs[b]), 2
                ),
                "round_medians_ms": [
                    round(1e3 * statistics.median(x["step_s"][2:]), 2) for x in runs[b]
                ],
            }
        )
    base = next((r["tokens_per_s"] for r in rows if r["streams"] == 1), None)
    base_cpu = next((r["cpu_ms_per_step"] for r in rows if r["streams"] == 1), None)
    for r in rows:
        r["speedup_vs_1"] = round(r["tokens_per_s"] / base, 2) if base else None
        # tokens per CPU-second against B = 1: what the batching gains without the neighbours'
        # time slices in the wall clock
        if base_cpu:
            r["cpu_speedup_vs_1"] = round(r["streams"] * base_cpu / r["cpu_ms_per_step"], 2)
    from sinklab.meta import versions, write_json_atomic

    result = {
        "benchmark": "stream_many",
        "what": "greedy decode steps of B streams in one SinkCache, sinklab's StreamBatch loop",
        "model": args.model or "smollm2-135m (embedded, float32)",
        "cache": {"policy": "sink", "n_sink": args.n_sink, "window": args.window},
        "steps": args.steps,
        "rounds": args.rounds,
        "rows": rows,
        "target": "B = 8 gives >= 5x the tokens/s of B = 1",
        "nproc": os.cpu_count(),
        "threads": args.threads,
        "versions": versions(),
        "load_average_at_end": list(os.getloadavg()),  # > nproc: the machine was shared
    }
    if args.out:
        write_json_atomic(Path(args.out), result)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
