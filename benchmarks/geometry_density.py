"""Geometry at three sites and the density curves on SmolLM2 (Shakespeare, T = 256 by default).

Usage: python benchmarks/geometry_density.py [--tokens 256] [--texts 3] [--parts geometry,mix,...]
       [--model DIR] [--threads 2] [--out DIR]

Each part (geometry; density with protocol mix, temperature, replace) runs in its own fresh
process; the parent prints one JSON object: per part the per-layer numbers, the finding and the
seconds, plus nproc, threads, load average, versions and every parameter. Figures (and the
experiment JSON) go to --out when given.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PARTS = ("geometry", "mix", "temperature", "replace")


def _geometry_table(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "layer": e["layer"],
            **{f"first_token_cosine.{s}": e["first_token_cosine"][s] for s in data["sites"]},
            **{f"token_similarity.{s}": e["token_similarity"][s] for s in data["sites"]},
        }
        for e in data["layers"]
    ]


def _density_summary(data: dict[str, Any]) -> dict[str, Any]:
    param = data["parameter"]
    return {
        "modified_layers": data["modified_layers"],
        "after_layers": data["after_layers"],
        "curve_shapes": data["curve_shapes"],
        "conditions": {
            k: {
                param: c[param],
                "ppl": round(c["ppl"], 3),
                "after_group_similarity": c["after_group_similarity"],
                "token_similarity": c["token_similarity"],
            }
            for k, c in data["conditions"].items()
        },
    }


def worker(part: str, args: argparse.Namespace) -> dict[str, Any]:
    """One part in this process: run the experiment, return its numbers."""
    import torch

    from sinklab.ablate import AblationConfig, run_experiment
    from sinklab.corpus import documents, token_stream
    from sinklab.meta import attach_meta
    from sinklab.models.loading import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    docs = documents()
    name = "geometry" if part == "geometry" else "density"
    rows = args.texts if part == "geometry" else 1
    ids = torch.stack([token_stream(d, loaded.tokenizer, args.tokens) for d in docs[:rows]])
    config = AblationConfig() if part == "geometry" else AblationConfig(protocol=part)
    start = time.perf_counter()
    res = run_experiment(name, loaded.model, loaded.tokenizer, ids, config)
    seconds = time.perf_counter() - start
    attach_meta(res, loaded.info, docs[:rows], res.params(), seconds)
    data = json.loads(json.dumps(res.to_json()))
    if args.out is not None:
        res.save(args.out / part)
        res.figure(args.out / part / f"{name}.png")
    out: dict[str, Any] = {
        "experiment": name,
        "seconds": round(seconds, 2),
        "finding": res.finding,
        "texts": [d.name for d in docs[:rows]],
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if part == "geometry":
        out |= {
            "middle_layers": data["middle_layers"],
            "key_note": data["key_note"],
            "layers": _geometry_table(data),
            "per_text_middle_attention_input": {
                k: [c["layers"][li]["first_token_cosine"]["attention_input"]
                    for li in data["middle_layers"]]
                for k, c in data["conditions"].items()
            },
        }  # fmt: skip
    else:
        out |= {"protocol": part, "parameter": data["parameter"], **_density_summary(data)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--texts", type=int, default=3)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    import torch

    from sinklab.meta import versions

    report: dict[str, Any] = {
        "model": args.model or "SmolLM2-135M-Instruct (embedded GGUF)",
        "text": "shakespeare (embedded Gutenberg plays)",
        "tokens": args.tokens,
        "texts": args.texts,
        "nproc": os.cpu_count(),
        "threads": args.threads,
        "torch": torch.__version__,
        "versions": versions(),
        "load_average_at_start": list(os.getloadavg()),  # > nproc: times are inflated
        "parts": {},
    }
    for part in args.parts.split(","):
        if part not in PARTS:
            sys.exit(f"unknown part {part!r}; use: {', '.join(PARTS)}")
        cmd = [sys.executable, __file__, "--worker", part, "--tokens", str(args.tokens)]
        cmd += ["--texts", str(args.texts), "--threads", str(args.threads)]
        cmd += ["--model", args.model] if args.model else []
        cmd += ["--out", str(args.out)] if args.out else []
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode:
            report["parts"][part] = {"error": proc.stderr.strip().splitlines()[-1:]}
            continue
        report["parts"][part] = json.loads(proc.stdout.strip().splitlines()[-1])
    report["load_average_at_end"] = list(os.getloadavg())
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
