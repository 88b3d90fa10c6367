"""Decode speed: sinklab's fast path against float32 and transformers (docs/benchmarks.md#decode).

Arms, each in a fresh process, alternating over rounds, medians:

* ``float32``: sinklab's own loop (``StreamBatch`` on a ``SinkCache``, n_sink + window kept,
  the prompt longer than that, so every step evicts), weights as loaded;
* ``int4``: the same loop after ``sinklab.models.fast.apply(model, "int4")`` (``--quantize
  int4``: the linear layers whose weights already are 4-bit groups on torch's int4 CPU kernel);
* ``int8``: the same loop after ``fast.apply(model, "int8")`` (every linear layer, the head
  included, on per-row int8 weights, torch's int8 CPU kernel);
* ``llama-cpp`` (only with ``--llama-cpp PYTHON``: a venv of its own with ``llama-cpp-python``,
  never a dependency; docs/benchmarks.md#decode says how it was built): llama.cpp on the same
  GGUF the zoo model was dequantized from, the same prompt token ids, greedy, each ``eval`` of
  one token timed; at N = 8, eight contexts in one process each decode one token a step in turn
  (llama-cpp-python's API decodes one sequence per call). It keeps the whole prompt (n_ctx
  1024), as ``dynamic-cache`` does;
* ``dynamic-cache``: plain ``model.generate`` with transformers' ``DynamicCache``, float32,
  greedy, every decode step timed by a streamer (its prefill not counted); it keeps the whole
  prompt, so its tokens differ from the evicting arms' by design.

Per arm and model: ms a token at N = 1 (median over the decode steps of the process, then the
median over rounds) and aggregate tokens/s at N = 8 (8 rows decoding one token a step), with
CPU seconds beside wall seconds. Greedy tokens at N = 1 are recorded, so a fast arm's first
token that differs from float32 is in the output. The CPU's model and flags, nproc and the load
average are recorded. Without ``--llama-cpp`` no llama.cpp figure is measured, and none from
another machine is a ratio of this run.

Usage: python benchmarks/decode.py [--models smollm2-135m,qwen2.5-0.5b] [--arms float32,int4,
       int8,dynamic-cache[,llama-cpp]] [--llama-cpp PYTHON] [--skip MODEL:ARM,...] [--steps 24]
       [--rounds 3] [--prompt 300] [--n-sink 4] [--window 252] [--threads 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sinklab.meta import dumps_json, write_json_atomic

ARMS = ("float32", "int4", "int8", "dynamic-cache", "llama-cpp")
DEFAULT_ARMS = ARMS[:-1]  # llama-cpp runs only where --llama-cpp names its venv
WIDE = 8  # rows of the batched arm


def _prompts(tokenizer, n_rows: int, length: int) -> list[list[int]]:
    from sinklab.corpus import load_text, token_stream

    text = token_stream(load_text(), tokenizer, length + 16 * n_rows).tolist()
    return [text[16 * i : 16 * i + length] for i in range(n_rows)]


def _sinklab(model, prompts: list[list[int]], steps: int, n_sink: int, window: int) -> dict:
    """Decode ``steps`` greedy tokens for every prompt at once: per-step wall and CPU s."""
    from sinklab.stream.cache import CacheConfig
    from sinklab.stream.generation import StreamBatch

    batch = StreamBatch(model, CacheConfig("sink", n_sink, window))
    ids = [batch.add() for _ in prompts]
    logits = batch.feed(dict(zip(ids, prompts, strict=True)), last_only=True)
    nxt = {s: int(x[-1].argmax()) for s, x in logits.items()}
    wall, cpu, tokens = [], [], [nxt[ids[0]]]
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        logits = batch.feed({s: [t] for s, t in nxt.items()}, last_only=True)
        nxt = {s: int(x[-1].argmax()) for s, x in logits.items()}
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        tokens.append(nxt[ids[0]])
    return {
        "step_wall_s": statistics.median(wall),
        "step_cpu_s": statistics.median(cpu),
        "kept": batch.cache.kept_length(),
        "tokens": tokens,
    }


class _Clock:
    """A generate streamer that stamps wall and CPU time at every token it is handed (the
    prompt first, then one batch of tokens a step)."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = []
        self.tokens: list[int] = []

    def put(self, value) -> None:
        self.stamps.append((time.perf_counter(), time.process_time()))
        if len(self.stamps) > 1:
            self.tokens.append(int(value.reshape(-1)[0]))

    def end(self) -> None:
        pass


def _dynamic(model, prompts: list[list[int]], steps: int) -> dict:
    """``model.generate`` with a DynamicCache, greedy: each decode step timed by a streamer
    (the prefill, up to the first new token, is not counted)."""
    import torch
    from transformers import DynamicCache

    x = torch.tensor(prompts)
    clock = _Clock()
    model.generate(
        x,
        attention_mask=torch.ones_like(x),
        past_key_values=DynamicCache(),
        max_new_tokens=steps + 1,
        min_new_tokens=steps + 1,
        do_sample=False,
        pad_token_id=0,
        streamer=clock,
    )
    st = clock.stamps[1:]  # from the first new token on: one stamp a decode step
    wall = [b[0] - a[0] for a, b in itertools.pairwise(st)]
    cpu = [b[1] - a[1] for a, b in itertools.pairwise(st)]
    return {
        "step_wall_s": statistics.median(wall),
        "step_cpu_s": statistics.median(cpu),
        "kept": x.shape[1] + steps,
        "tokens": clock.tokens,
    }


def worker(spec: dict) -> dict:
    """One process, one arm, one model: N = 1 then N = 8."""
    import torch

    if spec["arm"] == "llama-cpp":
        return _llama_cpp(spec)

    from sinklab.models import fast
    from sinklab.models.loading import load_model

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    loaded = load_model(spec["model"])
    path = {"quantize": "none"}
    if spec["arm"] in ("int4", "int8"):
        path = fast.apply(loaded.model, spec["arm"]).to_json()
        path.pop("cpu")
    load_s = time.perf_counter() - t0
    out = {"arm": spec["arm"], "model": spec["model"], "load_s": round(load_s, 2), "path": path}
    with torch.inference_mode():
        for n in (1, WIDE):
            prompts = _prompts(loaded.tokenizer, n, spec["prompt"])
            if spec["arm"] == "dynamic-cache":
                res = _dynamic(loaded.model, prompts, spec["steps"])
            else:
                res = _sinklab(loaded.model, prompts, spec["steps"], spec["n_sink"], spec["window"])
            out[f"n{n}"] = res
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


# run by the llama-cpp venv's python: argv[1] is a JSON spec; prints one JSON line
_LLAMA_SCRIPT = r"""
import json, statistics, sys, time
import llama_cpp
import numpy as np
from llama_cpp import Llama

spec = json.loads(sys.argv[1])
def make():
    return Llama(model_path=spec["gguf"], n_ctx=1024, n_threads=spec["threads"],
                 n_threads_batch=spec["threads"], verbose=False, logits_all=False)
def argmax(llm):
    # the last token's logits (with logits_all=False, Llama.scores is not filled: reading it
    # gave token 0 at every step before 2026-12-06, so the decoded text was not the model's)
    row = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))
    return int(row.argmax())
out = {"version": llama_cpp.__version__}
for n in (1, 8):
    llms = [make() for _ in range(n)]
    nxt = []
    for llm, prompt in zip(llms, spec["prompts"][:n]):
        llm.eval(prompt)
        nxt.append(argmax(llm))
    wall, cpu, tokens = [], [], [nxt[0]]
    for _ in range(spec["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        for i, llm in enumerate(llms):
            llm.eval([nxt[i]])
            nxt[i] = argmax(llm)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        tokens.append(nxt[0])
    out[f"n{n}"] = {"step_wall_s": statistics.median(wall), "step_cpu_s": statistics.median(cpu),
                    "kept": len(spec["prompts"][0]) + spec["steps"], "tokens": tokens}
    del llms
import resource
out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
print(json.dumps(out))
"""


def _llama_cpp(spec: dict) -> dict:
    """The llama-cpp arm: the zoo model's GGUF and the same prompts, run in ``spec["llama_cpp"]``
    (another venv's python)."""
    from sinklab.models.loading import load_model
    from sinklab.models.zoo import ZOO, find_gguf

    t0 = time.perf_counter()
    loaded = load_model(spec["model"])
    gguf = find_gguf(ZOO[spec["model"]])
    if gguf is None:
        raise SystemExit(f"{spec['model']}: no GGUF on this machine for the llama-cpp arm")
    prompts = _prompts(loaded.tokenizer, WIDE, spec["prompt"])
    child = {"gguf": str(gguf), "prompts": prompts, "steps": spec["steps"]}
    child["threads"] = spec["threads"]
    done = subprocess.run(
        [spec["llama_cpp"], "-c", _LLAMA_SCRIPT, json.dumps(child)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    res = json.loads(done.stdout.strip().splitlines()[-1])
    path = {"quantize": "gguf", "gguf": gguf.name, "llama_cpp_python": res.pop("version")}
    load_s = round(time.perf_counter() - t0, 2)
    return {"arm": "llama-cpp", "model": spec["model"], "load_s": load_s, "path": path} | res


def _peak_rss_mb() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def summarize(runs: list[dict]) -> dict:
    """Medians over rounds per (model, arm), the ratios the goals are stated in, and the first
    greedy token at N = 1 where each arm leaves float32's."""
    table: dict = {}
    for model in dict.fromkeys(r["model"] for r in runs):
        rows = {}
        for arm in dict.fromkeys(r["arm"] for r in runs if r["model"] == model):
            mine = [r for r in runs if r["model"] == model and r["arm"] == arm]

            def med(key: str, n: int, mine: list[dict] = mine) -> float:
                return statistics.median(r[f"n{n}"][key] for r in mine)

            rows[arm] = {
                "ms_per_token_n1": round(1e3 * med("step_wall_s", 1), 2),
                "cpu_ms_per_token_n1": round(1e3 * med("step_cpu_s", 1), 2),
                "tokens_per_s_n8": round(WIDE / med("step_wall_s", WIDE), 2),
                "cpu_ms_per_step_n8": round(1e3 * med("step_cpu_s", WIDE), 2),
                "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in mine),
                "load_s": statistics.median(r["load_s"] for r in mine),
                "path": mine[0]["path"],
                "tokens_n1": mine[0]["n1"]["tokens"],
            }
        base = rows.get("float32")
        for row in rows.values():
            if base is not None:
                row["first_token_unlike_float32"] = _first_difference(
                    row["tokens_n1"], base["tokens_n1"]
                )
                row["speedup_n1_vs_float32"] = round(
                    base["ms_per_token_n1"] / row["ms_per_token_n1"], 3
                )
            if (dyn := rows.get("dynamic-cache")) is not None:
                row["speedup_n1_vs_dynamic_cache"] = round(
                    dyn["ms_per_token_n1"] / row["ms_per_token_n1"], 3
                )
        table[model] = rows
    return table


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS))
    p.add_argument("--llama-cpp", default="", help="python of a venv with llama-cpp-python")
    p.add_argument("--skip", default="", help="MODEL:ARM pairs not to run, e.g. qwen2.5-0.5b:int4")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--window", type=int, default=252)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return {}
    from sinklab.models.fast import cpu_facts

    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    if "llama-cpp" in arms and not args.llama_cpp:
        p.error("the llama-cpp arm needs --llama-cpp PYTHON (a venv with llama-cpp-python)")
    models = [m for m in args.models.split(",") if m]
    keys = ("prompt", "steps", "n_sink", "window", "threads")
    runs: list[dict] = []
    load_before = list(os.getloadavg())
    start = time.perf_counter()
    for r in range(args.rounds):
        order = arms if r % 2 == 0 else arms[::-1]
        for model in models:
            for arm in order:
                if f"{model}:{arm}" in args.skip.split(","):
                    continue
                spec = {k: getattr(args, k) for k in keys} | {"model": model, "arm": arm}
                spec["llama_cpp"] = args.llama_cpp
                cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
                t0, c0 = time.perf_counter(), os.times()
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                res = json.loads(done.stdout.strip().splitlines()[-1])
                c1 = os.times()
                res["round"] = r
                res["process_wall_s"] = round(time.perf_counter() - t0, 2)
                res["process_cpu_s"] = round(
                    c1.children_user - c0.children_user + c1.children_system - c0.children_system,
                    2,
                )
                res["load_average"] = list(os.getloadavg())
                runs.append(res)
                print(f"round {r} {model} {arm}: done", file=sys.stderr)
    import torch
    import transformers

    report = {
        "benchmark": "decode",
        "params": {k: getattr(args, k) for k in keys}
        | {"models": models, "arms": arms, "skip": args.skip},
        "rounds": args.rounds,
        "summary": summarize(runs),
        "machine": cpu_facts() | {"nproc": os.cpu_count()},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average_before": load_before,
        "load_average_at_end": list(os.getloadavg()),
        "seconds": round(time.perf_counter() - start, 1),
        "runs": runs,
    }
    print(dumps_json(report))
    if args.out:
        write_json_atomic(args.out, report)
    return report


if __name__ == "__main__":
    main()
