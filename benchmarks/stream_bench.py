"""Benchmark ``sinklab stream``'s caches on SmolLM2: perplexity, ms/token and peak RSS per policy,
sink decode against plain ``DynamicCache`` at the same cache length, and the peers a user would
pick instead (attention-sinks 0.4.0, kvpress 0.5.5), each in its own venv made here.

Every policy runs through the library's own loop (``stream.evaluate.run_policy``: the protocol,
the oracle, the NLL and sink-auto's prefix rule are sinklab's, so these numbers cannot drift from
``sinklab stream``), ``--method step`` (default: one token per forward, the ms/token a decoder
sees) or ``chunked``. Every measured run is a fresh process (``--worker SPEC``). Sizes are
arguments (the full protocol, as run for benchmarks/results/2026-11-30/stream-soak-100k.json, is
``--tokens 20000 --soak-tokens 100000``: hours on 2 cores with step). Prints one JSON object.

    python benchmarks/stream_bench.py --tokens 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = Path(os.environ.get("SINKLAB_BENCH_DIR", "/tmp/sinklab-bench"))
PEERS = {  # name -> (pip packages, worker script)
    "attention-sinks": (["attention-sinks==0.4.0", "einops"], "stream_peer_attention_sinks.py"),
    "kvpress": (["kvpress==0.5.5"], "stream_peer_kvpress.py"),
}


# ------------------------------------------------------------------------- worker side
def _median_ms(ms: list[float], lo: int, hi: int) -> float | None:
    part = ms[max(0, lo) : max(0, hi)]
    return round(statistics.median(part), 2) if part else None


def summarize(nll: list[float], ms: list[float], rss: dict, n_tokens: int) -> dict:
    """ms/token at 1k (median of targets 900..1100) and at the end (last 200 scored)."""
    scored = [x for x in nll if x == x]
    return {
        "ppl": math.exp(sum(scored) / len(scored)) if scored else None,
        "n_scored": len(scored),
        "ms_per_token_at_1k": _median_ms(ms, 900, 1100) if n_tokens > 1000 else None,
        "ms_per_token_at_end": _median_ms(ms, len(ms) - 200, len(ms)),
        "peak_rss_mb": rss,
    }


def decode_worker(spec: dict, model, ids) -> dict:
    """ms/token at a fixed cache length: sink vs transformers' DynamicCache (one token a step)."""
    import torch
    from transformers import DynamicCache

    from sinklab.stream.cache import CacheConfig, SinkCache

    n_sink, window, ms = spec["n_sink"], spec["window"], []
    steps, length = spec["steps"], n_sink + window
    with torch.inference_mode():
        if spec["cache"] == "sink":
            cache = SinkCache(model, CacheConfig("sink", n_sink, window))
            model(ids[:length].view(1, -1), cache=cache)  # prefill: the cache is full
            start = length  # every decode step now evicts one position
        else:
            cache = DynamicCache()
            start = length - steps // 2  # the decode steps straddle `length`
            model(ids[:start].view(1, -1), cache=cache)
        for t in range(start, start + steps + 8):
            t0 = time.perf_counter()
            model(ids[t : t + 1].view(1, 1), cache=cache)
            ms.append((time.perf_counter() - t0) * 1e3)
    ms = ms[8:]  # warm-up
    return {
        "ms_per_token": round(statistics.median(ms), 2),
        "steps": steps,
        "cache_len": length,
        "cache": spec["cache"],
    }


def _dynamic_cache_loop(model, ids, out, tick) -> int:
    """The peer baseline: transformers' own DynamicCache, one token per forward, scored with
    the library's NLL. -> the cache length at the end."""
    import torch
    from transformers import DynamicCache

    from sinklab.stream.evaluate import _target_nll

    cache, n = DynamicCache(), ids.numel() - 1
    with torch.inference_mode():
        for t in range(n):
            logits = model(ids[t : t + 1].view(1, 1), cache=cache).logits[0, -1]
            out[t] = _target_nll(logits, int(ids[t + 1]))
            tick(t + 1, n, "")
    return int(cache.layers[0].keys.shape[-2])


def worker(spec: dict) -> dict:
    """One measurement. ``kind`` decode: :func:`decode_worker`; stream: one policy through the
    library's own loop (:func:`~sinklab.stream.evaluate.run_policy`:
    protocol, oracle, NLL, sink-auto's
    prefix rule), ``method`` step (default) or chunked, timed between its progress reports."""
    import torch

    from sinklab.models.loading import load_model
    from sinklab.stream.evaluate import StreamConfig, rss_mb, run_policy

    torch.set_num_threads(spec["threads"])
    model = load_model(spec.get("model")).model
    ids = torch.tensor(json.loads(Path(spec["ids"]).read_text()))
    if spec["kind"] == "decode":
        return decode_worker(spec, model, ids)
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731
    policy, n = spec["policy"], ids.numel() - 1
    method = spec.get("method", "step")
    every = spec.get("recompute_every", 1) if policy == "recompute" else 1
    buf = torch.full((n,), math.nan, dtype=torch.float64)
    ms: list[float] = []  # per token (recompute: per scored target)
    marks: dict[str, float] = {}
    curve: list[tuple] = []
    checkpoints: list[dict] = []
    block = spec.get("block", 1000)  # tests use a shorter block
    blocks: list[tuple] = []  # (tokens, median ms, load, PPL) of each block of tokens
    marks_at = set(spec.get("checkpoints", []))
    last = {"done": 0, "at": time.perf_counter()}

    def tick(done: int, total: int, note: str) -> None:
        now = time.perf_counter()
        units = len(range(last["done"], done, every)) if every > 1 else done - last["done"]
        ms.extend([(now - last["at"]) * 1e3 / max(1, units)] * units)
        crossed = range(last["done"] + 1, done + 1)
        last.update(done=done, at=now)
        nll = buf[:done].tolist()
        for t in crossed if policy != "recompute" else ():
            if t == 2000:
                marks["2000"] = rss()
            if spec.get("curve_every") and t % spec["curve_every"] == 0:
                curve.append((t, round(rss(), 1), round(rss_mb(), 1)))
            if t in marks_at:  # figures over the first t tokens, as if the run ended here
                checkpoints.append(
                    {"tokens": t, **summarize(nll[:t], ms[:t], {"now": rss()}, t)}
                    | {"loadavg_1m": os.getloadavg()[0]}
                )
            if t % block == 0:  # a timeline, to set beside runs made at the same time
                seg = math.exp(statistics.fmean(x for x in nll[t - block : t] if x == x))
                blocks.append((t, round(statistics.median(ms[t - block : t]), 2),
                               os.getloadavg()[0], seg))  # fmt: skip
        if spec.get("progress") and any(t in marks_at or t % block == 0 for t in crossed):
            write_progress(spec["progress"], done, nll, ms, curve, checkpoints, blocks)

    config = StreamConfig(
        (policy if policy != "dynamic-cache" else "dense",),
        spec["n_sink"],
        spec["window"],
        max(2, ids.numel()),
        recompute_every=every,
        probe_tokens=spec.get("probe_tokens", 256),
        method=method,
        chunk=spec.get("chunk", 256),
    )
    t_start, cpu_start = time.perf_counter(), time.process_time()
    if policy == "dynamic-cache":
        most, sinks = _dynamic_cache_loop(model, ids, buf, tick), None
    else:
        with torch.inference_mode():
            _, most, _, sinks = run_policy(model, ids, config, policy, tick, buf, period=1)
    seconds = time.perf_counter() - t_start
    cpu_s = round(time.process_time() - cpu_start, 1)  # the machine may be shared: CPU time too
    nll = buf.tolist()
    if policy == "recompute":
        scored = [t for t in range(n) if nll[t] == nll[t]]
        save_nll(spec, [t + 1 for t in scored], [nll[t] for t in scored])
        res = summarize(nll, ms, {"end": rss()}, n)
        res["ms_per_token_at_1k"] = _median_ms(ms, 900 // every, 1100 // every + 1)
        res.update(recompute_every=every, method=method, seconds=round(seconds, 1), cpu_s=cpu_s)
        return res
    save_nll(spec, list(range(1, n + 1)), nll)
    res = summarize(nll, ms, {**{k: v for k, v in marks.items() if k == "2000"}, "end": rss()}, n)
    res.update(max_cache_len=most, method=method, seconds=round(seconds, 1), cpu_s=cpu_s)
    if sinks is not None:
        res["sink_positions"] = list(sinks)
    if curve:
        res["rss_curve"] = curve
    if checkpoints:
        res["checkpoints"] = checkpoints
    if blocks:
        res["ms_per_1000"] = blocks
    return res


def save_nll(spec: dict, targets: list[int], nll: list[float]) -> None:
    """Per-target NLLs (nats) to ``spec["nll_file"]``, to compare runs on shared targets."""
    if spec.get("nll_file"):
        Path(spec["nll_file"]).write_text(json.dumps({"targets": targets, "nll": nll}))


def same_targets(a_file: Path, b_file: Path) -> dict:
    """PPL of two runs on the targets both scored (e.g. sink on the recompute oracle's sample)."""
    a, b = (json.loads(Path(f).read_text()) for f in (a_file, b_file))
    na = dict(zip(a["targets"], a["nll"], strict=True))
    nb = dict(zip(b["targets"], b["nll"], strict=True))
    common = sorted(set(na) & set(nb))
    ppl_a = math.exp(statistics.fmean(na[t] for t in common))
    ppl_b = math.exp(statistics.fmean(nb[t] for t in common))
    return {"n_targets": len(common), "ppl_a": ppl_a, "ppl_b": ppl_b, "ratio": ppl_a / ppl_b}


def write_progress(path: str, done: int, nll, ms, curve, checkpoints, blocks) -> None:
    """Partial results of a long worker, rewritten atomically, so an interrupted run still tells."""
    tmp = Path(path + ".tmp")
    summary = summarize(nll, ms, {}, done)
    tmp.write_text(
        json.dumps(
            {
                "done": done,
                **summary,
                "rss_curve": curve,
                "checkpoints": checkpoints,
                "ms_per_1000": blocks,
                "loadavg_1m": os.getloadavg()[0],
            }
        )
    )
    tmp.replace(path)


# ------------------------------------------------------------------------- figure
def plot_report(reports: list[dict], path: Path) -> None:
    """One figure from one or more reports: PPL of each 1000 tokens (log), ms/token timeline,
    and the soak's RSS curve (peak and current)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, dict] = {}
    for rep in reports:
        for name, res in rep.get("policies", {}).items():
            runs[name] = res
        for name, res in rep.get("peers", {}).items():
            if isinstance(res, dict):
                runs[name] = res
        if "soak" in rep:
            runs["sink (soak)"] = rep["soak"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    for i, (name, res) in enumerate(runs.items()):
        color, blocks = f"C{i}", res.get("ms_per_1000") or []
        if blocks:
            x = [blk[0] for blk in blocks]
            label = f"{name} (PPL {res['ppl']:.2f})"
            a.plot(x, [blk[3] for blk in blocks], color=color, label=label)
            b.plot(x, [blk[1] for blk in blocks], color=color, label=name)
        elif res.get("ppl"):
            label = f"{name} (PPL {res['ppl']:.2f}, overall)"
            a.axhline(res["ppl"], ls=":", lw=1, color=color, label=label)
    a.set(yscale="log", xlabel="tokens streamed", ylabel="PPL of each 1000 tokens")
    b.set(xlabel="tokens streamed", ylabel="median ms/token of each 1000")
    soak = runs.get("sink (soak)", {})
    if soak.get("rss_curve"):
        x = [r[0] for r in soak["rss_curve"]]
        c.plot(x, [r[1] for r in soak["rss_curve"]], label="peak RSS")
        if len(soak["rss_curve"][0]) > 2:
            c.plot(x, [r[2] for r in soak["rss_curve"]], label="current RSS")
        c.set_ylim(0, 1.15 * max(max(r[1:]) for r in soak["rss_curve"]))  # flat means flat
    c.set(xlabel="tokens streamed", ylabel="MB", title="sink soak: memory")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------- driver side
def run_worker(spec: dict, python: str = sys.executable) -> dict:
    """One measurement in a fresh process."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [python, str(Path(__file__)), "--worker", json.dumps(spec)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def ensure_peer_venv(name: str) -> tuple[Path | None, str | None]:
    """Make /tmp/sinklab-bench-NAME with torch==2.13.0 (the local CPU wheel) then the peer."""
    venv = Path(f"/tmp/sinklab-bench-{name}")
    py = venv / "bin" / "python"
    stamp = venv / ".sinklab-ok"
    if stamp.exists():
        return py, None
    log = Path(f"{venv}.log")
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        with open(log, "a") as f:
            for pkgs in (["torch==2.13.0"], PEERS[name][0]):
                subprocess.run(
                    [str(py), "-m", "pip", "install", "-q", *pkgs],
                    check=True,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
        stamp.touch()
        return py, None
    except (subprocess.CalledProcessError, OSError) as exc:
        tail = log.read_text().strip().splitlines()[-3:] if log.exists() else []
        return None, f"could not install {name}: {exc}; {' | '.join(tail)}"


def peer_model_dir() -> Path:
    """The dequantized SmolLM2 with a config transformers 4.34 can read (``rope_theta``)."""
    from sinklab.models.checkpoint import dequantize, smollm2_gguf_path
    from sinklab.models.zoo import SMOLLM2, file_sha256

    gguf = smollm2_gguf_path()
    src = dequantize(SMOLLM2, gguf, file_sha256(gguf))
    dst = WORK / "smollm2-peer"
    if not (dst / "config.json").exists():
        shutil.copytree(src, dst, dirs_exist_ok=True)
        cfg = json.loads((dst / "config.json").read_text())
        cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
        cfg["torch_dtype"] = "float32"
        (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def run_peer(name: str, ids_file: Path, args) -> dict:
    py, err = ensure_peer_venv(name)
    if err:
        return {"error": err}
    cmd = [
        str(py),
        str(HERE / PEERS[name][1]),
        str(peer_model_dir()),
        str(ids_file),
        str(args.n_sink),
        str(args.window),
        str(args.threads),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": " | ".join(proc.stderr.strip().splitlines()[-3:])}
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    out = summarize(raw["nll"], raw["ms"], raw["peak_rss_mb"], len(raw["nll"]))
    out.update(
        max_cache_len=raw["max_cache_len"],
        versions=raw["versions"],
        wall_s=round(time.perf_counter() - t0, 1),
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--policies", default="sink,window,dense,recompute,sink-auto,dynamic-cache")
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=508)
    ap.add_argument("--recompute-every", type=int, default=20)
    ap.add_argument(
        "--method", choices=("step", "chunked"), default="step",
        help="the library loop each policy runs through (chunked: same NLLs, ~20x faster)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="decode pairs, alternating A B")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--peers", default="attention-sinks,kvpress", help="'' to skip")
    ap.add_argument("--peer-tokens", type=int, default=None, help="default: --tokens")
    ap.add_argument(
        "--no-peer-sink", action="store_true", help="skip the sink run beside the peers"
    )
    ap.add_argument("--soak-tokens", type=int, default=0, help="sink soak with an RSS curve")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="also write the report here, after every stage")
    ap.add_argument(
        "--plot", nargs="+", type=Path, metavar="JSON", help="only draw reports into --out (PNG)"
    )
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.plot:
        if not args.out:
            raise SystemExit("--plot needs --out FILE.png")
        plot_report([json.loads(f.read_text()) for f in args.plot], args.out)
        return

    import torch
    import transformers

    from sinklab.corpus import load_text, token_stream
    from sinklab.models.loading import load_model

    WORK.mkdir(parents=True, exist_ok=True)
    tok = load_model().tokenizer
    longest = max(args.tokens, args.soak_tokens, args.peer_tokens or 0)
    ids = token_stream(load_text(), tok, longest).tolist()
    files = {}
    for n in {args.tokens, args.peer_tokens or args.tokens, args.soak_tokens}:
        if n:
            files[n] = WORK / f"ids-{n}.json"
            files[n].write_text(json.dumps(ids[:n]))
    base = {"n_sink": args.n_sink, "window": args.window, "threads": args.threads}
    report: dict = {
        "what": "SmolLM2-135M fp32, default corpus from its first token, no BOS",
        "params": vars(args) | {"worker": None, "out": str(args.out) if args.out else None},
        "machine": {"nproc": os.cpu_count(), "torch_threads": args.threads},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "policies": {},
    }

    def save() -> None:
        if args.out:
            tmp = args.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            tmp.replace(args.out)

    marks = sorted({n for n in (1000, 2000, 5000, 10000, 20000, 50000) if n < args.tokens})
    for policy in [p for p in args.policies.split(",") if p]:
        spec = base | {
            "kind": "stream",
            "policy": policy,
            "method": args.method,
            "ids": str(files[args.tokens]),
            "recompute_every": args.recompute_every,
            "checkpoints": marks,
            "progress": str(WORK / f"progress-{policy}.json"),
            "nll_file": str(WORK / f"nll-{policy}.json"),
        }
        report["policies"][policy] = run_worker(spec)
        print(f"{policy}: {report['policies'][policy]}", file=sys.stderr)
        save()
    done = report["policies"]
    if all("ppl" in done.get(p, {}) for p in ("sink", "recompute")):
        cmp = same_targets(WORK / "nll-sink.json", WORK / "nll-recompute.json")
        report["sink_vs_recompute"] = {
            "n_targets": cmp["n_targets"],
            "sink_ppl": cmp["ppl_a"],
            "recompute_ppl": cmp["ppl_b"],
            "ratio": cmp["ratio"],
        }
    save()
    pairs: dict[str, list[float]] = {"sink": [], "dynamic-cache": []}
    for _ in range(args.rounds):
        for cache in pairs:
            r = run_worker(
                base
                | {
                    "kind": "decode",
                    "cache": cache,
                    "steps": args.decode_steps,
                    "ids": str(files[args.tokens]),
                }
            )
            if "ms_per_token" not in r:
                raise SystemExit(f"decode worker ({cache}) failed: {r}")
            pairs[cache].append(r["ms_per_token"])
    med = {k: statistics.median(v) if v else None for k, v in pairs.items()}
    report["decode_at_same_length"] = {
        "cache_len": args.n_sink + args.window,
        "rounds_ms": pairs,
        "median_ms": med,
        "ratio_sink_over_dynamic": round(med["sink"] / med["dynamic-cache"], 3)
        if all(med.values())
        else None,
    }
    if args.peers:
        n = args.peer_tokens or args.tokens
        report["peers"] = {"tokens": n}
        for name in args.peers.split(","):
            report["peers"][name] = run_peer(name, files[n], args)
            print(f"{name}: {report['peers'][name]}", file=sys.stderr)
            save()
        if not args.no_peer_sink and (n != args.tokens or "sink" not in report["policies"]):
            report["peers"]["sink_same_run"] = run_worker(
                base | {"kind": "stream", "policy": "sink", "ids": str(files[n])}
            )
    if args.soak_tokens:
        report["soak"] = run_worker(
            base
            | {
                "kind": "stream",
                "policy": "sink",
                "ids": str(files[args.soak_tokens]),
                "curve_every": max(1, args.soak_tokens // 50),
                "checkpoints": [1000, 2000, 5000, 10000, 20000, 50000],
                "progress": str(WORK / "progress-soak.json"),
            }
        )
        save()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
