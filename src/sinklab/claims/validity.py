"""A lab comparison's validity and its verdict (docs/claims.md#lab-validity).

Every lab claim has a :class:`Fidelity` to its paper (``same protocol``, ``proxy``, ``none``).
:func:`lab_verdict` turns the bootstrap interval of its effect into a verdict only when the
set-up can show the mechanism (fidelity not ``none``), every compared run met the convergence
criterion and the comparison's emergence criterion held; otherwise the verdict is
``inconclusive`` with the reason. A proxy's verdict names its set-up (``scope``: "not supported
on backcopy"). Pure functions: the runs' criteria come from :mod:`sinklab.lab.convergence`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sinklab.claims.rules import Interval, Verdict, verdict
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
        "backcopy needs one switching head at any depth, and over-mixing (the paper's reason) "
        "needs deep models on long natural text, beyond a CPU budget; no CPU-scale set-up here "
        "tests it (benchmarks/lab_gpu.py is the GPU set-up)",
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
) -> Verdict:
    """The verdict of a lab comparison (docs/claims.md#lab-validity), in this order:

    1. fidelity ``none``: inconclusive, the set-up cannot show the mechanism;
    2. nothing measured: inconclusive, ``not measured: ...``;
    3. a compared run not converged: inconclusive, which run and its numbers;
    4. the emergence criterion failed: inconclusive, which run grew nothing;
    5. else the one rule (:func:`sinklab.claims.rules.verdict`); a proxy's reason names its
       scope (the verdict is about that set-up).
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
        return Verdict("inconclusive", f"no emergence: {_failing(emergence)}")
    v = verdict(interval, direction, threshold)
    if fidelity.kind == "proxy" and v.verdict != "inconclusive":
        return Verdict(v.verdict, f"{v.reason}, on {fidelity.scope} (a proxy: {fidelity.what})")
    return v


def stated(verdict_: str, scope: str | None) -> str:
    """The verdict as the table prints it: a proxy's names its set-up (``not supported on
    backcopy``); inconclusive stays as it is."""
    if scope and verdict_ != "inconclusive":
        return f"{verdict_} on {scope}"
    return verdict_
