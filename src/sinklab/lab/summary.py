"""The lab's summary sentences, the only ones: ``sinklab train`` prints them (rank 0 of a
torchrun run too). Each reads a finished run's JSON (``train.json``,
:meth:`TrainResult.to_json`), so this module needs nothing of the trainer; a sweep's summary is
its table (:meth:`sinklab.lab.sweep.SweepResult.table`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def backcopy_sentence(bc: dict) -> str:
    """The chosen head's backcopy numbers at a checkpoint (``row["backcopy"]``)."""
    return (
        f"backcopy, head {bc['head']}: first-token mass at non-trigger queries "
        f"{bc['first_token_mass_nontrigger']:.3f}, previous-token mass at trigger queries "
        f"{bc['prev_token_mass_trigger']:.3f}, output norm non-trigger/trigger "
        f"{bc['output_norm_nontrigger']:.3f}/{bc['output_norm_trigger']:.3f}"
    )


def train_sentences(data: Mapping[str, Any]) -> list[str]:
    """The last checkpoint's sink rate (and backcopy numbers) and the validation perplexities of
    a run's JSON (``checkpoints`` and ``val``)."""
    last, v = data["checkpoints"][-1], data["val"]
    out = [backcopy_sentence(last["backcopy"])] if "backcopy" in last else []
    out.append(
        f"sink rate {last['sink_rate']}; val PPL {v['ppl_with_first']:.2f} with the first "
        f"token, {v['ppl_without_first']:.2f} without"
    )
    return out
