"""``sinklab stream``: streaming perplexity per cache policy, its JSON and running-PPL figure."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sinklab.cache import POLICIES
from sinklab.commands.common import (
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    NSinkOpt,
    TextOpt,
    TrustOpt,
    WindowOpt,
    check_positions,
    split_list,
    stderr,
)
from sinklab.errors import SinklabError

PolicyOpt = Annotated[
    str,
    typer.Option(
        "--policy",
        "-p",
        help=f"One of {', '.join(POLICIES)}, a comma-separated list, or 'all'.",
    ),
]


def parse_policies(value: str) -> tuple[str, ...]:
    """'all' | 'sink' | 'window,sink' -> the policies, validated."""
    names = (
        list(POLICIES) if value.strip() == "all" else split_list(value, "--policy", "sink,window")
    )
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise SinklabError(
            f"unknown policy {', '.join(bad) or repr(value)}; choose from "
            f"{', '.join(POLICIES)} or 'all'"
        )
    return tuple(dict.fromkeys(names))


def stream(
    model: ModelOpt = None,
    text: TextOpt = None,
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Tokens to stream.")] = 2000,
    policy: PolicyOpt = "all",
    n_sink: NSinkOpt = 4,
    window: WindowOpt = 508,
    recompute_every: Annotated[
        int,
        typer.Option(
            "--recompute-every",
            help="Score the (slow) recompute oracle on every K-th target only.",
        ),
    ] = 20,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Folder for stream.json + figure.")
    ] = Path("sinklab-stream"),
    trust_remote_code: TrustOpt = False,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    method: Annotated[
        str,
        typer.Option(
            "--method",
            help="chunked: many tokens per forward, same NLLs as step; step: one token per "
            "forward (the reference, ~20x slower).",
        ),
    ] = "chunked",
) -> None:
    """Streaming perplexity, StreamingLLM's protocol: read one token, score the next, evict.

    Writes OUT/stream.json (meta; per policy ppl, segment_ppl, nll, tokens_per_s, peak_rss_mb,
    max_cache_len) and OUT/running_ppl.png (+ .json). ``--method step`` (one token per forward,
    ~65 ms per token per policy on SmolLM2 with 2 cores) and the default ``chunked`` give the same
    NLLs.

    Example: sinklab stream --policy window,sink --tokens 4000 --n-sink 4 --window 508
    """

    from sinklab.cache import CacheConfig, SinkCache
    from sinklab.corpus import load_text, token_stream
    from sinklab.meta import attach_meta
    from sinklab.models import load_model
    from sinklab.outputs import check_out, write_results
    from sinklab.stream_summary import plot_running_ppl, policy_lines
    from sinklab.streaming import StreamConfig, streaming_perplexity

    # cheap checks first: sizes, policies and the text fail before the model loads
    config = StreamConfig(
        parse_policies(policy), n_sink, window, tokens, recompute_every, method=method
    )
    out = check_out(out, "stream")
    txt = load_text(text)
    with stderr.status("loading model"):
        loaded = load_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        if "dense" in config.policies:
            check_positions(loaded.info, tokens, "--tokens", " (the dense policy keeps them all)")
        if moving := [p for p in config.policies if p in ("window", "sink", "sink-auto")]:
            policy_check = "window" if moving == ["window"] else "sink"  # dense moves no key
            SinkCache(loaded.model, CacheConfig(policy_check, n_sink, window))  # can it stream?
        ids = token_stream(txt, loaded.tokenizer, tokens)
    columns = (
        TextColumn("[bold]{task.description:>9}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:>8} tok/s  ppl {task.fields[ppl]:>8}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=stderr, transient=False, disable=not stderr.is_terminal) as bar:
        tasks = {
            p: bar.add_task(p, total=tokens - 1, rate="", ppl="", start=False)
            for p in config.policies
        }

        def callback(pol: str, done: int, total: int, ppl: float) -> None:
            task = bar.tasks[tasks[pol]]
            if task.start_time is None:  # the clock starts with the policy's first tokens
                bar.start_task(tasks[pol])
            elapsed = task.elapsed or 0.0
            scored = done / (recompute_every if pol == "recompute" else 1)
            rate = f"{scored / elapsed:.1f}" if elapsed > 0 else ""
            bar.update(tasks[pol], completed=done, rate=rate, ppl=f"{ppl:.2f}")

        start = time.perf_counter()
        result = streaming_perplexity(loaded.model, ids, config, callback)
    data = attach_meta(result, loaded.info, txt, config, time.perf_counter() - start).to_json()
    written = write_results(
        out, "stream", {"stream.json": data}, lambda folder: [plot_running_ppl(data, folder)]
    )
    for line in policy_lines(data):
        stderr.print(line, highlight=False)
    stderr.print("wrote " + " and ".join(map(str, written)))


def register(app: typer.Typer) -> None:
    app.command("stream")(stream)
