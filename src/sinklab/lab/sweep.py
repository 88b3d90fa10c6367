"""Sweeps: one training run per attention variant (``variants``) or data strategy (``data``),
everything else fixed, compared in one figure (``sweep_compare.png``) and one table (``sweep.json``,
``sweep.md``). The tokenizer is trained once and shared by every run of a sweep. A run whose
folder already holds a finished ``train.json`` with the same configuration is reused, not
retrained, so an interrupted sweep resumes where it stopped."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sinklab.errors import SinklabError
from sinklab.lab.data import DATA_STRATEGIES, LabData
from sinklab.lab.model import LAB_VARIANTS
from sinklab.lab.train import TrainConfig, TrainResult, load_result, train
from sinklab.meta import build_meta, write_json_atomic
from sinklab.outputs import output_dir

log = logging.getLogger(__name__)

SWEEPS = {"variants": ("variant", LAB_VARIANTS), "data": ("data", DATA_STRATEGIES)}
COLUMNS = (
    "name",
    "sink_rate@0.3",
    "sink_rate@0.8",
    "first_token_sink_mass",
    "ppl_with_first",
    "ppl_without_first",
    "damage",
    "final_loss",
)


@dataclass
class SweepResult:
    kind: str
    base: TrainConfig
    rows: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "base": asdict(self.base), "rows": self.rows, "meta": self.meta}

    def table(self) -> str:
        """The rows as a Markdown table."""
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for r in self.rows:
            cells = [r["name"]] + [f"{r[c]:.3f}" for c in COLUMNS[1:]]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def summary_row(name: str, result: TrainResult) -> dict[str, Any]:
    """The comparison numbers of one run (its last checkpoint and its validation)."""
    last = result.checkpoints[-1]
    tail = [v for _, v in result.loss[-20:]]
    return {
        "name": name,
        **{f"sink_rate@{k}": v for k, v in last["sink_rate"].items()},
        "first_token_sink_mass": last["first_token_sink_mass"],
        **result.val,
        "final_loss": sum(tail) / len(tail),
        "seconds": result.meta.get("seconds"),
    }


def run_sweep(
    kind: str,
    base: TrainConfig,
    out: Path,
    *,
    callback: Callable[[str, int, float], None] | None = None,
) -> SweepResult:
    """Train every value of the swept field (``out/<value>/``) and write the comparison."""
    if kind not in SWEEPS:
        raise SinklabError(f"unknown sweep {kind!r}; use one of: {', '.join(SWEEPS)}")
    t0 = time.perf_counter()
    field_name, values = SWEEPS[kind]
    rows: list[dict[str, Any]] = []
    # one tokenizer for the sweep; train() re-cuts the documents when the strategy differs
    data = LabData(replace(base, **{field_name: values[0]}).data_config())
    for value in values:
        config = replace(base, **{field_name: value})

        def step_cb(step: int, loss: float, _v: str = value) -> None:
            if callback is not None:
                callback(_v, step, loss)

        prior = load_result(out / value)
        if prior is not None and prior.config == config:  # resume: this run is already done
            log.info("reusing the finished run in %s", out / value)
            result = prior
            if prior.loss:  # show it as done
                step_cb(*prior.loss[-1])
        else:  # each run is written whole: an interrupted one leaves no half folder
            with output_dir(out / value, "train") as folder:
                result = train(config, folder, data=data, callback=step_cb)
            result.out = out / value
        rows.append(summary_row(value, result))
    meta = build_meta(params=base, seconds=time.perf_counter() - t0, swept=field_name)
    sweep = SweepResult(kind, base, rows, meta)
    write_outputs(sweep, out)
    return sweep


def write_outputs(sweep: SweepResult, out: Path) -> None:
    from sinklab.lab.plots import plot_sweep

    b = sweep.base
    fixed = "data " + b.data if sweep.kind == "variants" else "variant " + b.variant
    title = f"{sweep.kind} ({fixed}, {b.steps} steps, seed {b.seed})"
    write_json_atomic(out / "sweep.json", sweep.to_json())
    (out / "sweep.md").write_text(f"# sweep: {title}\n\n{sweep.table()}\n", encoding="utf-8")
    plot_sweep(sweep.rows, out / "sweep_compare.png", title=title)
