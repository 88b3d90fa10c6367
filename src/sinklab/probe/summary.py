"""The probe's summary sentences, the only ones: ``sinklab probe`` prints them and the report's
headline uses them. Each reads a probe result's JSON (``probe.json``'s content) and takes every
threshold and size from the result's own ``meta.params``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sinklab.probe.metrics import top_heads
from sinklab.probe.spec import eps_key


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def ranges(layers: Sequence[int]) -> str:
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


def thresholds(data: dict[str, Any]) -> list[float]:
    """The thresholds the result was computed with (``meta.params.eps``), the main one first."""
    return [float(e) for e in data["meta"]["params"]["eps"]]


def sink_rate_sentence(data: dict[str, Any]) -> str:
    mass = data["sink_mass"]
    n_heads = sum(len(row) for row in mass)
    rate = data["sink_rate"]
    params = data["meta"]["params"]
    main, *stricter = thresholds(data)
    also = "".join(f" ({_pct(rate[eps_key(e)])} put more than {e:g})" for e in stricter)
    return (
        f"Sink rate: {_pct(rate[eps_key(main)])} of the {n_heads} heads "
        f"({len(mass)} layers x {len(mass[0])}) are sink heads, putting more than {main:g} of "
        f"their attention on the first token{also}, over {params['tokens']} tokens with "
        f"q0 = {params['q0']}."
    )


def sink_depth_sentence(data: dict[str, Any]) -> str:
    mass = data["sink_mass"]
    eps = thresholds(data)[0]
    counts = [sum(m > eps for m in row) for row in mass]
    share = [c / len(row) for c, row in zip(counts, mass, strict=True)]
    none = [layer for layer, s in enumerate(share) if s == 0]
    if len(none) == len(share):
        return f"Depth: no layer has a sink head (sink mass > {eps:g})."
    majority = [layer for layer, s in enumerate(share) if s >= 0.5]
    best = max(range(len(share)), key=share.__getitem__)
    first = next(layer for layer, c in enumerate(counts) if c)
    parts = [f"the first sink head is in layer {first}"]
    if majority:
        parts.append(f"sinks take over from layer {majority[0]} (at least half its heads)")
    else:
        parts.append("no layer has a majority of sink heads")
    parts.append(
        f"layers {ranges(none)} have no sink head" if none else "every layer has a sink head"
    )
    parts.append(f"the densest is layer {best} ({_pct(share[best])} of its heads)")
    parts.append("sink heads per layer: " + " ".join(map(str, counts)))
    return "Depth: " + "; ".join(parts) + f" (a sink head has sink mass > {eps:g})."


def top_heads_sentence(data: dict[str, Any], top: int = 5) -> str:
    ranked = top_heads(data["sink_mass"], top)
    heads = ", ".join(f"L{layer}H{h} {v:.2f}" for layer, h, v in ranked)
    return f"Top sink heads (layer, head: sink mass): {heads}."


def sink_positions_sentence(data: dict[str, Any]) -> str:
    positions = data["sink_positions"]
    if positions is None:
        return "Sink positions: not measured (--metrics fast)."
    if not positions:
        return "Sink positions: no key position receives attention far above uniform."
    first = positions[0]
    others = [str(p["position"]) for p in positions[1:6]]
    tail = f"; other sink positions: {', '.join(others)}" if others else "; no other sink position"
    return (
        f"Sink positions: the strongest sink is key position {first['position']} "
        f"(mean received attention {first['mass']:.2f}){tail}."
    )


def length_sentence(data: dict[str, Any]) -> str | None:
    rows = sorted(data["by_length"], key=lambda r: r["tokens"])
    if len(rows) < 2:
        return None
    a, b = rows[0], rows[-1]
    t0, t1 = a["tokens"], b["tokens"]
    key = eps_key(thresholds(data)[0])
    ra, rb = a["sink_rate"][key], b["sink_rate"][key]
    if abs(rb - ra) <= 0.01:
        return f"Context length: the sink rate stays near {_pct(rb)} from {t0} to {t1} tokens."
    verb = "rises" if rb > ra else "falls"
    return (
        f"Context length: the sink rate {verb} from {_pct(ra)} at {t0} tokens to "
        f"{_pct(rb)} at {t1} tokens."
    )


def geometry_sentences(data: dict[str, Any]) -> list[str]:
    """First-token cosine and token similarity per layer at each site of ``data["geometry"]``
    (residual stream, attention input, keys: :mod:`sinklab.probe.geometry`); '-' where not
    measured."""
    geo = data.get("geometry")
    out = []
    for metric, label in (("first_token_cosine", "First-token cosine"),
                          ("token_similarity", "Token similarity")) if geo else ():  # fmt: skip
        for site in geo["sites"]:
            vals = [e[metric][site] for e in geo["layers"]]
            shown = " ".join("-" if v is None else f"{v:.2f}" for v in vals)
            out.append(f"{label} per layer at the {site.replace('_', ' ')}: {shown}.")
    return out


def summary_sentences(data: dict[str, Any]) -> list[str]:
    """Every sentence a probe result supports, in reading order."""
    out = [] if "sink_mass" not in data else [
        sink_rate_sentence(data),
        sink_depth_sentence(data),
        top_heads_sentence(data),
        sink_positions_sentence(data),
        *geometry_sentences(data),
    ]  # fmt: skip
    if "by_length" in data:
        out.append(length_sentence(data))
    return [s for s in out if s]
