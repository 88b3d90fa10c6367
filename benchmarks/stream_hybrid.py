"""Chunked (band) vs step streaming on a hybrid sliding-window model: Gemma 3 270M, whose 15 of
18 layers slide over their own 512 tokens while 3 are global.

``sinklab stream --method auto`` used to fall back to the token-by-token step loop on such models;
the band evaluator (:mod:`sinklab.stream.band`) now serves them (sliding layers read the model's
own window band, global layers the sinks + window). This arm measures what that buys: tokens/s
of each method on the same stream (long enough that the sliding layers evict too), and the
per-token NLL agreement of the two. Every measured run is a fresh process (``--worker METHOD``);
rounds alternate which method goes first; medians over rounds. CPU seconds are given beside wall
seconds and the load average is recorded (the machine may be shared).

    python benchmarks/stream_hybrid.py --model gemma3-270m --tokens 200 --window 60 --rounds 3 \
        --threads 1 --out benchmarks/results/2026-12-02/stream-hybrid-gemma3.json
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

METHODS = ("step", "chunked")


def worker(method: str, model_name: str, n_tokens: int, n_sink: int, window: int, threads: int):
    """One stream by ``method`` in this process -> {method, seconds, cpu_s, tokens_per_s, nll}."""
    import torch

    from sinklab.corpus import load_text, token_stream
    from sinklab.models.loading import load_model
    from sinklab.stream.band import chunked_nll
    from sinklab.stream.cache import CacheConfig
    from sinklab.stream.evaluate import stream_nll

    torch.set_num_threads(threads)
    loaded = load_model(model_name)
    ids = token_stream(load_text(), loaded.tokenizer, n_tokens)
    cfg = CacheConfig("sink", n_sink, window)
    run = stream_nll if method == "step" else chunked_nll
    c0, t0 = time.process_time(), time.perf_counter()
    nll, most, _ = run(loaded.model, ids, cfg)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "method": method,
        "seconds": seconds,
        "cpu_s": cpu,
        "tokens_per_s": nll.numel() / seconds,
        "max_cache_len": most,
        "nll": nll.tolist(),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=252)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    sizes = (args.model, args.tokens, args.n_sink, args.window, args.threads)
    if args.worker:
        print(json.dumps(worker(args.worker, *sizes)))
        return {}
    from sinklab.meta import versions, write_json_atomic

    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for r in range(args.rounds):
        for method in METHODS if r % 2 == 0 else METHODS[::-1]:
            cmd = [sys.executable, __file__, "--worker", method, "--model", args.model]
            cmd += ["--tokens", str(args.tokens), "--n-sink", str(args.n_sink)]
            cmd += ["--window", str(args.window), "--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[method].append(json.loads(out.strip().splitlines()[-1]))
            print(
                f"round {r}: {method} {runs[method][-1]['tokens_per_s']:.2f} tok/s", file=sys.stderr
            )
    step, chunked = runs["step"][0]["nll"], runs["chunked"][0]["nll"]
    med = {
        m: {
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs[m]),
            "cpu_ms_per_token": statistics.median(
                1e3 * x["cpu_s"] / len(x["nll"]) for x in runs[m]
            ),
            "max_cache_len": runs[m][0]["max_cache_len"],
        }
        for m in METHODS
    }
    result = {
        "model": args.model,
        "text": "sinklab.corpus.load_text() (the default corpus), ids from its start",
        "policy": f"sink {args.n_sink} + {args.window}",
        "tokens": args.tokens,
        "threads": args.threads,
        "nproc": os.cpu_count(),
        "rounds": args.rounds,
        "median": med,
        "speedup_chunked_over_step": med["chunked"]["tokens_per_s"] / med["step"]["tokens_per_s"],
        "max_abs_dnll": max(abs(a - b) for a, b in zip(step, chunked, strict=True)),
        "per_round_tokens_per_s": {m: [x["tokens_per_s"] for x in runs[m]] for m in METHODS},
        "versions": versions(),
        "load_average_at_end": list(os.getloadavg()),  # > nproc: the machine was shared
    }
    if args.out:
        write_json_atomic(args.out, result)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
