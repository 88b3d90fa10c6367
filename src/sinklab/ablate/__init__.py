"""``sinklab ablate``: the causal experiments of the claims (docs/science.md): first token,
masked sink, density, sensitivity, geometry, as library calls returning an
:class:`AblationResult`; one :class:`Experiment` record each (:mod:`sinklab.ablate.registry`)."""

from sinklab.ablate.core import AblationConfig, AblationResult
from sinklab.ablate.perplexity import Perplexity, perplexity
from sinklab.ablate.registry import (
    EXPERIMENTS,
    RECORDS,
    Experiment,
    check_experiment,
    experiments_for_claim,
    get_experiment,
    run_experiment,
)

__all__ = [
    "EXPERIMENTS",
    "RECORDS",
    "AblationConfig",
    "AblationResult",
    "Experiment",
    "Perplexity",
    "check_experiment",
    "experiments_for_claim",
    "get_experiment",
    "perplexity",
    "run_experiment",
]
