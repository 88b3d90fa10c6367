"""Where the probe's time goes beside a plain forward: ``torch.profiler`` over one ``sdpa``
forward (``logits_to_keep=1``, as benchmarks/probe.py's baseline) and one ``probe`` run with
``--metrics`` (``fast`` by default), after one warm-up each, on the embedded model at ``--length``
tokens. Prints (and writes to ``--out``) one JSON object: each run's CPU seconds and its top ops
by self CPU time, and the ops whose self time grew most from the forward to the probe (the
term that keeps the probe from a forward's cost; issue 31, docs/benchmarks.md#probe).

    python benchmarks/probe_profile.py --length 2048 --out probe-profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any


def _ops(prof: Any, top: int) -> dict[str, float]:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return {e.key: round(e.self_cpu_time_total / 1e6, 4) for e in rows[:top]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--metrics", default="fast", choices=["fast", "all"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--model", default=None, help="a model folder or zoo name (default: SmolLM2)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(args.threads)
    from sinklab.corpus import load_text, token_stream
    from sinklab.meta import versions, write_json_atomic
    from sinklab.models.loading import load_model
    from sinklab.probe import ProbeConfig, probe
    from sinklab.probe.core import _forward_kwargs

    lm = load_model(args.model)
    m = lm.model
    ids = token_stream(load_text("shakespeare"), lm.tokenizer, args.length)
    config = ProbeConfig(q0=16, metrics=args.metrics)
    runs = {
        "sdpa": lambda: m(ids[None], **_forward_kwargs(m)),
        "probe": lambda: probe(m, ids, config),
    }
    out: dict[str, Any] = {"benchmark": "probe_profile", "params": vars(args) | {"out": None}}
    with torch.no_grad():
        for name, run in runs.items():
            run()  # warm-up (first-call allocations and kernel choices)
            cpu = time.process_time()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run()
            out[name] = {"cpu_seconds": round(time.process_time() - cpu, 3),
                         "top_ops": _ops(prof, args.top)}  # fmt: skip
            out[name + "_all"] = _ops(prof, 10_000)
    base, pr = out.pop("sdpa_all"), out.pop("probe_all")
    grown = {k: round(v - base.get(k, 0.0), 4) for k, v in pr.items()}
    out["grew_most"] = dict(sorted(grown.items(), key=lambda kv: -kv[1])[: args.top])
    out["ratio_cpu"] = round(out["probe"]["cpu_seconds"] / out["sdpa"]["cpu_seconds"], 3)
    out["machine"] = {"cpu": _cpu(), "flags": _flags(), "nproc": os.cpu_count(),
                      "load_average_at_end": list(os.getloadavg()),
                      "platform": platform.platform()}  # fmt: skip
    out["versions"] = versions()
    if args.out:
        write_json_atomic(args.out, out)
    print(json.dumps(out, indent=1))
    return out


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _flags() -> list[str]:
    want = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return sorted(want & set(line.split(":", 1)[1].split()))
    return []


if __name__ == "__main__":
    main()
