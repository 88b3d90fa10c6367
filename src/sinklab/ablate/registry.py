"""One record per experiment: the CLI, the report, ``sinklab claims`` and docs read these.

A new experiment is one :class:`Experiment` in :data:`RECORDS` (plus its run and plot functions):
its name, title, the claim it tests (naming the paper), the claim ids of ``sinklab claims``
(docs/claims.md), how it runs and draws, the report's caption and its summary sentence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sinklab.ablate import density, experiments
from sinklab.ablate.core import AblationConfig, AblationResult
from sinklab.errors import SinklabError
from sinklab.models.arch import model_shape
from sinklab.progress import Progress, quiet

log = logging.getLogger(__name__)

Runner = Callable[..., tuple[dict[str, dict[str, Any]], dict[str, Any], str]]


@dataclass(frozen=True)
class Experiment:
    """An experiment: ``run(model, tokenizer, ids, config, progress) -> (conditions, extra,
    finding)``, ``progress`` the one :data:`~sinklab.progress.Progress`; ``plot`` names its
    function in :mod:`sinklab.ablate.plots` (imported on use, as matplotlib is heavy)."""

    name: str
    title: str
    tests: str  # the claim it tests, in words, naming the paper
    claims: tuple[str, ...]  # claim ids (docs/claims.md)
    run: Runner
    plot: str
    caption: str  # the report's figure caption
    help: str  # one line for `sinklab ablate --help`
    texts: bool = False  # reads several texts (rows of ids) instead of the first
    # the options only this experiment (and others that list them) reads; passing one of these
    # to an experiment that does not list it is refused (``sinklab ablate`` and docs)
    options: tuple[str, ...] = ()

    def draw(self, data: dict[str, Any], path: Path | None) -> Any:
        """The experiment's Figure, written to ``path`` (PNG, plotted numbers beside it) unless
        ``path`` is None."""
        from sinklab.ablate import plots

        return getattr(plots, self.plot)(data, None if path is None else Path(path))

    def summary(self, data: dict[str, Any]) -> str | None:
        """The report's headline sentence: the title and the computed finding."""
        finding = data.get("finding")
        if not finding:
            return None
        return f"{self.title}: {finding}" + ("" if finding.endswith(".") else ".")


RECORDS: tuple[Experiment, ...] = (
    Experiment(
        "first-token",
        "Ablation: the first token",
        "Barbero et al. 2025: the sink forms at the first token whatever it is, and removing the "
        "first token (e.g. <bos>) costs quality.",
        ("bos-reliance",),
        experiments.first_token_experiment,
        "plot_first_token",
        "Perplexity on the same targets per first-token condition (log), and mean sink mass per "
        "layer.",
        "perplexity and sink rate with the first token kept, dropped or replaced",
        options=("eps",),
    ),
    Experiment(
        "mask-sink",
        "Ablation: masking the sink",
        "Barbero et al. 2025: sinks stop over-mixing; masking them (attention to the sink zeroed "
        "and renormalised in all, the first, middle or last third of the layers) costs "
        "perplexity and raises token similarity.",
        ("sink-stops-mixing",),
        experiments.mask_sink_experiment,
        "plot_mask_sink",
        "Perplexity per masking condition (log), and token similarity per layer.",
        "perplexity and token similarity with attention to the sink masked",
        options=("positions", "layers", "heads", "eps"),
    ),
    Experiment(
        "density",
        "Ablation: attention density",
        "Súkeník et al., 'Sink vs. diagonal patterns': denser attention raises token similarity "
        "(oversmoothing). The trained attention of a layer group is made denser (mix with "
        "uniform causal, or a temperature above 1) and token similarity is read after it.",
        ("density-oversmooths",),
        density.density_experiment,
        "plot_density",
        "Token similarity after the modified layers against the density parameter, at the "
        "attention input and the residual stream; perplexity; per-layer similarity per condition.",
        "token similarity after layers whose attention is made denser (--protocol), over texts",
        texts=True,
        options=("protocol", "lams", "temperatures", "layers", "heads", "texts"),
    ),
    Experiment(
        "sensitivity",
        "Ablation: sensitivity (Jacobian norms)",
        "Barbero et al. 2025: sinks stop over-mixing; masking them raises the sensitivity "
        "||d h_L[t] / d x_i|| of late representations to earlier inputs.",
        ("sink-stops-mixing",),
        experiments.sensitivity_experiment,
        "plot_sensitivity",
        "Jacobian norm matrices with and without the sink (mean over texts), and the mean by "
        "distance t - i.",
        "Jacobian norms with and without the sink masked, over several texts",
        texts=True,
        options=("grid", "probes", "positions", "layers", "heads", "texts"),
    ),
    Experiment(
        "geometry",
        "Ablation: geometry and head kinds",
        "Súkeník et al., 'Sink vs. diagonal patterns': in middle layers the first token's cosine "
        "with the other tokens is <= 0, measured where the query-key form acts (the attention "
        "input), beside the residual stream and the keys.",
        ("first-token-cosine",),
        experiments.geometry_experiment,
        "plot_geometry",
        "First-token cosine and token similarity per layer at three sites (residual stream, "
        "attention input, keys), mean over texts; head kinds per layer.",
        "first-token cosine at the residual, attention input and keys, over several texts",
        texts=True,
        options=("texts",),
    ),
)

EXPERIMENTS: tuple[str, ...] = tuple(r.name for r in RECORDS)


def get_experiment(name: str) -> Experiment:
    """The record called ``name``; SinklabError naming the choices otherwise."""
    for rec in RECORDS:
        if rec.name == name:
            return rec
    raise SinklabError(f"unknown experiment {name!r}; choose one of: {', '.join(EXPERIMENTS)}")


def check_experiment(name: str) -> str:
    """``name`` if it names a record; SinklabError naming the choices otherwise."""
    return get_experiment(name).name


def run_experiment(
    name: str,
    model: nn.Module,
    tokenizer: Any,
    ids: Tensor,
    config: AblationConfig | None = None,
    progress: Progress = quiet,
) -> AblationResult:
    """Run experiment ``name`` on ``ids`` (LongTensor (T,), or (B, T): B texts where the record
    reads several, e.g. geometry; else the first row).

    ``progress(done, total, note)`` (:data:`~sinklab.progress.Progress`) counts the experiment's
    conditions, the note naming the one just done.
    """
    record = get_experiment(name)
    config = config or AblationConfig()
    ids = torch.as_tensor(ids).long()
    ids = ids if ids.ndim == 2 else ids[None]  # (B, T)
    if not record.texts:
        ids = ids[:1]
    config.check_tokens(int(ids.shape[-1]))
    config.check_model(*model_shape(model))
    start = time.perf_counter()
    conditions, extra, finding = record.run(model, tokenizer, ids, config, progress)
    seconds = time.perf_counter() - start
    log.info("ablate %s: %.1fs: %s", name, seconds, finding)
    # meta: the caller's (sinklab.meta.attach_meta)
    shape = (int(ids.shape[0]), int(ids.shape[1]))
    return AblationResult(name, config, conditions, finding, extra, plot=record.draw, shape=shape)


def experiments_for_claim(claim_id: str) -> tuple[Experiment, ...]:
    """The experiments whose record lists ``claim_id``."""
    return tuple(r for r in RECORDS if claim_id in r.claims)
