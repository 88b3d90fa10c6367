"""The one verdict rule of ``docs/claims.md``: a seeded percentile bootstrap interval of the mean
effect over samples, and the verdict that interval gives against a claimed direction and threshold.

Pure functions of numbers; nothing here knows about models or claims' outcomes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sinklab.errors import SinklabError

VERDICTS = ("supported", "not supported", "inconclusive")
DIRECTIONS = ("above", "below")  # the claim: effect > theta, or effect < theta
MIN_SAMPLES = 3
N_RESAMPLES = 10_000
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """The mean of the samples and its percentile bootstrap interval ``[low, high]``."""

    mean: float
    low: float
    high: float
    n: int  # valid samples the interval is computed from
    level: float = LEVEL
    resamples: int = N_RESAMPLES


def valid_samples(samples: Sequence[float | None]) -> list[float]:
    """The finite samples (None and NaN dropped: samples that could not be measured)."""
    out = []
    for s in samples:
        if s is None:
            continue
        x = float(s)
        if math.isfinite(x):
            out.append(x)
    return out


def bootstrap_interval(
    samples: Sequence[float],
    *,
    resamples: int = N_RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> Interval:
    """Percentile bootstrap interval of the mean of ``samples`` (finite floats, n >= 1).

    ``resamples`` means of ``n`` draws with replacement (``torch.Generator`` seeded by ``seed``);
    the interval is their ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (linear
    interpolation). Deterministic for a seed.
    """
    xs = valid_samples(samples)
    if len(xs) != len(samples) or not xs:
        raise SinklabError("bootstrap_interval needs at least one sample, all finite")
    if resamples < 1 or not 0.0 < level < 1.0:
        raise SinklabError(f"resamples must be >= 1 and level in (0, 1), got {resamples}, {level}")
    x = torch.tensor(xs, dtype=torch.float64)  # (n,)
    g = torch.Generator().manual_seed(int(seed))
    idx = torch.randint(0, x.numel(), (resamples, x.numel()), generator=g)  # (B, n)
    means = x[idx].mean(1)  # (B,)
    alpha = (1.0 - level) / 2.0
    q = torch.quantile(means, torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64))
    return Interval(float(x.mean()), float(q[0]), float(q[1]), int(x.numel()), level, resamples)


@dataclass(frozen=True)
class Verdict:
    verdict: str  # one of VERDICTS
    reason: str


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def verdict(
    interval: Interval | None,
    direction: str,
    threshold: float,
    *,
    min_samples: int = MIN_SAMPLES,
    not_measured: str | None = None,
) -> Verdict:
    """The verdict of docs/claims.md for a claim ``effect > threshold`` (``direction="above"``)
    or ``effect < threshold`` (``"below"``), given the bootstrap ``interval`` of its mean.

    supported: every value of the interval satisfies the claim; not supported: none does;
    inconclusive: the interval straddles or touches the threshold from the claimed side, fewer
    than ``min_samples`` samples, or not measured (``interval`` None; ``not_measured`` says why).
    """
    if direction not in DIRECTIONS:
        raise SinklabError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if not math.isfinite(threshold):
        raise SinklabError(f"threshold must be finite, got {threshold}")
    if interval is None:
        return Verdict("inconclusive", f"not measured: {not_measured or 'no samples'}")
    if interval.n < min_samples:
        return Verdict(
            "inconclusive",
            f"too few samples: {interval.n} valid, the rule needs at least {min_samples}",
        )
    lo, hi, t = interval.low, interval.high, float(threshold)
    span = f"interval [{_fmt(lo)}, {_fmt(hi)}]"
    if direction == "above":
        if lo > t:
            return Verdict("supported", f"{span} lies above {_fmt(t)}")
        if hi <= t:
            return Verdict("not supported", f"{span} lies at or below {_fmt(t)}")
    else:
        if hi < t:
            return Verdict("supported", f"{span} lies below {_fmt(t)}")
        if lo >= t:
            return Verdict("not supported", f"{span} lies at or above {_fmt(t)}")
    return Verdict("inconclusive", f"{span} contains {_fmt(t)}")


def decide(
    samples: Sequence[float | None] | None,
    direction: str,
    threshold: float,
    *,
    not_measured: str | None = None,
    seed: int = 0,
) -> tuple[Interval | None, Verdict]:
    """Samples -> (interval or None, verdict): drops unmeasurable samples, then applies the rule."""
    xs = valid_samples(samples or [])
    if not xs:
        why = not_measured or "no sample could be measured"
        return None, verdict(None, direction, threshold, not_measured=why)
    interval = bootstrap_interval(xs, seed=seed)
    return interval, verdict(interval, direction, threshold)
