"""Whether a lab run has converged and whether it grew a sink or a switch: the criteria of
docs/claims.md#lab-validity, as pure functions of a run's trajectory.

A lab comparison is judged only when every compared run met the convergence criterion and the
comparison's emergence criterion holds (:mod:`sinklab.claims.validity` composes the verdict);
``sinklab train`` records each run's convergence in ``train.json``. Nothing here trains or reads
files: the inputs are the checkpoint rows ``train.json`` holds and the loss curve.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

TAIL_FRACTION = 0.2  # the last 20 % of training
MIN_TAIL = 3  # checkpoints the tail must hold for C1 to be read
BAND = 0.05  # C1: max - min of the read-out over the tail
COPY_LOSS_MAX = 0.05  # C2 (backcopy): final copy loss, nats (floor 0)
PLATEAU = 0.02  # C2 (text): nats the last 10 % of the loss may differ from the 10 % before
SINK_RATIO = 3.0  # emergence of a sink: r = m / u >= 3
SWITCH_MASS = 0.5  # emergence of a switch: previous-token mass at trigger queries >= 0.5


@dataclass(frozen=True)
class Check:
    """One criterion applied to one run: ``met``, the ``criterion`` in words, and ``detail``: the
    run's own numbers in words (what a reason quotes)."""

    met: bool
    criterion: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _f(x: float) -> str:
    return f"{x:.3g}"


def tail_start(steps: int) -> int:
    """The first step of the last :data:`TAIL_FRACTION` of ``steps`` steps: ``ceil(0.8 S)``, the
    one rule both the checkpoint schedule and :func:`tail` use (so no tail checkpoint falls out)."""
    return math.ceil((1.0 - TAIL_FRACTION) * steps - 1e-9)


def tail(points: Sequence[tuple[int, float]], steps: int) -> list[tuple[int, float]]:
    """The ``(step, value)`` points from :func:`tail_start` on."""
    start = tail_start(steps)
    return [(s, v) for s, v in points if s >= start]


def read_out_settled(points: Sequence[tuple[int, float]], steps: int, band: float = BAND) -> Check:
    """C1: the read-out stays within ``band`` (max - min) over the tail checkpoints (at least
    :data:`MIN_TAIL` of them; a non-finite value fails)."""
    criterion = (
        f"read-out within {band:g} (max - min) over the last {TAIL_FRACTION:.0%} of training "
        f"(>= {MIN_TAIL} checkpoints)"
    )
    pts = tail(points, steps)
    if len(pts) < MIN_TAIL:
        return Check(False, criterion, f"only {len(pts)} checkpoint(s) in the last 20 %")
    vals = [float(v) for _, v in pts]
    if not all(math.isfinite(v) for v in vals):
        return Check(False, criterion, "a non-finite read-out in the last 20 %")
    lo, hi = min(vals), max(vals)
    detail = f"read-out {_f(lo)}..{_f(hi)} over steps {pts[0][0]}-{pts[-1][0]}"
    return Check(hi - lo <= band, criterion, detail)


def copy_loss_at_floor(copy_loss: float | None, limit: float = COPY_LOSS_MAX) -> Check:
    """C2 for backcopy: the final copy loss (floor 0: a copy is determined) is <= ``limit``."""
    criterion = f"copy loss <= {limit:g} nats at the end (its floor is 0)"
    if copy_loss is None or not math.isfinite(copy_loss):
        return Check(False, criterion, "no copy loss measured")
    return Check(copy_loss <= limit, criterion, f"copy loss {_f(copy_loss)}")


def loss_plateau(loss: Sequence[tuple[int, float]], limit: float = PLATEAU) -> Check:
    """C2 for text: the mean training loss over the last 10 % of the steps is within ``limit``
    nats of the mean over the 10 % before, either way (the loss has flattened; no known floor).
    A loss that rises by more than ``limit`` is diverging, not converged."""
    criterion = f"loss over the last 10 % within {limit:g} nats of the 10 % before (either way)"
    vals = [float(v) for _, v in loss]
    n = len(vals) // 10
    if n < 1:
        return Check(False, criterion, f"only {len(vals)} loss values")
    last, before = vals[-n:], vals[-2 * n : -n]
    drop = sum(before) / n - sum(last) / n
    moved = f"loss fell {_f(drop)} nats" if drop >= 0 else f"loss rose {_f(-drop)} nats"
    return Check(abs(drop) <= limit, criterion, moved)


def sink_ratio(mass: float | None, uniform: float | None) -> float | None:
    """``r = m / u``: a first-token mass relative to uniform attention's at the same queries."""
    if mass is None or uniform is None or not uniform > 0:
        return None
    return float(mass) / float(uniform)


def sink_emerged(mass: float | None, uniform: float | None, ratio: float = SINK_RATIO) -> Check:
    """A sink emerged: ``m / u >= ratio`` at the last checkpoint."""
    criterion = f"first-token mass >= {ratio:g} x uniform's (r = m / u)"
    r = sink_ratio(mass, uniform)
    if r is None:
        return Check(False, criterion, "no first-token mass measured")
    return Check(r >= ratio, criterion, f"m {_f(float(mass))}, r {_f(r)}")


def switch_emerged(prev_mass: float | None, limit: float = SWITCH_MASS) -> Check:
    """The switch emerged: previous-token mass at trigger queries >= ``limit``."""
    criterion = f"previous-token mass at trigger queries >= {limit:g} (the copy was learned)"
    if prev_mass is None or not math.isfinite(prev_mass):
        return Check(False, criterion, "no previous-token mass measured")
    return Check(prev_mass >= limit, criterion, f"previous-token mass {_f(prev_mass)}")


def number(d: dict[str, Any], key: str) -> float | None:
    """``d[key]`` as a float when it is a number (not a bool), else None (missing or not read)."""
    v = d.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def trajectory(checkpoints: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per checkpoint: ``step``, the read-out ``m`` (backcopy: the switching head's
    first-token mass at non-trigger queries; text: the mean first-token sink mass), and for
    backcopy ``u``, ``r``, ``copy_loss``, ``prev_mass``; ``sink_rate`` (eps 0.3) when recorded."""
    rows = []
    for c in checkpoints:
        bc = c.get("backcopy")
        row: dict[str, Any] = {"step": int(c["step"])}
        if isinstance(bc, dict):
            m, u = (
                number(bc, "first_token_mass_nontrigger"),
                number(bc, "uniform_first_mass_nontrigger"),
            )
            row.update(m=m, u=u, r=sink_ratio(m, u), copy_loss=number(bc, "backcopy_loss"))
            row["prev_mass"] = number(bc, "prev_token_mass_trigger")
        else:
            row["m"] = number(c, "first_token_sink_mass")
        rate = c.get("sink_rate")
        if isinstance(rate, dict) and "0.3" in rate:
            row["sink_rate"] = float(rate["0.3"])
        rows.append(row)
    return rows


def final_copy_loss(checkpoints: Sequence[dict[str, Any]]) -> tuple[float | None, str]:
    """The copy loss C2 reads and where it comes from: the median over the held-out validation
    sequences of each sequence's mean copy NLL at the last checkpoint (``val``:
    ``backcopy_loss_median``, :data:`sinklab.lab.backcopy.VAL_SEQUENCES` sequences), robust to one
    odd sequence; runs trained before it was recorded fall back to the mean over the probe's
    sequences (``backcopy_loss``)."""
    last = checkpoints[-1] if checkpoints else {}
    val = last.get("val")
    if isinstance(val, dict) and number(val, "backcopy_loss_median") is not None:
        n = val.get("n_sequences", "the validation")
        return number(val, "backcopy_loss_median"), f"median over {n} validation sequences"
    bc = last.get("backcopy")
    if isinstance(bc, dict):
        return number(bc, "backcopy_loss"), "mean over the probe sequences (an older run)"
    return None, ""


def convergence(
    checkpoints: Sequence[dict[str, Any]],
    steps: int,
    loss: Sequence[tuple[int, float]] = (),
) -> dict[str, Any]:
    """The per-run criterion of docs/claims.md#lab-validity: C2 (backcopy: copy loss at its
    floor, :func:`final_copy_loss`; text: loss flattened) is the gate; C1 (the read-out's band
    over the tail) is reported as a diagnostic only (``diagnostics``): whether a comparison has
    settled is judged on the comparison (:func:`sinklab.claims.validity.comparison_settled`),
    not run by run. Returns ``met``, ``criterion``, ``reason`` (the failing numbers; empty when
    met), ``checks`` (the gate) and ``diagnostics`` (C1), each a :class:`Check`."""
    traj = trajectory(checkpoints)
    points = [(r["step"], r["m"]) for r in traj if r.get("m") is not None]
    c1 = read_out_settled(points, steps)
    if traj and "copy_loss" in traj[-1]:
        value, where = final_copy_loss(checkpoints)
        c2 = copy_loss_at_floor(value)
        if where:
            c2 = Check(c2.met, f"{c2.criterion}, {where}", c2.detail)
    else:
        c2 = loss_plateau(loss)
    failed = [] if c2.met else [c2.detail + f" (needs {c2.criterion})"]
    return {
        "met": not failed,
        "criterion": c2.criterion,
        "reason": "; ".join(failed),
        "checks": [c2.to_json()],
        "diagnostics": [c1.to_json()],
    }
