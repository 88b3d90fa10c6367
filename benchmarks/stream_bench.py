"""Benchmark ``sinklab stream``'s caches on SmolLM2: perplexity, ms/token and peak RSS per policy,
sink decode against plain ``DynamicCache`` at the same cache length, and the peers a user would
pick instead (attention-sinks 0.4.0, kvpress 0.5.5), each in its own venv made here.

Every measured run is a fresh process (``--worker SPEC``). Sizes are arguments (the issue's full
protocol is ``--tokens 20000 --soak-tokens 100000``: hours on 2 cores). Prints one JSON object.

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


def method_worker(spec: dict) -> dict:
    """One policy by ``spec["method"]`` (step | chunked) through the library's own loop; the
    per-token NLLs so far go to ``spec["progress"]`` every ``spec["every"]`` tokens (atomically)."""
    import torch

    from sinklab.cache import CacheConfig
    from sinklab.chunked import chunked_nll
    from sinklab.models import load_model
    from sinklab.streaming import rss_mb, stream_nll

    torch.set_num_threads(spec["threads"])
    model = load_model(spec.get("model")).model
    ids = torch.tensor(json.loads(Path(spec["ids"]).read_text()))
    cfg = CacheConfig(spec["policy"], spec["n_sink"], spec["window"])
    nll = torch.full((ids.numel() - 1,), math.nan, dtype=torch.float64)
    start, every, last = time.perf_counter(), spec.get("every", 500), [0]

    def tick(done: int, n: int, ppl: float) -> None:
        if spec.get("progress") and (done - last[0] >= every or done == n):
            last[0] = done
            tmp = Path(spec["progress"] + ".tmp")
            seconds = time.perf_counter() - start
            tmp.write_text(
                json.dumps(
                    {
                        "done": done,
                        "seconds": seconds,
                        "nll": nll[:done].tolist(),
                        "loadavg_1m": os.getloadavg()[0],
                    }
                )
            )
            tmp.replace(spec["progress"])

    if spec["method"] == "step":
        _, most, peak = stream_nll(model, ids, cfg, tick, out=nll)
    else:
        got, most, peak = chunked_nll(model, ids, cfg, spec.get("chunk", 256), None, rss_mb)
        nll[:] = got
        tick(nll.numel(), nll.numel(), 0.0)
    seconds = time.perf_counter() - start
    save_nll(spec, list(range(1, nll.numel() + 1)), nll.tolist())
    return {
        "method": spec["method"],
        "policy": spec["policy"],
        "ppl": math.exp(float(nll.mean())),
        "n_scored": nll.numel(),
        "seconds": round(seconds, 1),
        "ms_per_token": round(1e3 * seconds / nll.numel(), 2),
        "max_cache_len": most,
        "peak_rss_mb": {
            "sampled": round(peak, 1),
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        },
        "loadavg_1m_end": os.getloadavg()[0],
    }


def worker(spec: dict) -> dict:
    if spec.get("kind") == "method":
        return method_worker(spec)
    import torch
    from transformers import DynamicCache

    from sinklab.cache import CacheConfig, SinkCache, kept_positions
    from sinklab.models import load_model
    from sinklab.streaming import choose_sinks, rss_mb

    torch.set_num_threads(spec["threads"])
    model = load_model(spec.get("model")).model
    ids = torch.tensor(json.loads(Path(spec["ids"]).read_text()))
    n_sink, window, kind = spec["n_sink"], spec["window"], spec["kind"]
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731
    nll: list[float] = []
    ms: list[float] = []
    marks: dict[str, float] = {}
    curve: list[tuple[int, float]] = []
    with torch.inference_mode():
        if kind == "decode":  # ms/token at a fixed cache length: sink vs DynamicCache
            steps, length = spec["steps"], n_sink + window
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
        policy = spec["policy"]
        n = ids.numel() - 1
        every = spec.get("recompute_every", 1) if policy == "recompute" else 1
        if policy == "recompute":
            for t in range(0, n, every):
                ctx = [*kept_positions(t, tuple(range(n_sink)), window), t]
                t0 = time.perf_counter()
                out = model(ids[ctx].view(1, -1), use_cache=False, logits_to_keep=1)
                ms.append((time.perf_counter() - t0) * 1e3)
                lg = out.logits[0, -1].float()
                nll.append(float(torch.logsumexp(lg, -1) - lg[ids[t + 1]]))
            res = summarize(nll, ms, {"end": rss()}, n)
            res["ms_per_token_at_1k"] = _median_ms(ms, 900 // every, 1100 // every + 1)
            res["recompute_every"] = every
            save_nll(spec, [t + 1 for t in range(0, n, every)], nll)
            return res
        if policy == "dynamic-cache":
            cache = DynamicCache()
        else:
            sinks = None
            if policy == "sink-auto":
                sinks = choose_sinks(model, ids[: min(256, n_sink + window)], n_sink)
                marks["sink_positions"] = list(sinks)
            cache = SinkCache(model, CacheConfig(policy, n_sink, window, sinks))
        checkpoints: list[dict] = []
        block = spec.get("block", 1000)  # tests use a shorter block
        blocks: list[tuple] = []  # (tokens, median ms, load, PPL) of each block of tokens
        marks_at = set(spec.get("checkpoints", []))
        for t in range(n):
            t0 = time.perf_counter()
            out = model(ids[t : t + 1].view(1, 1), cache=cache)
            ms.append((time.perf_counter() - t0) * 1e3)
            lg = out.logits[0, -1].float()
            nll.append(float(torch.logsumexp(lg, -1) - lg[ids[t + 1]]))
            if t + 1 == 2000:
                marks["2000"] = rss()
            if spec.get("curve_every") and (t + 1) % spec["curve_every"] == 0:
                curve.append((t + 1, round(rss(), 1), round(rss_mb(), 1)))
            if t + 1 in marks_at:  # figures over the first t+1 tokens, as if the run ended here
                checkpoints.append(
                    {"tokens": t + 1, **summarize(nll, ms, {"now": rss()}, t + 1)}
                    | {"loadavg_1m": os.getloadavg()[0]}
                )
            if (t + 1) % block == 0:  # a timeline, to set beside runs made at the same time
                seg = math.exp(statistics.fmean(x for x in nll[-block:] if x == x))
                blocks.append(
                    (t + 1, round(statistics.median(ms[-block:]), 2), os.getloadavg()[0], seg)
                )
            if spec.get("progress") and (t + 1 in marks_at or (t + 1) % block == 0):
                write_progress(spec["progress"], t + 1, nll, ms, curve, checkpoints, blocks)
        save_nll(spec, list(range(1, n + 1)), nll)
        res = summarize(
            nll, ms, {**{k: v for k, v in marks.items() if k == "2000"}, "end": rss()}, n
        )
        res["max_cache_len"] = (
            int(cache.layers[0].keys.shape[-2])
            if policy == "dynamic-cache"
            else cache.kept_length()
        )
        if "sink_positions" in marks:
            res["sink_positions"] = marks["sink_positions"]
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
    from sinklab.models import _smollm2_cached_folder, file_sha256, smollm2_gguf_path

    gguf = smollm2_gguf_path()
    src = _smollm2_cached_folder(gguf, file_sha256(gguf))
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
    from sinklab.models import load_model

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
