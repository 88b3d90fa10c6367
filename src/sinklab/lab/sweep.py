"""Sweeps: one training run per attention variant (``variants``), data strategy (``data``: the
text strategies, or BOS / no BOS for backcopy), training length (``length``: T 64, 128, 256) or
depth (``depth``: 1, 2, 4 layers), everything else fixed, compared in one figure and one table
(``sweep.json``, ``sweep.md``). Text sweeps draw ``sweep_compare.png`` (bars); backcopy sweeps
draw ``sweep_emergence.png`` (the emergence curve of each run, one line per run). The tokenizer
(text) or bigram table (backcopy) is built once and shared by every run of a sweep. A run whose
folder already holds a finished ``train.json`` with the same configuration is reused, not
retrained, so an interrupted sweep resumes where it stopped."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sinklab.errors import SinklabError
from sinklab.lab.backcopy import BackcopyData
from sinklab.lab.config import TASK_DATA, TrainConfig
from sinklab.lab.data import LabData
from sinklab.lab.model import LAB_VARIANTS
from sinklab.lab.train import EPS, TrainResult, corpus_text, load_result, train
from sinklab.meta import attach_meta, write_json_atomic, write_text_atomic
from sinklab.outputs import output_dir
from sinklab.probe.spec import rate_key
from sinklab.progress import ProgressFor, quiet_for

log = logging.getLogger(__name__)

SWEEP_KINDS = ("variants", "data", "length", "depth")
LENGTHS = (64, 128, 256)
DEPTHS = (1, 2, 4)
BACKCOPY_COLUMNS = (
    "first_token_mass_nontrigger",
    "prev_token_mass_trigger",
    "output_norm_nontrigger",
    "output_norm_trigger",
    "backcopy_loss",
)


def sweep_values(kind: str, task: str) -> tuple[str, list[tuple[str, Any]]]:
    """The swept field and its ``(run name, value)`` pairs."""
    if kind == "variants":
        return "variant", [(v, v) for v in LAB_VARIANTS]
    if kind == "data":
        return "data", [(d, d) for d in TASK_DATA[task]]
    if kind == "length":
        return "seq_len", [(f"T{t}", t) for t in LENGTHS]
    if kind == "depth":
        return "layers", [(f"L{n}", n) for n in DEPTHS]
    raise SinklabError(f"unknown sweep {kind!r}; use one of: {', '.join(SWEEP_KINDS)}")


COLUMNS = (
    "name",
    *(rate_key(e) for e in EPS),
    "first_token_sink_mass",
    "ppl_with_first",
    "ppl_without_first",
    "damage",
    "final_loss",
)


@dataclass
class SweepResult:
    """One sweep: ``kind``, the ``base`` config, the ``swept`` field, one row per run; ``meta``:
    the one provenance block (:func:`sinklab.meta.attach_meta`, params the base config)."""

    kind: str
    base: TrainConfig
    rows: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)
    swept: str = ""  # the TrainConfig field the runs differ in

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "base": asdict(self.base),
            "swept": self.swept,
            "rows": self.rows,
            "meta": self.meta,
        }

    @property
    def figure_name(self) -> str:
        """The comparison figure: each run's emergence curve (backcopy), else bars (text)."""
        return "sweep_emergence.png" if self.base.task == "backcopy" else "sweep_compare.png"

    def table(self) -> str:
        """The rows as a Markdown table."""
        cols = list(COLUMNS)
        if self.base.task == "backcopy":
            cols[3:3] = ["sink_token", *BACKCOPY_COLUMNS]
        cols.append("seconds")
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in self.rows:
            cells = [r["name"]] + [_cell(r.get(c)) for c in cols[1:]]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}"
    return "-" if value is None else repr(value) if isinstance(value, str) else str(value)


def summary_row(name: str, result: TrainResult) -> dict[str, Any]:
    """The comparison numbers of one run (its last checkpoint and its validation)."""
    last = result.checkpoints[-1]
    tail = [v for _, v in result.loss[-20:]]
    row = {
        "name": name,
        **{rate_key(float(k)): v for k, v in last["sink_rate"].items()},
        "first_token_sink_mass": last["first_token_sink_mass"],
        **result.val,
        "final_loss": sum(tail) / len(tail),
        "seconds": result.meta.get("seconds"),
    }
    if "backcopy" in last:  # the chosen head's numbers at the last checkpoint
        bc = last["backcopy"]
        row.update({k: bc[k] for k in BACKCOPY_COLUMNS})
        row.update(
            head=bc["head"], sink_token=bc["sink_token"], gate_nontrigger=bc["gate_nontrigger"]
        )
        row["null_mass_nontrigger"] = bc["null_mass_nontrigger"]
        row["bos_value_norm"] = bc["bos_value_norm"]
    return row


def run_sweep(
    kind: str,
    base: TrainConfig,
    out: Path,
    *,
    progress_for: ProgressFor = quiet_for,
) -> SweepResult:
    """Train every value of the swept field (``out/<value>/``) and write the comparison.

    ``progress_for(name)`` (:data:`~sinklab.progress.ProgressFor`) is run ``name``'s
    :data:`~sinklab.progress.Progress`, asked for as the run starts: steps done of its steps, the
    loss in the note (``loss 2.345``); a run reused from ``out`` reports its last step at once."""
    t0 = time.perf_counter()
    field_name, values = sweep_values(kind, base.task)
    rows: list[dict[str, Any]] = []
    results: list[TrainResult] = []
    # one tokenizer (text: train() re-cuts the documents per strategy) or one bigram table
    first = replace(base, **{field_name: values[0][1]})
    data: LabData | BackcopyData
    if base.task == "backcopy":
        data = BackcopyData(first.backcopy_config())
    else:
        data = LabData(first.data_config())
    for name, value in values:
        config = replace(base, **{field_name: value})

        progress = progress_for(name)
        prior = load_result(out / name)
        if prior is not None and prior.config == config:  # resume: this run is already done
            log.info("reusing the finished run in %s", out / name)
            result = prior
            if prior.loss:  # show it as done
                step, loss = prior.loss[-1]
                progress(step, config.steps, f"loss {loss:.3f}")
        else:  # each run is written whole: an interrupted one leaves no half folder
            with output_dir(out / name, "train") as folder:
                result = train(config, folder, data=data, progress=progress)
            result.out = out / name
        rows.append(summary_row(name, result))
        results.append(result)
    sweep = SweepResult(kind, base, rows, swept=field_name)
    attach_meta(sweep, None, corpus_text(), base, time.perf_counter() - t0)
    write_outputs(sweep, out, results)
    return sweep


def write_outputs(sweep: SweepResult, out: Path, results: list[TrainResult]) -> None:
    from sinklab.lab.plots import plot_emergence_curves, plot_sweep

    b = sweep.base
    fixed = "data " + b.data if sweep.kind == "variants" else "variant " + b.variant
    title = f"{b.task} {sweep.kind} ({fixed}, {b.steps} steps, seed {b.seed})"
    write_json_atomic(out / "sweep.json", sweep.to_json())
    write_text_atomic(out / "sweep.md", f"# sweep: {title}\n\n{sweep.table()}\n")
    if b.task == "backcopy":
        curves = {r["name"]: res.checkpoints for r, res in zip(sweep.rows, results, strict=True)}
        plot_emergence_curves(curves, out / sweep.figure_name, title=title)
    else:
        plot_sweep(sweep.rows, out / sweep.figure_name, title=title)
