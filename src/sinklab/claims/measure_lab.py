"""The claims measured in the lab (trained runs read from a folder) and by the cost experiment.

Lab runs are the ``train.json`` files below ``--lab DIR`` (``sinklab train`` outputs, single runs or
sweeps). A comparison pairs runs whose configurations are equal except for the compared field;
each pair (or group) is one sample. Nothing is trained here: a claim with no matching runs is
"not measured" with what to run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sinklab.claims.measure_model import Measurement
from sinklab.errors import SinklabError
from sinklab.meta import restore_non_finite
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
    "--variant softmax|softmax1|sink --data bos|no-bos [--layers N] [--seq-len T] --seed S "
    "--out DIR/NAME`, and pass --lab DIR"
)


@dataclass(frozen=True)
class LabRun:
    path: Path
    config: dict[str, Any]
    last: dict[str, Any]  # the last checkpoint's row
    val: dict[str, Any]

    @property
    def backcopy(self) -> dict[str, Any]:
        bc = self.last.get("backcopy")
        return bc if isinstance(bc, dict) else {}

    def key(self, *drop: str) -> tuple:
        skip = IGNORED | set(drop)
        return tuple(sorted((k, repr(v)) for k, v in self.config.items() if k not in skip))

    def name(self, *fields: str) -> str:
        parts = [f"seed {self.config.get('seed', '?')}"]
        parts += [f"{f} {self.config.get(f)}" for f in fields]
        return ", ".join(parts)


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
            config, checkpoints = dict(raw["config"]), list(raw["checkpoints"])
            run = LabRun(path.parent, config, dict(checkpoints[-1]), dict(raw.get("val", {})))
        except (SinklabError, OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            log.warning("skipping %s: %s", path, exc)
            continue
        if run.key() in seen:  # one run found in two sweeps' folders is one sample, not two
            log.info("skipping %s: the same configuration as a run already read", path)
            continue
        seen.add(run.key())
        runs.append(run)
    return runs


def _num(d: dict[str, Any], key: str) -> float | None:
    v = d.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _uses_bos(run: LabRun) -> bool:
    return run.config.get("data") in WITH_BOS


def _backcopy(run: LabRun) -> bool:
    return run.config.get("task", "backcopy" if run.backcopy else "text") == "backcopy"


def _softmax1(runs: list[LabRun]) -> Measurement:
    m = Measurement(sizes={"compared": ["softmax", *NULL_VARIANTS]})
    by_key = {(r.key("variant"), r.config.get("variant")): r for r in runs if _backcopy(r)}
    for (key, variant), run in sorted(by_key.items(), key=lambda kv: str(kv[0])):
        if variant != "softmax":
            continue
        for other in NULL_VARIANTS:
            alt = by_key.get((key, other))
            if alt is None:
                continue
            a = _num(run.backcopy, "first_token_mass_nontrigger")
            b = _num(alt.backcopy, "first_token_mass_nontrigger")
            m.samples.append(
                {
                    "sample": f"{run.name()}, {other}",
                    "effect": _diff(a, b),
                    "softmax": a,
                    other: b,
                    "null_mass_nontrigger": _num(alt.backcopy, "null_mass_nontrigger"),
                }
            )
    if not m.samples:
        m.not_measured = "no softmax backcopy run with a softmax1 or sink twin"
    return m


def _grows(runs: list[LabRun], field: str) -> Measurement:
    m = Measurement(sizes={"compared": field, "variant": "softmax"})
    groups: dict[tuple, list[LabRun]] = {}
    for r in runs:
        if r.config.get("variant") == "softmax" and isinstance(r.config.get(field), int):
            groups.setdefault(r.key(field), []).append(r)
    for group in groups.values():
        values = sorted({int(r.config[field]) for r in group})
        if len(values) < 2:
            continue
        lo = next(r for r in group if r.config[field] == values[0])
        hi = next(r for r in group if r.config[field] == values[-1])
        a, b = _num(hi.last, "first_token_sink_mass"), _num(lo.last, "first_token_sink_mass")
        m.samples.append(
            {
                "sample": lo.name(),
                "effect": _diff(a, b),
                field: values,
                "sink_mass": {str(values[0]): b, str(values[-1]): a},
            }
        )
    if not m.samples:
        m.not_measured = f"no softmax runs that differ only in {field}"
    return m


def _bos(runs: list[LabRun]) -> Measurement:
    m = Measurement(sizes={"with_bos": list(WITH_BOS), "without_bos": list(WITHOUT_BOS)})
    groups: dict[tuple, list[LabRun]] = {}
    for r in runs:
        if r.config.get("variant") == "softmax":
            groups.setdefault(r.key("data"), []).append(r)
    for group in groups.values():
        with_bos = [r for r in group if r.config.get("data") in WITH_BOS]
        without = [r for r in group if r.config.get("data") in WITHOUT_BOS]
        for a in with_bos:
            for b in without:
                da, db = _num(a.val, "damage"), _num(b.val, "damage")
                m.samples.append(
                    {
                        "sample": f"{a.name()}, {a.config['data']} vs {b.config['data']}",
                        "effect": _diff(da, db),
                        "damage_with_bos": da,
                        "damage_without_bos": db,
                    }
                )
    if not m.samples:
        m.not_measured = "no softmax runs trained with and without BOS, equal otherwise"
    return m


def _hard_switch(runs: list[LabRun]) -> Measurement:
    m = Measurement(sizes={"variant": "softmax", "data": list(WITH_BOS)})
    for r in runs:
        if r.config.get("variant") != "softmax" or not _uses_bos(r) or not r.backcopy:
            continue
        bc = r.backcopy
        nt, tr = _num(bc, "first_token_mass_nontrigger"), _num(bc, "first_token_mass_trigger")
        on, off = _num(bc, "output_norm_trigger"), _num(bc, "output_norm_nontrigger")
        m.samples.append(
            {
                "sample": r.name("layers", "seq_len"),
                "effect": _diff(nt, tr),
                "first_token_mass_nontrigger": nt,
                "first_token_mass_trigger": tr,
                "output_norm_ratio": off / on if on and off is not None else None,
            }
        )
    if not m.samples:
        m.not_measured = "no softmax backcopy run with BOS"
    return m


def measure_lab(folder: Path | None, wanted: Iterable[str]) -> dict[str, Measurement]:
    """The lab claims in ``wanted`` from the runs below ``folder`` (None: all not measured)."""
    wanted = [c for c in wanted if c in LAB_CLAIMS]
    if folder is None:
        return {c: Measurement(not_measured=f"no lab runs given: {HOW}") for c in wanted}
    runs = load_lab_runs(folder)
    if not runs:
        return {c: Measurement(not_measured=f"no train.json below {folder}: {HOW}") for c in wanted}
    makers: dict[str, Callable[[], Measurement]] = {
        "softmax1-no-sink": lambda: _softmax1(runs),
        "sinks-grow-depth": lambda: _grows(runs, "layers"),
        "sinks-grow-length": lambda: _grows(runs, "seq_len"),
        "bos-reliance": lambda: _bos(runs),
        "hard-switch-sink": lambda: _hard_switch(runs),
    }
    out = {}
    for c in wanted:
        m = makers[c]()
        m.sizes["lab"] = str(folder)
        m.sizes["runs_found"] = len(runs)
        if m.not_measured:
            m.not_measured += f" among the {len(runs)} runs in {folder}: {HOW}"
        out[c] = m
    return out


def measure_cost(cfg: Any, tick: Callable[[str], None]) -> dict[str, Measurement]:
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
