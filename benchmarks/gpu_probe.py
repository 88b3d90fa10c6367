"""Benchmark (GPU, prepared for one short call on a lent machine): the probe's observation path on
CUDA at 8k..128k tokens, against the model's own SDPA forward.

Not run yet: the session that wrote it had no GPU (docs/benchmarks.md#probe says so). It needs a
CUDA device and nothing from the network: the model is built from a config with random weights
(the timing does not depend on the weights), in bfloat16, on the GPU.

1. A correctness check first: a tiny float32 model on CUDA, every probe metric of the
   observation path (CUDA's memory-efficient kernel with its log-sum-exp) against the block path;
   the largest difference is printed, and the run stops if it exceeds ``--check-tol``.
2. Then, per length, alternating rounds of three arms in this one process (after a warm-up):
   ``sdpa`` (``logits_to_keep=1``), ``fast`` (``--metrics fast``) and ``probe`` (every metric);
   wall seconds (CUDA-synchronised) and peak GPU memory (``max_memory_allocated``), medians.

    python benchmarks/gpu_probe.py --preset qwen2.5-32b --lengths 8192,32768,131072 --rounds 2
    python benchmarks/gpu_probe.py --preset llama-8b --lengths 8192 --rounds 1   # quick

Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

#: published shapes of a few models (no weights needed: random init)
PRESETS: dict[str, dict[str, Any]] = {
    "llama-8b": dict(
        family="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        rope_theta=500000.0,
    ),
    "qwen2.5-32b": dict(
        family="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, rope_theta=1000000.0,
    ),
    "qwen2.5-0.5b": dict(
        family="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
    ),
}  # fmt: skip


def build(preset: str, max_positions: int, dtype):
    """A random-weight model of ``preset`` on the GPU (initialised there, in ``dtype``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(PRESETS[preset])
    family = spec.pop("family")
    cfg = AutoConfig.for_model(family, **spec, max_position_embeddings=max_positions)
    if family == "qwen2":
        cfg.use_sliding_window = False
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def check(tol: float) -> float:
    """Every metric, observation path vs block path, on a tiny float32 model on CUDA."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sinklab.probe import ProbeConfig, probe, spec
    from sinklab.seam import AttentionHandler, sinklab_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    )  # fmt: skip
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 512, (1, 300), device="cuda")
    fused = probe(model, ids, ProbeConfig(q0=4))
    with sinklab_attention(model, AttentionHandler()):
        block = probe(model, ids, ProbeConfig(q0=4))
    if fused.attention_path != ["fused"] * 2:
        raise SystemExit(f"the tiny model did not take the fused path: {fused.attention_path}")
    worst = max(
        float((getattr(fused, n) - getattr(block, n)).abs().max()) for n in spec.names("attention")
    )
    if worst > tol:
        raise SystemExit(f"observation path differs from the block path by {worst:.2e} > {tol}")
    return worst


def timed(fn) -> tuple[float, float]:
    """(seconds, peak GiB) of ``fn()`` on the GPU."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-32b", choices=sorted(PRESETS))
    ap.add_argument("--lengths", default="8192,16384,32768,65536,131072")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--check-tol", type=float, default=1e-4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark measures the probe on a GPU")
    from sinklab.probe import ProbeConfig, probe
    from sinklab.probe.core import _forward_kwargs

    worst = check(args.check_tol)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = build(args.preset, max(lengths), torch.bfloat16)
    vocab = model.config.vocab_size
    arms = {
        "sdpa": lambda ids: model(ids, **_forward_kwargs(model)),
        "fast": lambda ids: probe(model, ids, ProbeConfig(q0=16, metrics="fast")),
        "probe": lambda ids: probe(model, ids, ProbeConfig(q0=16)),
    }
    results: dict[str, Any] = {}
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(n))
            ids = ids.cuda()
            runs: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
            try:
                for fn in arms.values():  # warm-up (kernels, allocator), at a short length
                    fn(ids[:, :1024])
                for r in range(args.rounds):
                    order = list(arms)[r % 3 :] + list(arms)[: r % 3]
                    for arm in order:
                        runs[arm].append(timed(lambda a=arm, x=ids: arms[a](x)))
            except torch.OutOfMemoryError as err:
                results[str(n)] = {"error": f"out of memory: {str(err).splitlines()[0]}"}
                torch.cuda.empty_cache()
                break
            row: dict[str, Any] = {
                a: {
                    "median_seconds": round(statistics.median(s for s, _ in rs), 3),
                    "peak_gib": round(max(g for _, g in rs), 2),
                }
                for a, rs in runs.items()
            }
            for a in ("fast", "probe"):
                row[f"{a}_over_sdpa"] = round(
                    row[a]["median_seconds"] / row["sdpa"]["median_seconds"], 3
                )
            results[str(n)] = row
            print(json.dumps({"progress": n, **row}), file=sys.stderr, flush=True)
    from sinklab.meta import versions, write_json_atomic

    data = {
        "benchmark": "gpu_probe",
        "device": torch.cuda.get_device_name(),
        "preset": args.preset,
        "params": vars(args),
        "check_max_abs_diff": worst,
        "versions": versions(),
        "load_average_at_end": list(os.getloadavg()),
        "results": results,
    }
    if args.out:
        write_json_atomic(Path(args.out), data)
    print(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
