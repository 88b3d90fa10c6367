"""A claim's verdict as an experiment's finding quotes it (docs/experiments.md, docs/claims.md).

An experiment that speaks of a claim never decides it by a rule of its own: it computes the
claim's effect on each of its samples and quotes the verdict of the claims table's one rule
(:func:`sinklab.claims.registry.judge`) on them, so the finding and ``sinklab claims`` on the
same samples cannot disagree. :func:`claim_block` is that verdict as JSON, :func:`claim_sentence`
its words.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sinklab.claims.registry import judge


def claim_block(claim_id: str, effects: Sequence[float | None], seed: int = 0) -> dict[str, Any]:
    """The claims rule on ``effects`` (one per sample, None where one could not be measured):
    ``{"id", "effects", "effect" (mean), "interval" ([low, high] 95 %), "verdict", "reason"}``,
    what ``sinklab claims`` reports for the same samples."""
    interval, v = judge(claim_id, list(effects), seed=seed)
    return {
        "id": claim_id,
        "effects": list(effects),
        "effect": None if interval is None else interval.mean,
        "interval": None if interval is None else [interval.low, interval.high],
        "verdict": v.verdict,
        "reason": v.reason,
    }


def claim_sentence(block: dict[str, Any], samples: str = "texts") -> str:
    """``claim-id: VERDICT by the claims rule (docs/claims.md; mean x over n SAMPLES, 95 %
    interval [a, b] ...)``: the one clause of a finding that states a verdict."""
    reason = block["reason"]
    reason = f"95 % {reason}" if reason.startswith("interval") else reason
    mean = f"mean {block['effect']:.3g} " if block["effect"] is not None else ""
    n = len(block["effects"])
    return (
        f"`{block['id']}` is {block['verdict']} by the claims rule (docs/claims.md; {mean}over "
        f"{n} {samples}, {reason})"
    )
