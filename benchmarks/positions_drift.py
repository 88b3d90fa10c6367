"""Float32 RoPE drift at large positions: one plain forward of N tokens of the default corpus on
the embedded SmolLM2, given positions ``offset + 0..N-1``, for each offset.

This is what ``model.generate(cache=SinkCache(...))`` does to a long stream (the model computes
positions as the token's index); sinklab's own loops (``SinkCache.prepare``) keep positions below
``max_position_embeddings`` instead, i.e. always at the offset-0 row. Reported per offset (site:
the model's output log-probabilities): PPL on the N - 1 targets, max |d log p| against offset 0
over the targets and over the whole vocabulary.

Usage: python benchmarks/positions_drift.py [--tokens 300] [--offsets 0,1000000,4000000,16000000]
       [--threads 2] [--out FILE.json] [--model M]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def drift(model, ids, offsets: list[int]) -> list[dict]:
    """One forward per offset -> rows {offset, ppl, max_abs_dlogp_targets, max_abs_dlogp_vocab}."""
    import torch

    base = None
    rows = []
    n = ids.numel()
    for off in offsets:
        pos = (torch.arange(n) + off)[None]
        with torch.inference_mode():
            logits = model(ids[None], position_ids=pos, use_cache=False).logits[0, :-1]
        logp = torch.log_softmax(logits.double(), -1)
        nll = -logp.gather(-1, ids[1:, None])[:, 0]
        if base is None:
            base = logp
        d = (logp - base).abs()
        tgt = d.gather(-1, ids[1:, None])[:, 0]
        rows.append(
            {
                "offset": off,
                "ppl": round(float(torch.exp(nll.mean())), 4),
                "max_abs_dlogp_targets": round(float(tgt.max()), 4),
                "max_abs_dlogp_vocab": round(float(d.max()), 4),
            }
        )
        print(rows[-1], file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--offsets", default="0,1000000,4000000,16000000")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    from sinklab.corpus import load_text, token_stream
    from sinklab.meta import versions, write_json_atomic
    from sinklab.models.loading import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    ids = token_stream(load_text(), loaded.tokenizer, args.tokens)
    offsets = [int(x) for x in args.offsets.split(",")]
    t0 = time.perf_counter()
    rows = drift(loaded.model, ids, offsets)
    result = {
        "benchmark": "positions_drift",
        "site": "output log-probabilities (log_softmax of the logits), float32 model",
        "model": loaded.info.name if hasattr(loaded.info, "name") else str(args.model or "default"),
        "tokens": args.tokens,
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 2),
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
