"""The claims measured in the lab (trained runs) and by the cost experiment.

Lab runs come from ``sinklab claims`` itself (:mod:`sinklab.claims.lab_runs` trains what the
claims need, kept in the user cache) or from the ``train.json`` files below ``--lab DIR``
(``sinklab train`` outputs, single runs or sweeps). A comparison pairs runs whose configurations
are equal except for the compared field; each pair (or group) is one sample. Every sample carries
its runs' trajectories and convergence, every comparison its fidelity and emergence checks
(docs/claims.md#lab-validity); :func:`sinklab.claims.validity.lab_verdict` decides from them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sinklab.claims.measure_model import Measurement
from sinklab.claims.validity import FIDELITY, RunCheck
from sinklab.errors import SinklabError
from sinklab.lab.convergence import (
    BAND,
    MIN_TAIL,
    convergence,
    number,
    sink_emerged,
    sink_ratio,
    switch_emerged,
    tail_start,
    trajectory,
)
from sinklab.meta import restore_non_finite
from sinklab.progress import Tick
from sinklab.safeio import read_json

log = logging.getLogger(__name__)

LAB_CLAIMS = (
    "softmax1-no-sink",
    "sinks-grow-depth",
    "sinks-grow-length",
    "bos-reliance",
    "hard-switch-sink",
)
# config fields that do not change what a run learned (never part of a comparison key)
IGNORED = frozenset({"device", "keep_checkpoints", "n_checkpoints", "eval_windows"})
WITH_BOS = ("bos",)
WITHOUT_BOS = ("packed", "no-bos", "nobos")
NULL_VARIANTS = ("softmax1", "sink")
HOW = (
    "train backcopy runs for seeds 0, 1, 2 into one folder, e.g. `sinklab train --task backcopy "
    "--variant softmax|softmax1|sink --data bos|no-bos [--seq-len T --batch-size B] --seed S "
    "--out DIR/NAME`, and pass --lab DIR (or leave out --lab: sinklab claims trains them)"
)


@dataclass(frozen=True)
class LabRun:
    """One finished run: its configuration, every checkpoint row, the validation numbers and
    the loss curve (``[(step, loss)]``), and where it was read from."""

    path: Path | None
    config: dict[str, Any]
    checkpoints: list[dict[str, Any]]
    val: dict[str, Any]
    loss: list[tuple[int, float]]

    @classmethod
    def from_json(cls, raw: dict[str, Any], path: Path | None) -> LabRun:
        checkpoints = [dict(c) for c in raw["checkpoints"]]
        if not checkpoints:
            raise ValueError("no checkpoints")
        loss = [(int(s), float(v)) for s, v in raw.get("loss", [])]
        return cls(path, dict(raw["config"]), checkpoints, dict(raw.get("val", {})), loss)

    @property
    def last(self) -> dict[str, Any]:
        return self.checkpoints[-1]

    @property
    def backcopy(self) -> dict[str, Any]:
        bc = self.last.get("backcopy")
        return bc if isinstance(bc, dict) else {}

    @property
    def steps(self) -> int:
        steps = self.config.get("steps")
        return int(steps) if isinstance(steps, int) else int(self.last["step"])

    def key(self, *drop: str) -> tuple:
        skip = IGNORED | set(drop)
        return tuple(sorted((k, repr(v)) for k, v in self.config.items() if k not in skip))

    def name(self, *fields: str) -> str:
        parts = [f"seed {self.config.get('seed', '?')}"]
        parts += [f"{f} {self.config.get(f)}" for f in fields]
        return ", ".join(parts)

    @property
    def label(self) -> str:
        """The run in a few words: ``seed 0 softmax/bos T32x32``."""
        c = self.config
        return (
            f"seed {c.get('seed', '?')} {c.get('variant')}/{c.get('data')} "
            f"T{c.get('seq_len')}x{c.get('batch_size')}"
        )

    def convergence(self) -> dict[str, Any]:
        """The convergence criterion on this run (docs/claims.md#lab-validity)."""
        return convergence(self.checkpoints, self.steps, self.loss)

    def converged(self) -> RunCheck:
        c = self.convergence()
        return RunCheck(self.label, c["met"], c["criterion"], c["reason"])

    def sink(self) -> RunCheck:
        """A sink grew (r >= 3); a run that solved the task with a diagonal head instead (more
        of its non-trigger mass on the query itself than on the first token) says so."""
        bc = self.backcopy
        m, u = (
            number(bc, "first_token_mass_nontrigger"),
            number(bc, "uniform_first_mass_nontrigger"),
        )
        e = sink_emerged(m, u)
        diag = number(bc, "diag_mass_nontrigger")
        if e.met:
            return RunCheck(self.label, True, e.criterion)
        if diag is not None and m is not None and diag > m:
            why = f"solved without a sink: a diagonal head (diagonal mass {diag:.3g}, {e.detail})"
            return RunCheck(self.label, False, e.criterion, why)
        return RunCheck(self.label, False, e.criterion, f"no sink ({e.detail})")

    def sink_free(self) -> RunCheck:
        """The variant carries no first-token sink (r < 3): what softmax1-no-sink claims."""
        bc = self.backcopy
        m, u = (
            number(bc, "first_token_mass_nontrigger"),
            number(bc, "uniform_first_mass_nontrigger"),
        )
        e = sink_emerged(m, u)
        criterion = "no first-token sink in the variant (r < 3)"
        if m is None or u is None:
            return RunCheck(self.label, False, criterion, "no first-token mass measured")
        if not e.met:
            return RunCheck(self.label, True, criterion)
        tail = self.tail(lambda c: number(c.get("backcopy") or {}, "first_token_mass_nontrigger"))
        if len(tail) >= MIN_TAIL and max(tail.values()) - min(tail.values()) <= BAND:
            # not a sink on its way out: flat over the tail, the variant kept it (the rule reads
            # the tail only; it does not rerun at twice the steps); a finding about the claim
            lo, hi, first, end = min(tail.values()), max(tail.values()), min(tail), max(tail)
            why = (
                f"settled with a first-token sink ({e.detail}; m {lo:.3g}..{hi:.3g} over steps "
                f"{first}-{end}): the variant kept a flat first-token sink on this seed"
            )
        else:
            why = f"still carries a first-token sink ({e.detail}), not settled"
        return RunCheck(self.label, False, criterion, why)

    def tail(self, read: Callable[[dict[str, Any]], float | None]) -> dict[int, float]:
        """``{step: read(checkpoint)}`` over the last 20 % of training (where it can be read)."""
        start = tail_start(self.steps)
        out = {}
        for c in self.checkpoints:
            v = read(c) if int(c.get("step", -1)) >= start else None
            if v is not None and math.isfinite(v):
                out[int(c["step"])] = float(v)
        return out

    def switch(self) -> RunCheck:
        e = switch_emerged(number(self.backcopy, "prev_token_mass_trigger"))
        return RunCheck(self.label, e.met, e.criterion, "" if e.met else f"no switch ({e.detail})")

    def ratio(self) -> float | None:
        """``r``: the switching head's first-token mass relative to uniform's, last checkpoint."""
        bc = self.backcopy
        return sink_ratio(
            number(bc, "first_token_mass_nontrigger"), number(bc, "uniform_first_mass_nontrigger")
        )

    def evidence(self) -> dict[str, Any]:
        """What a sample shows of this run: where it is, its trajectory and convergence."""
        return {
            "path": None if self.path is None else str(self.path),
            "convergence": {k: v for k, v in self.convergence().items() if k != "checks"},
            "trajectory": [_rounded(r) for r in trajectory(self.checkpoints)],
        }


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}


def load_lab_runs(folder: Path) -> list[LabRun]:
    """Every readable ``train.json`` below ``folder`` (sorted by path), each configuration once
    (sweeps share runs: the same run in two folders is one sample); SinklabError if ``folder`` is
    not a folder. Unreadable files are skipped (logged)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise SinklabError(f"--lab {str(folder)!r} is not a folder; pass a folder of train runs")
    runs: list[LabRun] = []
    seen: set[tuple] = set()
    for path in sorted(folder.rglob("train.json")):
        try:
            raw = restore_non_finite(read_json(path, "lab run", "lab JSON"))
            run = LabRun.from_json(raw, path.parent)
        except (SinklabError, OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            log.warning("skipping %s: %s", path, exc)
            continue
        if run.key() in seen:  # one run found in two sweeps' folders is one sample, not two
            log.info("skipping %s: the same configuration as a run already read", path)
            continue
        seen.add(run.key())
        runs.append(run)
    return runs


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _bc(key: str) -> Callable[[dict[str, Any]], float | None]:
    """A checkpoint's backcopy ``key``."""
    return lambda c: number(c["backcopy"], key) if isinstance(c.get("backcopy"), dict) else None


def _val(key: str) -> Callable[[dict[str, Any]], float | None]:
    """A tail checkpoint's validation ``key`` (``val``: e.g. ``damage``)."""
    return lambda c: number(c["val"], key) if isinstance(c.get("val"), dict) else None


def _bc_rate(c: dict[str, Any]) -> float | None:
    """The backcopy sink rate at eps 0.3 (every head's first-token mass over all queries)."""
    bc = c.get("backcopy")
    rate = bc.get("sink_rate") if isinstance(bc, dict) else None
    return number(rate, "0.3") if isinstance(rate, dict) else None


def _paired_tail(a: dict[int, float], b: dict[int, float]) -> list[list[float]]:
    """``[[step, a - b]]`` at the tail steps both runs recorded."""
    return [[s, a[s] - b[s]] for s in sorted(set(a) & set(b))]


def _uses_bos(run: LabRun) -> bool:
    return run.config.get("data") in WITH_BOS


def _backcopy(run: LabRun) -> bool:
    return run.config.get("task", "backcopy" if run.backcopy else "text") == "backcopy"


class _Compared:
    """Collects a comparison's runs once each: their convergence and emergence checks. A run is
    known by its whole configuration (:meth:`LabRun.key`), not by its display label: two runs
    that differ only in lr, steps or size share a label, and each must be checked (a run that
    did not converge must not hide behind a converged twin)."""

    def __init__(self) -> None:
        self.convergence: dict[tuple, RunCheck] = {}
        self.emergence: dict[tuple, RunCheck] = {}

    def runs(self, *runs: LabRun) -> dict[str, Any]:
        for r in runs:
            self.convergence.setdefault(r.key(), r.converged())
        return {r.label: r.evidence() for r in runs}

    def emerged(self, check: RunCheck, *runs: LabRun) -> None:
        """Record ``check``, made on ``runs``, once per (check, runs)."""
        self.emergence.setdefault((check.name, *(r.key() for r in runs)), check)

    def into(self, m: Measurement) -> Measurement:
        m.convergence = list(self.convergence.values())
        m.emergence = list(self.emergence.values())
        return m


def _softmax1(runs: list[LabRun]) -> Measurement:
    m = Measurement(sizes={"compared": ["softmax", *NULL_VARIANTS]})
    seen = _Compared()
    by_key = {(r.key("variant"), r.config.get("variant")): r for r in runs if _backcopy(r)}
    for (key, variant), run in sorted(by_key.items(), key=lambda kv: str(kv[0])):
        if variant != "softmax":
            continue
        for other in NULL_VARIANTS:
            alt = by_key.get((key, other))
            if alt is None:
                continue
            a = number(run.backcopy, "first_token_mass_nontrigger")
            b = number(alt.backcopy, "first_token_mass_nontrigger")
            seen.emerged(run.sink(), run)  # nothing to remove without a sink in the softmax run
            seen.emerged(alt.sink_free(), alt)  # the claim: the variant needs no sink
            read = _bc("first_token_mass_nontrigger")
            m.samples.append(
                {
                    "sample": f"{run.name()}, {other}",
                    "effect": _diff(a, b),
                    "tail": _paired_tail(run.tail(read), alt.tail(read)),
                    "softmax": a,
                    other: b,
                    "null_mass_nontrigger": number(alt.backcopy, "null_mass_nontrigger"),
                    "runs": seen.runs(run, alt),
                }
            )
    if not m.samples:
        m.not_measured = "no softmax backcopy run with a softmax1 or sink twin"
    return seen.into(m)


def _sink_rate(run: LabRun) -> float | None:
    rate = run.last.get("sink_rate")
    return number(rate, "0.3") if isinstance(rate, dict) else None


def _length(runs: list[LabRun]) -> Measurement:
    """Short vs long T at equal tokens per step: ``rate_long - rate_short`` per seed, the sink
    rate of Barbero et al. (the fraction of heads whose first-token mass over all queries
    exceeds eps 0.3) at the last checkpoint; raw mass, r and uniform's mass shown beside it."""
    m = Measurement(
        sizes={
            "compared": "seq_len at equal seq_len x batch_size",
            "variant": "softmax",
            "quantity": "sink rate: fraction of heads whose first-token mass (mean over queries "
            "t >= 1 of 16 held-out sequences) exceeds eps 0.3, at the last checkpoint",
            "also_reported": "raw first-token mass and r = m / u at non-trigger queries, "
            "uniform's first-token mass u (it falls with T), log(r_long / r_short)",
        }
    )
    seen = _Compared()
    groups: dict[tuple, list[LabRun]] = {}
    for r in runs:
        c = r.config
        if c.get("variant") != "softmax" or not _backcopy(r):
            continue
        if isinstance(c.get("seq_len"), int) and isinstance(c.get("batch_size"), int):
            tokens = c["seq_len"] * c["batch_size"]
            groups.setdefault((r.key("seq_len", "batch_size"), tokens), []).append(r)
    for (_, tokens), group in sorted(groups.items(), key=lambda kv: str(kv[0])):
        by_t = {int(r.config["seq_len"]): r for r in group}
        if len(by_t) < 2:
            continue
        lo, hi = by_t[min(by_t)], by_t[max(by_t)]
        r_lo, r_hi = lo.ratio(), hi.ratio()
        ok = r_lo is not None and r_hi is not None and r_lo > 0 and r_hi > 0
        grew = [lo.sink(), hi.sink()]
        name = f"{lo.name()}, T {min(by_t)} vs {max(by_t)}"
        seen.emerged(
            RunCheck(
                name,
                any(g.met for g in grew),
                "a sink in at least one of the two runs",
                "" if any(g.met for g in grew) else "; ".join(g.reason for g in grew),
            ),
            lo,
            hi,
        )
        rate_lo, rate_hi = _bc_rate(lo.last), _bc_rate(hi.last)
        m.samples.append(
            {
                "sample": name,
                "effect": _diff(rate_hi, rate_lo),
                "tail": _paired_tail(hi.tail(_bc_rate), lo.tail(_bc_rate)),
                "log_r_ratio": math.log(r_hi / r_lo) if ok else None,
                "seq_len": [min(by_t), max(by_t)],
                "tokens_per_step": tokens,
                "r": {str(min(by_t)): r_lo, str(max(by_t)): r_hi},
                "first_token_mass": {
                    str(t): number(by_t[t].backcopy, "first_token_mass_nontrigger")
                    for t in (min(by_t), max(by_t))
                },
                "sink_rate": {str(min(by_t)): rate_lo, str(max(by_t)): rate_hi},
                "uniform_first_mass": {
                    str(t): number(by_t[t].backcopy, "uniform_first_mass_nontrigger")
                    for t in (min(by_t), max(by_t))
                },
                "probe_sink_rate": {str(t): _sink_rate(by_t[t]) for t in (min(by_t), max(by_t))},
                "runs": seen.runs(lo, hi),
            }
        )
    if not m.samples:
        m.not_measured = "no softmax runs that differ only in seq_len at equal tokens per step"
    return seen.into(m)


def _depth(runs: list[LabRun]) -> Measurement:
    """Shown when ``--lab`` holds a depth sweep; never judged (fidelity none)."""
    m = Measurement(sizes={"compared": "layers", "variant": "softmax"})
    seen = _Compared()
    groups: dict[tuple, list[LabRun]] = {}
    for r in runs:
        if r.config.get("variant") == "softmax" and isinstance(r.config.get("layers"), int):
            groups.setdefault(r.key("layers"), []).append(r)
    for group in groups.values():
        values = sorted({int(r.config["layers"]) for r in group})
        if len(values) < 2:
            continue
        lo = next(r for r in group if r.config["layers"] == values[0])
        hi = next(r for r in group if r.config["layers"] == values[-1])
        a, b = number(hi.last, "first_token_sink_mass"), number(lo.last, "first_token_sink_mass")
        m.samples.append(
            {
                "sample": lo.name(),
                "effect": _diff(a, b),
                "layers": values,
                "sink_mass": {str(values[0]): b, str(values[-1]): a},
                "runs": seen.runs(lo, hi),
            }
        )
    return seen.into(m)


def _bos(runs: list[LabRun]) -> Measurement:
    m = Measurement(sizes={"with_bos": list(WITH_BOS), "without_bos": list(WITHOUT_BOS)})
    seen = _Compared()
    groups: dict[tuple, list[LabRun]] = {}
    for r in runs:
        if r.config.get("variant") == "softmax":
            groups.setdefault(r.key("data"), []).append(r)
    for group in groups.values():
        with_bos = [r for r in group if r.config.get("data") in WITH_BOS]
        without = [r for r in group if r.config.get("data") in WITHOUT_BOS]
        for a in with_bos:
            for b in without:
                da, db = number(a.val, "damage"), number(b.val, "damage")
                if _backcopy(a):  # reliance needs a sink on BOS to rely on
                    seen.emerged(a.sink(), a)
                m.samples.append(
                    {
                        "sample": f"{a.name()}, {a.config['data']} vs {b.config['data']}",
                        "effect": _diff(da, db),
                        "tail": _paired_tail(a.tail(_val("damage")), b.tail(_val("damage"))),
                        "damage_with_bos": da,
                        "damage_without_bos": db,
                        "runs": seen.runs(a, b),
                    }
                )
    if not m.samples:
        m.not_measured = "no softmax runs trained with and without BOS, equal otherwise"
    return seen.into(m)


def _hard_switch(runs: list[LabRun]) -> Measurement:
    m = Measurement(sizes={"variant": "softmax", "data": list(WITH_BOS)})
    seen = _Compared()
    for r in runs:
        if r.config.get("variant") != "softmax" or not _uses_bos(r) or not r.backcopy:
            continue
        bc = r.backcopy
        nt, tr = number(bc, "first_token_mass_nontrigger"), number(bc, "first_token_mass_trigger")
        on, off = number(bc, "output_norm_trigger"), number(bc, "output_norm_nontrigger")
        seen.emerged(r.switch(), r)
        seen.emerged(r.sink(), r)  # the claim: the switch is a sink (not a diagonal head)
        nt_tail = r.tail(_bc("first_token_mass_nontrigger"))
        tr_tail = r.tail(_bc("first_token_mass_trigger"))
        m.samples.append(
            {
                "sample": r.name("layers", "seq_len"),
                "effect": _diff(nt, tr),
                "tail": _paired_tail(nt_tail, tr_tail),
                "first_token_mass_nontrigger": nt,
                "first_token_mass_trigger": tr,
                "output_norm_ratio": off / on if on and off is not None else None,
                "runs": seen.runs(r),
            }
        )
    if not m.samples:
        m.not_measured = "no softmax backcopy run with BOS"
    return seen.into(m)


_MAKERS: dict[str, Callable[[list[LabRun]], Measurement]] = {
    "softmax1-no-sink": _softmax1,
    "sinks-grow-depth": _depth,
    "sinks-grow-length": _length,
    "bos-reliance": _bos,
    "hard-switch-sink": _hard_switch,
}


def measure_lab_runs(
    runs: Sequence[LabRun], wanted: Iterable[str], source: dict[str, Any]
) -> dict[str, Measurement]:
    """The lab claims in ``wanted`` from ``runs``; ``source`` (where the runs came from) goes
    into every row's sizes. Each measurement carries its claim's fidelity."""
    out = {}
    for c in (c for c in wanted if c in LAB_CLAIMS):
        m = _MAKERS[c](list(runs))
        m.fidelity = FIDELITY[c]
        m.sizes.update(source)
        m.sizes["runs_found"] = len(runs)
        if m.not_measured:
            m.not_measured += f" among the {len(runs)} runs: {HOW}"
        out[c] = m
    return out


def measure_lab(folder: Path | None, wanted: Iterable[str]) -> dict[str, Measurement]:
    """The lab claims in ``wanted`` from the runs below ``folder`` (None: all not measured)."""
    wanted = [c for c in wanted if c in LAB_CLAIMS]
    if folder is None:
        return {
            c: Measurement(not_measured=f"no lab runs given: {HOW}", fidelity=FIDELITY[c])
            for c in wanted
        }
    runs = load_lab_runs(folder)
    if not runs:
        return {
            c: Measurement(
                not_measured=f"no train.json below {folder}: {HOW}", fidelity=FIDELITY[c]
            )
            for c in wanted
        }
    return measure_lab_runs(runs, wanted, {"lab": str(folder)})


def measure_cost(cfg: Any, tick: Tick) -> dict[str, Measurement]:
    """sink-cheaper: ``sinklab cost`` once per seed; exponent(diagonal) - exponent(sink) of the
    total Frobenius norm."""
    from sinklab.lab.cost import CostConfig, run_cost

    m = Measurement(
        sizes={
            "lengths": list(cfg.cost_lengths),
            "seeds": cfg.cost_seeds,
            "steps": cfg.cost_steps,
            "norm": "fro_total",
        }
    )
    for seed in range(cfg.cost_seeds):
        res = run_cost(CostConfig(lengths=tuple(cfg.cost_lengths), steps=cfg.cost_steps, seed=seed))
        fits = {task: res.fits.get(task, {}).get("fro_total") for task in ("sink", "diagonal")}
        realised = all(r["realised"] for r in res.rows)
        ok = realised and all(fits.values())
        effect = fits["diagonal"]["exponent"] - fits["sink"]["exponent"] if ok else None
        m.samples.append(
            {
                "sample": f"seed {seed}",
                "effect": effect,
                "exponent_sink": fits["sink"]["exponent"] if fits["sink"] else None,
                "exponent_diagonal": fits["diagonal"]["exponent"] if fits["diagonal"] else None,
                "realised": realised,
            }
        )
        tick("cost")
    return {"sink-cheaper": m}
