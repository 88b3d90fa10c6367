"""Streaming perplexity, presented once: the running-perplexity curve and figure, the block
(segment) perplexity figure, where dense collapses, the summary sentence and the per-policy
lines. ``sinklab stream`` and the report's stream section both call these, reading sizes from the
result's own ``meta.params``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

FIGURE = "running_ppl"
BLOCK_FIGURE = "block_ppl"
COLLAPSE = 2.0  # dense "collapses" in the first block whose PPL exceeds COLLAPSE x sink's


def block_size(tokens: int) -> int:
    """Default targets per entry of ``segment_ppl`` (a point of the block figure): about 40
    points, at least 50 tokens, a multiple of 10."""
    return max(50, int(round(tokens / 40, -1)))


def running_ppl(nll: list[float]) -> list[float]:
    """exp of the running mean of the scored (non-NaN) per-target NLLs: the curve we plot."""
    out, total, n = [], 0.0, 0
    for x in nll:
        if not math.isnan(x):
            total, n = total + x, n + 1
        out.append(math.exp(total / n) if n else math.nan)
    return out


def plot_running_ppl(data: dict[str, Any], folder: Path) -> Path:
    """:func:`running_ppl_figure` as ``folder/running_ppl.png`` + its numbers as JSON."""
    from sinklab import figures

    return figures.save(running_ppl_figure(data), Path(folder) / f"{FIGURE}.png")


def running_ppl_figure(data: dict[str, Any]) -> Any:
    """Running perplexity against tokens, every policy, log scale, the eviction point dashed."""
    from sinklab import figures

    p = data["meta"]["params"]
    names = ", ".join(figures.run_names(data["meta"]))
    pols = data["policies"]
    n = max(len(r["nll"]) for r in pols.values())
    stride = max(1, n // 2000)  # at most ~2000 points per line
    return figures.curves_figure(
        list(range(1, n + 1))[::stride],
        {name: running_ppl(r["nll"])[::stride] for name, r in pols.items()},
        title=f"Streaming perplexity ({names}, n_sink={p['n_sink']}, window={p['window']})",
        xlabel="tokens streamed",
        ylabel="running perplexity (log scale)",
        logy=True,
        vline=p["n_sink"] + p["window"],
    )


def dense_collapse(data: dict[str, Any]) -> dict[str, Any] | None:
    """:func:`collapse_point` of a stream result's JSON (its ``segment`` from ``meta.params``)."""
    return collapse_point(data["policies"], data["meta"]["params"]["segment"])


def collapse_point(pols: dict[str, Any], block: int) -> dict[str, Any] | None:
    """Where dense collapses, by the rule fixed before any number (:data:`COLLAPSE`): the first
    block of ``block`` targets whose dense PPL exceeds COLLAPSE x sink's on the same block
    (``pols``: policy -> its JSON, with ``segment_ppl``). None when either policy is missing;
    ``at_token`` None when dense never collapses.
    :class:`~sinklab.stream.evaluate.StreamResult` writes
    it into every stream's JSON."""
    if "dense" not in pols or "sink" not in pols:
        return None
    dense, sink = pols["dense"]["segment_ppl"], pols["sink"]["segment_ppl"]
    at = next(
        (i for i, (d, s) in enumerate(zip(dense, sink, strict=True)) if d > COLLAPSE * s), None
    )
    return {
        "rule": f"first block of {block} tokens with dense PPL > {COLLAPSE:g} x sink PPL",
        "block": block,
        "at_token": None if at is None else at * block,
        "dense_ppl": None if at is None else dense[at],
        "sink_ppl": None if at is None else sink[at],
    }


def collapse_sentence(data: dict[str, Any]) -> str | None:
    """:func:`dense_collapse`'s verdict (``data["dense_collapse"]``) in one sentence, or None."""
    where = data.get("dense_collapse")
    if not where:
        return None
    if where["at_token"] is None:
        return "Dense does not collapse within this stream by the rule fixed beforehand."
    return (
        f"By the rule fixed beforehand ({where['rule']}), dense collapses at token "
        f"{where['at_token']}."
    )


def plot_block_ppl(data: dict[str, Any], folder: Path) -> Path:
    """:func:`block_ppl_figure` as ``folder/block_ppl.png`` + its numbers as JSON."""
    from sinklab import figures

    return figures.save(block_ppl_figure(data), Path(folder) / f"{BLOCK_FIGURE}.png")


def block_ppl_figure(data: dict[str, Any]) -> Any:
    """Perplexity of each block of ``segment`` targets, every cached policy (recompute, scored on
    every K-th target only, is left out), log scale, the model's trained positions dashed when the
    stream passes them."""
    from sinklab import figures

    block = data["meta"]["params"]["segment"]
    model = data["meta"]["model"] or {}  # None for no model (never for a stream)
    names = ", ".join(figures.run_names(data["meta"]))
    pols = data["policies"]
    cached = {n: r["segment_ppl"] for n, r in pols.items() if r["max_cache_len"] is not None}
    if not cached:  # recompute alone: its blocks, then
        cached = {n: r["segment_ppl"] for n, r in data["policies"].items()}
    n = max(len(v) for v in cached.values())
    max_pos = model.get("max_positions")
    return figures.curves_figure(
        [(i + 1) * block for i in range(n)],
        cached,
        title=f"Perplexity of each {block} tokens ({names})",
        xlabel="tokens streamed",
        ylabel="block perplexity (log)",
        logy=True,
        vline=max_pos if max_pos and max_pos < n * block else None,
    )


def _num(x: float) -> str:
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def stream_sentence(data: dict[str, Any]) -> str | None:
    """Sink against window (and dense, and the oracle on its targets) in one sentence."""
    pol = data["policies"]
    ppl = {k: float(v["ppl"]) for k, v in pol.items()}
    if "sink" not in ppl or "window" not in ppl:
        return None
    params = data["meta"]["params"]
    n_sink, window, tokens = params["n_sink"], params["window"], params["n_tokens"]
    ratio = ppl["window"] / ppl["sink"]
    verdict = "worse" if ratio > 1.05 else "better" if ratio < 0.95 else "about the same"
    out = (
        f"Streaming: {tokens} tokens with {n_sink} sinks + a {window}-token window give "
        f"perplexity {_num(ppl['sink'])}; the same memory without sinks (window only) gives "
        f"{_num(ppl['window'])} ({ratio:.2f}x, {verdict})"
    )
    out += f", and the full dense cache {_num(ppl['dense'])}." if "dense" in ppl else "."
    sub = data.get("on_recompute_targets")
    if sub and "recompute" in sub["ppl"] and "sink" in sub["ppl"]:
        out += (
            f" On the {sub['n_scored']} targets the recompute oracle scored: sink "
            f"{_num(sub['ppl']['sink'])} vs recompute {_num(sub['ppl']['recompute'])}."
        )
    return out


def method_line(data: dict[str, Any]) -> str:
    """The method the stream ran by and why (``method: step (auto: ...)``)."""
    return f"method: {data['method']} ({data['method_reason']})"


def policy_lines(data: dict[str, Any]) -> list[str]:
    """One line per policy (perplexity, speed, memory), then the oracle-target comparison."""
    lines = []
    for name, r in data["policies"].items():
        most = r["max_cache_len"]
        cache = "none (a fresh forward per target)" if most is None else most
        lines.append(
            f"{name:>9}: ppl {r['ppl']:8.2f}  {r['tokens_per_s']:6.1f} tok/s  "
            f"peak RSS {r['peak_rss_mb']:7.0f} MB  max cache {cache}"
        )
    shared = data.get("on_recompute_targets")
    if shared and len(shared.get("ppl", {})) > 1:
        each = ", ".join(f"{k} {v:.2f}" for k, v in shared["ppl"].items())
        lines.append(
            f"on the {shared['n_scored']} targets the oracle scored "
            f"(every {shared['recompute_every']}th): {each}"
        )
    return lines
