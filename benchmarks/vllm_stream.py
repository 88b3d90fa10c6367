"""vLLM with and without sinklab-vllm's eviction: KV memory per request and decode speed
(docs/benchmarks.md#vllm-stream, docs/vllm.md#wiring-cost).

Arms, each a fresh ``.venv-vllm`` process (``benchmarks/vllm_env/stream_arm.py``: one engine,
warmed with one short request), alternating over rounds, medians:

* ``plain``: vLLM's CPU build as it is (full attention, every token's KV kept);
* ``sinklab``: the plugin on, ``n_sink + window`` kept per request.

For each arm, N = 1 and N = 8 requests (different prompts from sinklab's corpus, ``--prompt``
tokens each) decode ``--tokens`` greedy tokens in one ``generate``. Recorded per arm and N: the
generate's wall and CPU seconds, aggregate tokens/s, ms a token at N = 1, and the most real (not
null) KV blocks one request held, with their bytes over all layers. The two arms' tokens are the
same until the first eviction, and may differ after (different attention by design); the first
difference is recorded.
The CPU's model and flags, nproc and the load average are recorded.

Usage: python benchmarks/vllm_stream.py [--model smollm2-135m] [--tokens 1024] [--prompt 37]
       [--rounds 3] [--n-sink 4] [--window 252] [--block-size 128] [--out FILE.json]
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

from sinklab.meta import dumps_json, write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
ARM = Path(__file__).resolve().parent / "vllm_env" / "stream_arm.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ARMS = ("plain", "sinklab")
WIDTHS = (1, 8)


def _run_arm(request: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    done = subprocess.run(
        [str(VLLM_PYTHON), str(ARM)],
        input=json.dumps(request), capture_output=True, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("SINKLAB-RESULT ")]
    if done.returncode != 0 or len(lines) != 1:
        raise SystemExit(f"arm failed (rc {done.returncode}): {done.stderr[-3000:]}")
    return json.loads(lines[0].removeprefix("SINKLAB-RESULT "))


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def summarize(runs: list[dict], tokens: int, layers: int) -> dict:
    """Medians over rounds per (arm, N); the sinklab arm's ratios to plain's in the same run.
    A block's page is one layer's; a request's KV memory is its blocks times ``layers``."""
    table: dict = {}
    for arm in ARMS:
        for n in WIDTHS:
            mine = [r for r in runs if r["arm"] == arm and r["n"] == n]
            if not mine:
                continue
            wall = statistics.median(r["generate_wall_s"] for r in mine)
            cpu = statistics.median(r["generate_cpu_s"] for r in mine)
            row = {
                "rounds": len(mine),
                "generate_wall_s": round(wall, 3),
                "generate_cpu_s": round(cpu, 3),
                "tokens_per_s": round(n * tokens / wall, 2),
                "max_blocks_per_request": max(r["max_blocks_per_request"] for r in mine),
                "kv_mib_per_request": round(
                    layers * max(r["kv_bytes_per_request"] for r in mine) / 2**20, 2
                ),
                "spec": mine[0]["spec"],
            }
            if n == 1:
                row["ms_per_token"] = round(1e3 * wall / tokens, 2)
            table[f"{arm}_n{n}"] = row
    for n in WIDTHS:
        plain, ours = table.get(f"plain_n{n}"), table.get(f"sinklab_n{n}")
        if plain and ours:
            ours["speed_vs_plain"] = round(plain["generate_wall_s"] / ours["generate_wall_s"], 3)
            ours["kv_vs_plain"] = round(ours["kv_mib_per_request"] / plain["kv_mib_per_request"], 3)
    firsts = {
        r["arm"]: r["tokens_first"]
        for r in runs
        if r["n"] == 1 and r["round"] == 0 and "tokens_first" in r
    }
    if len(firsts) == 2:
        table["first_token_unlike_plain_n1"] = _first_difference(firsts["plain"], firsts["sinklab"])
    return table


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--prompt", type=int, default=37)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--window", type=int, default=252)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not VLLM_PYTHON.is_file():
        p.error(f"no {VLLM_PYTHON}: run `make vllm-venv` first")
    from sinklab.corpus import load_text, token_stream
    from sinklab.models.fast import cpu_facts
    from sinklab.models.loading import load_model
    from sinklab.models.zoo import ZOO, dequantized_dir

    loaded = load_model(args.model)
    folder = dequantized_dir(ZOO[args.model], loaded.info.weights_sha256)
    text = token_stream(load_text(), loaded.tokenizer, args.prompt + 16 * max(WIDTHS)).tolist()
    prompts = [text[16 * i : 16 * i + args.prompt] for i in range(max(WIDTHS))]
    layers = int(loaded.model.config.num_hidden_layers)
    del loaded
    runs: list[dict] = []
    load_before = list(os.getloadavg())
    start = time.perf_counter()
    for r in range(args.rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            for n in WIDTHS:
                request = {
                    "model": str(folder),
                    "prompts": prompts[:n],
                    "max_tokens": args.tokens,
                    "sinklab": None
                    if arm == "plain"
                    else {"n_sink": args.n_sink, "window": args.window},
                    "block_size": args.block_size,
                    "max_model_len": args.prompt + args.tokens + 16,
                }
                t0 = time.perf_counter()
                res = _run_arm(request) | {"arm": arm, "n": n, "round": r}
                res["process_wall_s"] = round(time.perf_counter() - t0, 2)
                res["load_average"] = list(os.getloadavg())
                runs.append(res)
                print(f"round {r} {arm} N={n}: {res['generate_wall_s']} s", file=sys.stderr)
    report = {
        "benchmark": "vllm_stream",
        "params": {
            k: getattr(args, k)
            for k in ("model", "tokens", "prompt", "rounds", "n_sink", "window", "block_size")
        },
        "summary": summarize(runs, args.tokens, layers),
        "layers": layers,
        "machine": cpu_facts() | {"nproc": os.cpu_count()},
        "load_average_before": load_before,
        "load_average_at_end": list(os.getloadavg()),
        "seconds": round(time.perf_counter() - start, 1),
        "runs": [{k: v for k, v in r.items() if k != "tokens_first"} for r in runs],
    }
    print(dumps_json(report))
    if args.out:
        write_json_atomic(args.out, report)
    return report


if __name__ == "__main__":
    main()
