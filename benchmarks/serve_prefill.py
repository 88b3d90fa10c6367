"""What a batched prefill would buy ``sinklab serve``: B sessions, each with a full sink cache
(histories of --history minus 7*i tokens, past n_sink + window), read a turn of --new minus 3*i
tokens, one after another (what the server does today: each turn's text is read alone) or
together in one left-padded ``StreamBatch.feed``. Only the reads are timed.

Each arm runs in a fresh process (``--worker alone|together``), arms alternate for --rounds
rounds; the median seconds per arm, their ratio and the largest logit difference between the
two ways (the equivalence a batched prefill would have to keep) are printed as JSON.

Usage: python benchmarks/serve_prefill.py [--model M] [--sessions 8] [--history 320]
       [--new 30] [--n-sink 4] [--window 252] [--rounds 3] [--threads 2] [--out FILE.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sinklab.meta import dumps_json, write_json_atomic


def worker(args: argparse.Namespace) -> dict:
    """One arm: build the sessions (not timed), then read every session's new tokens."""
    import torch

    from sinklab.models.loading import load_model
    from sinklab.stream.cache import CacheConfig
    from sinklab.stream.generation import StreamBatch

    torch.set_num_threads(args.threads)
    model = load_model(args.model).model
    config = CacheConfig("sink", args.n_sink, args.window)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    history = [torch.randint(100, vocab, (args.history,), generator=gen).tolist()
               for _ in range(args.sessions)]  # fmt: skip
    new = [torch.randint(100, vocab, (args.new,), generator=gen).tolist()
           for _ in range(args.sessions)]  # fmt: skip
    # each session's history and turn a different length (the batch is left-padded), histories
    # past n_sink + window (every cache full and evicting as it reads the turn)
    history = [h[: len(h) - 7 * i] for i, h in enumerate(history)]
    new = [ids[: max(1, len(ids) - 3 * i)] for i, ids in enumerate(new)]
    states = []
    with torch.inference_mode():
        for h in history:
            batch = StreamBatch(model, config)
            s = batch.add()
            batch.feed({s: h})
            states.append(batch.state(s))
        # built before the clock: joining rebuilds the batch's cache per stream, which a server
        # building it once from every state would not pay
        alone = []
        if args.worker == "alone":
            for state in states:
                batch = StreamBatch(model, config)
                alone.append((batch, batch.add(state)))
        else:
            together = StreamBatch(model, config)
            rows = [together.add(state) for state in states]
        t0 = time.perf_counter()
        if args.worker == "alone":
            logits = [
                b.feed({s: i}, last_only=True)[s] for (b, s), i in zip(alone, new, strict=True)
            ]
        else:
            out = together.feed(dict(zip(rows, new, strict=True)), last_only=True)
            logits = [out[s] for s in rows]
        seconds = time.perf_counter() - t0
    torch.save(torch.stack(logits), args.logits)
    return {"seconds": seconds}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--history", type=int, default=320)
    p.add_argument("--new", type=int, default=30)
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--window", type=int, default=252)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    p.add_argument("--worker", choices=("alone", "together"), help=argparse.SUPPRESS)
    p.add_argument("--logits", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    import tempfile

    import torch

    sizes = ("sessions", "history", "new", "n_sink", "window", "threads")
    passed = [x for k in sizes for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    passed += ["--model", args.model] if args.model else []
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ("alone", "together") if r % 2 == 0 else ("together", "alone")
            row = {}
            for arm in order:
                logits = str(Path(tmp) / f"{arm}.pt")
                cmd = [sys.executable, __file__, *passed, "--worker", arm, "--logits", logits]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                row[arm] = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
            rounds.append(row)
        a, t = torch.load(Path(tmp) / "alone.pt"), torch.load(Path(tmp) / "together.pt")
        diff = float((a - t).abs().max())
    med = {arm: statistics.median(r[arm] for r in rounds) for arm in ("alone", "together")}
    report = {
        "benchmark": "serve_prefill",
        "params": {k: v for k, v in vars(args).items() if k not in ("worker", "logits")},
        "median_seconds": {k: round(v, 4) for k, v in med.items()},
        "together_over_alone": round(med["together"] / med["alone"], 3),
        "max_abs_logit_diff": diff,
        "rounds": rounds,
        "nproc": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()),
    }
    report["params"]["out"] = str(args.out) if args.out else None
    print(dumps_json(report))
    if args.out:
        write_json_atomic(args.out, report)
    return report


if __name__ == "__main__":
    main()
