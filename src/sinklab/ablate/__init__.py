"""``sinklab ablate``: the seeds' causal experiments (first token, masked sink, density,
sensitivity, geometry) as library calls returning an :class:`AblationResult`."""

from sinklab.ablate.core import (
    EXPERIMENTS,
    AblationConfig,
    AblationResult,
    check_experiment,
)
from sinklab.ablate.experiments import run_experiment
from sinklab.ablate.perplexity import Perplexity, perplexity

__all__ = [
    "EXPERIMENTS",
    "AblationConfig",
    "AblationResult",
    "Perplexity",
    "check_experiment",
    "perplexity",
    "run_experiment",
]
