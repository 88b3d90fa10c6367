"""The plugin's evicted-query attention alone: a plan in every layer against one plan a forward
(docs/vllm.md#wiring-cost).

A decode step of ``--layers`` layers, each with its own random KV cache in vLLM's CPU layout,
``Q`` queries past an ``n_sink + window`` window (Qwen2.5-0.5B's heads by default: 14 query
heads, 2 KV heads, head size 64, 24 layers, blocks of 32). Arms, each a fresh process of this
script (``--arm``), alternating over rounds, medians:

* ``layer-plan``: ``sink_attention_many`` in every layer (the plan made each time: what the
  backend did before 2026-12-07);
* ``forward-plan``: ``plan_evicted`` once, ``attend_evicted`` in every layer (the backend now).

Both give the same bits (checked in each forward-plan process). Pure PyTorch in sinklab's venv:
the module imports nothing from vLLM. Prints one JSON object (``--out`` writes it too).

    python benchmarks/vllm_plan.py                       # Q = 1 and 8, 5 rounds, one thread
    python benchmarks/vllm_plan.py --rounds 3 --threads 2
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

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("layer-plan", "forward-plan")


def _arm(arm: str, queries: int, args: argparse.Namespace) -> dict:
    """Time ``--steps`` decode steps of one arm in this process: ms a step, median of steps."""
    import torch

    sys.path.insert(0, str(ROOT / "vllm_plugin" / "src"))
    from sinklab_vllm.attention import attend_evicted, plan_evicted, sink_attention_many
    from sinklab_vllm.rotary import KeyMover

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    heads, kv, d, b = args.heads, args.kv_heads, args.head_size, args.block_size
    n_blocks = 64 * queries
    caches = [torch.randn(n_blocks, kv, b, 2 * d, generator=g) for _ in range(args.layers)]
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    mover = KeyMover(inv, d, d)
    rows = torch.stack([torch.randperm(n_blocks, generator=g)[:64] for _ in range(queries)]).int()
    positions = torch.arange(1000, 1000 + queries)
    q = [torch.randn(queries, heads, d, generator=g) for _ in range(args.layers)]
    scale = d**-0.5

    def step() -> list:
        if arm == "layer-plan":
            return [
                sink_attention_many(
                    q[i], c, rows, positions, args.n_sink, args.window, mover, scale, 32768
                )
                for i, c in enumerate(caches)
            ]
        plan = plan_evicted(rows, positions, args.n_sink, args.window, mover, b, torch.float32,
                            32768)  # fmt: skip
        return [attend_evicted(q[i], c, plan, mover, scale) for i, c in enumerate(caches)]

    if arm == "forward-plan":  # the same bits as the plan made in each layer
        ref = [
            sink_attention_many(
                q[i], c, rows, positions, args.n_sink, args.window, mover, scale, 32768
            )
            for i, c in enumerate(caches)
        ]
        assert all(torch.equal(a, r) for a, r in zip(step(), ref, strict=True))
    for _ in range(3):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"arm": arm, "queries": queries, "ms_per_step": 1e3 * statistics.median(times)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--window", type=int, default=252)
    p.add_argument("--queries", default="1,8")
    p.add_argument("--arm", choices=ARMS)  # internal: one arm in this process
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    widths = [int(x) for x in args.queries.split(",")]
    if args.arm is not None:
        print("SINKLAB-RESULT " + json.dumps(_arm(args.arm, widths[0], args)), flush=True)
        return {}
    from sinklab.meta import dumps_json, write_json_atomic
    from sinklab.models.fast import cpu_facts

    runs = []
    load_before = os.getloadavg()
    for r in range(args.rounds):
        for queries in widths:
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                cmd = [sys.executable, __file__, "--arm", arm, "--queries", str(queries),
                       "--steps", str(args.steps), "--threads", str(args.threads),
                       "--layers", str(args.layers), "--heads", str(args.heads),
                       "--kv-heads", str(args.kv_heads), "--head-size", str(args.head_size),
                       "--block-size", str(args.block_size), "--n-sink", str(args.n_sink),
                       "--window", str(args.window)]  # fmt: skip
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("SINKLAB-RESULT ")]
                if done.returncode != 0 or len(lines) != 1:
                    raise SystemExit(f"arm {arm} failed: {done.stderr[-2000:]}")
                runs.append(json.loads(lines[0].removeprefix("SINKLAB-RESULT ")) | {"round": r})
    summary = {}
    for queries in widths:
        med = {
            arm: statistics.median(
                x["ms_per_step"] for x in runs if x["arm"] == arm and x["queries"] == queries
            )
            for arm in ARMS
        }
        summary[f"Q{queries}"] = {
            "layer_plan_ms_per_step": round(med["layer-plan"], 3),
            "forward_plan_ms_per_step": round(med["forward-plan"], 3),
            "speedup": round(med["layer-plan"] / med["forward-plan"], 2),
        }
    result = {
        "benchmark": "vllm_plan",
        "params": {k: v for k, v in vars(args).items() if k not in ("arm", "out")},
        "summary": summary,
        "machine": cpu_facts() | {"nproc": os.cpu_count()},
        "load_average_before": list(load_before),
        "load_average_at_end": list(os.getloadavg()),
        "runs": runs,
    }
    print(dumps_json(result))
    if args.out is not None:
        write_json_atomic(args.out, result)
    return result


if __name__ == "__main__":
    main()
