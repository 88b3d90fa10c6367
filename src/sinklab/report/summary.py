"""Headline sentences computed from the stages' numbers (never hand-written).

Each sentence function reads one stage's JSON and returns a sentence, or None when that stage did
not run or lacks the numbers; the headline is the sentences that could be computed, in reading
order: sink rate, where sinks start (depth, position, length), streaming, ablations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from sinklab.report.stages import ReportConfig, StageResult

log = logging.getLogger(__name__)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _num(x: float) -> str:
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _ranges(layers: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    start = prev = None
    for x in sorted(layers):
        if start is None:
            start = prev = x
        elif x == prev + 1:
            prev = x
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = x
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out)


def _eps(data: dict[str, Any]) -> list[float]:
    """The thresholds the result was computed with (its own ``meta.params.eps``), main first."""
    return [float(e) for e in data["meta"]["params"]["eps"]]


def sink_rate_sentence(probe: dict[str, Any], config: ReportConfig) -> str:
    mass = probe["sink_mass"]
    n_heads = sum(len(row) for row in mass)
    rate = probe["sink_rate"]
    params = probe["meta"]["params"]
    main, *stricter = _eps(probe)
    also = "".join(f" ({_pct(rate[f'{e:g}'])} put more than {e:g})" for e in stricter)
    return (
        f"Sink rate: {_pct(rate[f'{main:g}'])} of the {n_heads} heads "
        f"({len(mass)} layers x {len(mass[0])}) are sink heads, putting more than {main:g} of "
        f"their attention on the first token{also}, over {params['tokens']} tokens with "
        f"q0 = {params['q0']}."
    )


def sink_depth_sentence(probe: dict[str, Any], config: ReportConfig) -> str:
    mass = probe["sink_mass"]
    eps = _eps(probe)[0]
    share = [sum(m > eps for m in row) / len(row) for row in mass]
    none = [layer for layer, s in enumerate(share) if s == 0]
    if len(none) == len(share):
        return f"Depth: no layer has a sink head (sink mass > {eps:g})."
    majority = [layer for layer, s in enumerate(share) if s >= 0.5]
    best = max(range(len(share)), key=share.__getitem__)
    parts = []
    if majority:
        parts.append(f"sinks take over from layer {majority[0]} (at least half its heads)")
    else:
        parts.append("no layer has a majority of sink heads")
    parts.append(
        f"layers {_ranges(none)} have no sink head" if none else "every layer has a sink head"
    )
    parts.append(f"the densest is layer {best} ({_pct(share[best])} of its heads)")
    return "Depth: " + "; ".join(parts) + f" (a sink head has sink mass > {eps:g})."


def sink_positions_sentence(probe: dict[str, Any], config: ReportConfig) -> str | None:
    positions = probe["sink_positions"]
    if not positions:
        return "Sink positions: no key position receives attention far above uniform."
    first = positions[0]
    pos, value = _position(first)
    others = [str(_position(p)[0]) for p in positions[1:6]]
    tail = f"; other sink positions: {', '.join(others)}" if others else "; no other sink position"
    return (
        f"Sink positions: the strongest sink is key position {pos} "
        f"(mean received attention {value:.2f}){tail}."
    )


def _position(entry: dict[str, Any]) -> tuple[int, float]:
    return int(entry["position"]), float(entry["mass"])


def length_sentence(lengths: dict[str, Any], config: ReportConfig) -> str | None:
    rows = sorted(lengths["by_length"], key=lambda r: r["tokens"])
    if len(rows) < 2:
        return None
    a, b = rows[0], rows[-1]
    t0, t1 = a["tokens"], b["tokens"]
    key = f"{_eps(lengths)[0]:g}"
    ra, rb = a["sink_rate"][key], b["sink_rate"][key]
    if abs(rb - ra) <= 0.01:
        return f"Context length: the sink rate stays near {_pct(rb)} from {t0} to {t1} tokens."
    verb = "rises" if rb > ra else "falls"
    return (
        f"Context length: the sink rate {verb} from {_pct(ra)} at {t0} tokens to "
        f"{_pct(rb)} at {t1} tokens."
    )


def stream_sentence(stream: dict[str, Any], config: ReportConfig) -> str | None:
    pol = stream["policies"]
    ppl = {k: float(v["ppl"]) for k, v in pol.items()}
    if "sink" not in ppl or "window" not in ppl:
        return None
    params = stream["meta"]["params"]
    n_sink, window, tokens = params["n_sink"], params["window"], params["n_tokens"]
    ratio = ppl["window"] / ppl["sink"]
    verdict = "worse" if ratio > 1.05 else "better" if ratio < 0.95 else "about the same"
    out = (
        f"Streaming: {tokens} tokens with {n_sink} sinks + a {window}-token window give "
        f"perplexity {_num(ppl['sink'])}; the same memory without sinks (window only) gives "
        f"{_num(ppl['window'])} ({ratio:.2f}x, {verdict})"
    )
    out += f", and the full dense cache {_num(ppl['dense'])}." if "dense" in ppl else "."
    sub = stream.get("on_recompute_targets")
    if sub and "recompute" in sub["ppl"]:
        out += (
            f" On the {sub['n_scored']} targets the recompute oracle scored: sink "
            f"{_num(sub['ppl']['sink'])} vs recompute {_num(sub['ppl']['recompute'])}."
        )
    return out


def _sentence_or_none(fn: Callable[..., str | None], data: Any, config: ReportConfig) -> str | None:
    try:
        return fn(data, config)
    except Exception as exc:  # a summary sentence never breaks the report
        log.debug("summary: %s skipped (%s: %s)", fn.__name__, type(exc).__name__, exc)
        return None


def headline(results: Sequence[StageResult], config: ReportConfig) -> list[str]:
    """The summary sentences, from whatever stages succeeded."""
    ok = {r.name: r.output.json for r in results if r.status == "ok" and r.output is not None}
    sentences: list[str | None] = []
    if "probe" in ok:
        for fn in (sink_rate_sentence, sink_depth_sentence, sink_positions_sentence):
            sentences.append(_sentence_or_none(fn, ok["probe"], config))
    if "probe-lengths" in ok:
        sentences.append(_sentence_or_none(length_sentence, ok["probe-lengths"], config))
    if "stream" in ok:
        sentences.append(_sentence_or_none(stream_sentence, ok["stream"], config))
    from sinklab.ablate.registry import RECORDS  # each experiment's own summary sentence

    for rec in RECORDS:
        if rec.name in ok:
            sentences.append(
                _sentence_or_none(lambda d, c, r=rec: r.summary(d), ok[rec.name], config)
            )
    failed = [r.name for r in results if r.status != "ok"]
    if failed:
        sentences.append(
            f"Failed: {len(failed)} stage(s) did not run and show their error: {', '.join(failed)}."
        )
    return [s for s in sentences if s]
