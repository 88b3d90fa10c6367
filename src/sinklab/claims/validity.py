"""A lab comparison's validity and its verdict (docs/claims.md#lab-validity).

Every lab claim has a :class:`Fidelity` to its paper (``same protocol``, ``proxy``, ``none``).
:func:`lab_verdict` turns the bootstrap interval of its effect into a verdict only when the
set-up can show the mechanism (fidelity not ``none``), every compared run met the convergence
criterion and the comparison's emergence criterion held; otherwise the verdict is
``inconclusive`` with the reason. A proxy's verdict names its set-up (``scope``: "not supported
on backcopy"). Pure functions: the runs' criteria come from :mod:`sinklab.lab.convergence`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sinklab.claims.rules import MIN_SAMPLES, Interval, Verdict, bootstrap_interval, verdict
from sinklab.errors import SinklabError

FIDELITY_KINDS = ("same protocol", "proxy", "none")


@dataclass(frozen=True)
class Fidelity:
    """How close a lab comparison is to its paper's protocol: ``kind`` (one of
    :data:`FIDELITY_KINDS`), ``what`` differs (proxy) or why nothing here can show it (none), and
    the ``scope`` a verdict is stated on (the set-up's name, e.g. ``backcopy``)."""

    kind: str
    what: str = ""
    scope: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FIDELITY_KINDS:
            raise SinklabError(f"fidelity must be one of {FIDELITY_KINDS}, got {self.kind!r}")

    @property
    def label(self) -> str:
        """``same protocol``, ``proxy: ...`` or ``none: ...`` (docs/claims.md's words)."""
        return self.kind if not self.what else f"{self.kind}: {self.what}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "label": self.label, "scope": self.scope}


BACKCOPY = "backcopy"
FIDELITY: dict[str, Fidelity] = {
    "softmax1-no-sink": Fidelity(
        "proxy", "1-layer bigram-backcopy models, not language models pretrained on text", BACKCOPY
    ),
    "hard-switch-sink": Fidelity(
        "same protocol", "Guo et al. 2024's bigram-backcopy task", BACKCOPY
    ),
    "sinks-grow-length": Fidelity(
        "proxy",
        "bigram-backcopy at a short and a long T with equal tokens per step, not text "
        "pretraining at 128 to 2,048 tokens",
        BACKCOPY,
    ),
    "bos-reliance": Fidelity(
        "proxy",
        "bigram-backcopy with BOS always first vs no BOS (a fresh character first), not text "
        "with BOS vs packed windows",
        BACKCOPY,
    ),
    "sinks-grow-depth": Fidelity(
        "none",
        "backcopy needs one switching head at any depth (1-, 2- and 4-layer models grow exactly "
        "one sink head, in layer 0), and over-mixing (the paper's reason) needs deep models on "
        "long natural text, beyond a CPU budget; `python benchmarks/lab_gpu.py --depths 2,4,8` "
        "(text, one GPU) is the run that decides it",
    ),
}


@dataclass(frozen=True)
class RunCheck:
    """One compared run's criterion: its ``name`` (e.g. ``seed 1, softmax1``), ``met``, the
    ``criterion`` in words and the ``reason`` it failed (empty when met)."""

    name: str
    met: bool
    criterion: str
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.name,
            "met": self.met,
            "criterion": self.criterion,
            "reason": self.reason,
        }


SETTLE_MARGIN = 1.0  # the end margin must exceed this many times the tail drift
MIN_TAIL = 3  # tail checkpoints every sample needs for the comparison to be read


def _g(x: float) -> str:
    return f"{x:.3g}"


def _near_end(interval: Interval, direction: str, decided: str) -> float:
    """The end of ``interval`` nearest the threshold for a ``decided`` verdict: the low end of a
    supported *above* claim or a not-supported *below* one, else the high end."""
    low_near = (direction == "above") == (decided == "supported")
    return interval.low if low_near else interval.high


def comparison_settled(
    tails: Sequence[Sequence[tuple[int, float]]],
    direction: str,
    threshold: float,
    *,
    seed: int = 0,
    margin: float = SETTLE_MARGIN,
) -> RunCheck:
    """Whether a lab comparison has settled (docs/claims.md#lab-validity, S1 and S2).

    ``tails``: per sample, the effect at each tail checkpoint (``(step, effect)``, the last 20 %
    of training). The samples' effects at the k-th tail checkpoint (counted from the end, so
    samples are aligned on their own last checkpoints) give an interval and a verdict by the one
    rule. S1: the verdict is the same decided verdict (supported or not supported) at every tail
    checkpoint. S2: the end of the last interval nearest the threshold lies further from it
    than ``margin`` times how far that end moved over the tail (max - min): the comparison could
    keep moving at its tail's pace for another 20 % of training and keep its verdict.
    """
    criterion = (
        f"the comparison's verdict is the same at every checkpoint of the last 20 % and its "
        f"interval ends further from the threshold than {margin:g} x its drift there"
    )
    clean = [
        [(s, float(e)) for s, e in t if e is not None and math.isfinite(float(e))] for t in tails
    ]
    n_tail = min((len(t) for t in clean), default=0)
    if len(clean) < MIN_SAMPLES or n_tail < MIN_TAIL:
        why = (
            f"the effect at only {n_tail} tail checkpoint(s) in some sample (needs {MIN_TAIL}: "
            "runs trained by this sinklab record the effect over the last 20 %)"
            if len(clean) >= MIN_SAMPLES
            else f"{len(clean)} sample(s) with a tail"
        )
        return RunCheck("the comparison", False, criterion, why)
    steps = [t[-1][0] for t in clean]
    rows = []  # oldest first: (interval, verdict)
    for k in range(n_tail, 0, -1):
        iv = bootstrap_interval([t[-k][1] for t in clean], seed=seed)
        rows.append((iv, verdict(iv, direction, threshold).verdict))
    final_v = rows[-1][1]
    if final_v == "inconclusive":  # the rule's own inconclusive: nothing to settle
        return RunCheck("the comparison", True, criterion, "")
    first_step = clean[0][-n_tail][0]
    changed = [v for _, v in rows if v != final_v]
    if changed:
        return RunCheck(
            "the comparison",
            False,
            criterion,
            f"its verdict changes over the last 20 % ({' -> '.join(v for _, v in rows)}, "
            f"steps {first_step}-{max(steps)})",
        )
    near = [_near_end(iv, direction, final_v) for iv, _ in rows]
    drift = max(near) - min(near)
    gap = abs(near[-1] - float(threshold))
    detail = (
        f"interval end {_g(near[0])} -> {_g(near[-1])} over steps {first_step}-{max(steps)}: "
        f"drift {_g(drift)}, {_g(gap)} from the threshold"
    )
    # a comparison that did not move at all has settled wherever it is (even on the threshold)
    return RunCheck("the comparison", drift == 0 or gap > margin * drift, criterion, detail)


def _failing(checks: Sequence[RunCheck]) -> str:
    return "; ".join(f"{c.name}: {c.reason}" for c in checks if not c.met)


def lab_verdict(
    interval: Interval | None,
    direction: str,
    threshold: float,
    fidelity: Fidelity,
    convergence: Sequence[RunCheck],
    emergence: Sequence[RunCheck],
    *,
    not_measured: str | None = None,
    settled: RunCheck | None = None,
) -> Verdict:
    """The verdict of a lab comparison (docs/claims.md#lab-validity), in this order:

    1. fidelity ``none``: inconclusive, the set-up cannot show the mechanism;
    2. nothing measured: inconclusive, ``not measured: ...``;
    3. a compared run not converged (its copy loss above the floor): inconclusive, which run;
    4. the emergence criterion failed: inconclusive, which run grew nothing (or solved the task
       without a sink, or kept the sink the variant should remove);
    5. the one rule (:func:`sinklab.claims.rules.verdict`); a decided verdict stands only when
       the comparison has ``settled`` (:func:`comparison_settled`), else inconclusive, ``not
       settled: ...``; a proxy's reason names its scope (the verdict is about that set-up).
    """
    if fidelity.kind == "none":
        return Verdict("inconclusive", f"no set-up here can show it: {fidelity.what}")
    if interval is None:
        return verdict(None, direction, threshold, not_measured=not_measured)
    if not convergence:
        return Verdict("inconclusive", "no compared run's convergence could be checked")
    if not all(c.met for c in convergence):
        return Verdict("inconclusive", f"not converged: {_failing(convergence)}")
    if emergence and not all(c.met for c in emergence):
        failing = [c for c in emergence if not c.met]
        if all("settled with a first-token sink" in c.reason for c in failing):
            # every failure is a variant that kept a flat sink: a finding about the claim
            return Verdict("inconclusive", f"the variant kept the sink: {_failing(emergence)}")
        return Verdict("inconclusive", f"no emergence: {_failing(emergence)}")
    v = verdict(interval, direction, threshold)
    if v.verdict != "inconclusive" and settled is not None and not settled.met:
        return Verdict("inconclusive", f"not settled: {v.reason}, but {settled.reason}")
    if v.verdict != "inconclusive" and settled is not None:
        v = Verdict(v.verdict, f"{v.reason}; settled: {settled.reason}")
    if fidelity.kind == "proxy" and v.verdict != "inconclusive":
        return Verdict(v.verdict, f"{v.reason}, on {fidelity.scope} (a proxy: {fidelity.what})")
    return v


def stated(verdict_: str, scope: str | None) -> str:
    """The verdict as the table prints it: a proxy's names its set-up (``not supported on
    backcopy``); inconclusive stays as it is."""
    if scope and verdict_ != "inconclusive":
        return f"{verdict_} on {scope}"
    return verdict_
