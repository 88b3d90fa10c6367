"""Benchmark: fused softmax1 / sink attention against plain SDPA and the materialised reference.

Run ``python benchmarks/attention_variants.py`` (``--help`` for sizes). Protocol
(docs/benchmarks.md#protocol): every implementation runs in its own fresh subprocess (this
script with ``--child IMPL``), the implementations alternate A B C D E, A B C D E, ... for
``--rounds`` rounds; each child warms up once, then times ``--reps`` calls and reports their
median and its peak RSS (``ru_maxrss``) minus its own baseline after imports, inputs and a tiny
warm-up call, so the figure is the attention's own. ``torch.set_num_threads`` is fixed in every
child. Prints ONE JSON object: per-implementation medians over rounds, per-round figures, and
the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

IMPLS = ("sdpa", "fused_softmax1", "fused_sink", "reference_softmax1", "reference_sink")
# (numerator, denominator) pairs reported as ratios of the medians
RATIOS = (
    ("fused_softmax1", "sdpa"),
    ("fused_sink", "sdpa"),
    ("reference_softmax1", "fused_softmax1"),
    ("reference_sink", "fused_sink"),
)
TARGET_FUSED_OVER_SDPA = 1.3


@dataclass(frozen=True)
class Params:
    """Sizes of one benchmark run (float32, CPU, causal, batch 1)."""

    seq_len: int = 2048
    heads: int = 9
    head_dim: int = 64
    batch: int = 1
    reps: int = 5  # timed calls per child, after one warm-up call
    rounds: int = 3  # fresh subprocesses per implementation, interleaved
    threads: int = 0  # torch.set_num_threads; 0 = every core this process may use
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "heads", "head_dim", "batch", "reps", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = all cores), got {self.threads}.")

    @property
    def n_threads(self) -> int:
        return self.threads or len(os.sched_getaffinity(0))


def _import_sinklab() -> None:
    """Make ``sinklab`` importable when the package is not installed (run from a checkout)."""
    try:
        import sinklab  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def measure(impl: str, params: Params) -> dict[str, float | list[float]]:
    """Time and peak memory of one implementation in *this* process (call it in a fresh one)."""
    import torch

    _import_sinklab()
    from sinklab.attention import fused_attention, reference_attention

    torch.set_num_threads(params.n_threads)
    g = torch.Generator().manual_seed(params.seed)
    shape = (params.batch, params.heads, params.seq_len, params.head_dim)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))  # (B, H, T, D) each
    sink_logit = torch.randn(params.heads, generator=g)  # (H,)
    fns: dict[str, Callable[[], torch.Tensor]] = {
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        "fused_softmax1": lambda: fused_attention(q, k, v, is_causal=True, variant="softmax1"),
        "fused_sink": lambda: fused_attention(
            q, k, v, is_causal=True, variant="sink", sink_logit=sink_logit
        ),
        "reference_softmax1": lambda: reference_attention(
            q, k, v, is_causal=True, variant="softmax1"
        )[0],
        "reference_sink": lambda: reference_attention(
            q, k, v, is_causal=True, variant="sink", sink_logit=sink_logit
        )[0],
    }
    fn = fns[impl]
    # initialise thread pools and kernels on a tiny input, so the baseline holds them
    tiny = q[:, :, :16]
    torch.nn.functional.scaled_dot_product_attention(tiny, tiny, tiny, is_causal=True)
    baseline = _max_rss_mib()
    with torch.inference_mode():
        out = fn()  # warm-up
        del out
        times = []
        for _ in range(params.reps):
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
            del out
    return {
        "time_s": statistics.median(times),
        "times_s": times,
        "peak_mib": _max_rss_mib() - baseline,
        "baseline_mib": baseline,
    }


def _run_child(impl: str, params: Params) -> dict[str, float | list[float]]:
    args = [sys.executable, str(Path(__file__).resolve()), "--child", impl]
    for field in dataclasses.fields(params):
        args += [f"--{field.name.replace('_', '-')}", str(getattr(params, field.name))]
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Params):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    parser.add_argument("--child", choices=IMPLS, help="internal: measure one implementation")
    ns = parser.parse_args(argv)
    params = Params(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(Params)})
    if ns.child:
        print(json.dumps(measure(ns.child, params)))
        return

    import torch
    import transformers

    start, load_start = time.perf_counter(), os.getloadavg()
    runs: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
    for _ in range(params.rounds):
        for impl in IMPLS:  # A B C D E, A B C D E, ...
            runs[impl].append(_run_child(impl, params))
    figures = {
        impl: {
            "time_s_median": round(statistics.median(r["time_s"] for r in rs), 5),
            "peak_mib_median": round(statistics.median(r["peak_mib"] for r in rs), 1),
            "time_s_per_round": [round(r["time_s"], 5) for r in rs],
            "peak_mib_per_round": [round(r["peak_mib"], 1) for r in rs],
            "baseline_mib_per_round": [round(r["baseline_mib"], 1) for r in rs],
        }
        for impl, rs in runs.items()
    }
    ratios = {
        f"{a}/{b}": {
            "time": _ratio(figures[a]["time_s_median"], figures[b]["time_s_median"]),
            "peak_mem": _ratio(figures[a]["peak_mib_median"], figures[b]["peak_mib_median"]),
        }
        for a, b in RATIOS
    }
    worst = max(ratios["fused_softmax1/sdpa"]["time"], ratios["fused_sink/sdpa"]["time"])
    result = {
        "benchmark": "attention_variants",
        "params": {
            **dataclasses.asdict(params),
            "threads": params.n_threads,
            "dtype": "float32",
            "device": "cpu",
            "is_causal": True,
            "warmup_calls": 1,
            "sink_logit": "randn(heads) from the seed",
            "order": "interleaved by round: " + " ".join(IMPLS),
        },
        "figures": figures,
        "ratios": ratios,
        "target": {
            "fused_over_sdpa_time_max": TARGET_FUSED_OVER_SDPA,
            "met": worst <= TARGET_FUSED_OVER_SDPA,
        },
        "nproc": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)),
        "loadavg_1m_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "wall_s": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
