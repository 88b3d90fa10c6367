"""The claims sinklab tests, as data: what each says, where it is measured, its effect's sign
and threshold.

One entry per row of the table in ``docs/claims.md`` (the test suite checks they agree). A
verdict is computed from these fields and the measured samples by :mod:`sinklab.claims.rules`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sinklab.claims.rules import DIRECTIONS, Interval, Verdict, decide
from sinklab.errors import SinklabError

SOURCES = ("model", "lab", "cost")  # where the samples come from: texts, lab runs, cost fits
SITES = (
    "attention weights",
    "values",
    "attention output",
    "attention input",
    "residual stream",
    "output logits",
    "parameters",
)


@dataclass(frozen=True)
class Claim:
    id: str
    statement: str
    paper: str
    protocol: str
    effect: str  # what one sample's number is
    site: str
    direction: str  # "above": effect > threshold; "below": effect < threshold
    threshold: float
    source: str  # one of SOURCES

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS or self.site not in SITES:
            raise SinklabError(f"claim {self.id}: bad direction {self.direction} or site")
        if self.source not in SOURCES or not math.isfinite(self.threshold):
            raise SinklabError(f"claim {self.id}: bad source {self.source} or threshold")


CLAIMS: tuple[Claim, ...] = (
    Claim(
        "first-token-sinks",
        "Many heads put their attention on the first token",
        "Xiao et al. 2024 (StreamingLLM); Barbero et al. 2025",
        "probe",
        "sink rate: fraction of heads with sink mass > {eps:g} (q0 = {q0})",
        "attention weights",
        "above",
        0.25,
        "model",
    ),
    Claim(
        "sink-value-small",
        "The sink is a near no-op: its value vector carries little",
        "Xiao et al. 2024 (StreamingLLM)",
        "probe",
        "geometric mean over sink heads of ||v_0|| / mean_j>=1 ||v_j||",
        "values",
        "below",
        1.0,
        "model",
    ),
    Claim(
        "sink-output-small",
        "The sink is a near no-op: it adds little to the head's output",
        "Xiao et al. 2024 (StreamingLLM)",
        "probe",
        "geometric mean over sink heads of sink_output_share / sink_mass",
        "attention output",
        "below",
        1.0,
        "model",
    ),
    Claim(
        "evict-sinks-collapse",
        "Evicting the sink tokens from a streaming cache collapses the output",
        "Xiao et al. 2024 (StreamingLLM)",
        "stream: window vs sink policy, same memory",
        "log(PPL_window / PPL_sink) on targets after eviction starts (log 2: twice the PPL)",
        "output logits",
        "above",
        math.log(2.0),
        "model",
    ),
    Claim(
        "softmax1-no-sink",
        "softmax + 1 or a learned sink logit removes the need for a first-token sink",
        "Miller 2023 (attention is off by one); Gu et al. 2025",
        "lab backcopy: softmax vs softmax1 / sink variants",
        "first-token mass at non-trigger queries, softmax minus the variant",
        "attention weights",
        "above",
        0.0,
        "lab",
    ),
    Claim(
        "sink-stops-mixing",
        "Sinks stop over-mixing: masking the sink raises Jacobian sensitivity",
        "Barbero et al. 2025",
        "ablate sensitivity: sink masked in every layer vs not",
        "log(S_masked / S), S = mean ||d h_L[t] / d x_i||_F over t > i >= 1",
        "residual stream",
        "above",
        0.0,
        "model",
    ),
    Claim(
        "sinks-grow-depth",
        "Sinks are more prominent in deeper models",
        "Barbero et al. 2025",
        "lab backcopy: depth sweep",
        "mean sink mass, deepest run minus shallowest",
        "attention weights",
        "above",
        0.0,
        "lab",
    ),
    Claim(
        "sinks-grow-length",
        "Sinks are more prominent with longer training contexts",
        "Barbero et al. 2025",
        "lab backcopy: training-length sweep",
        "mean sink mass, longest-T run minus shortest",
        "attention weights",
        "above",
        0.0,
        "lab",
    ),
    Claim(
        "bos-reliance",
        "When BOS is always first in training, removing it at inference hurts",
        "Barbero et al. 2025",
        "lab: trained with BOS vs without BOS",
        "damage(with BOS) - damage(without BOS), damage = ppl_without_first / ppl_with_first - 1",
        "output logits",
        "above",
        0.0,
        "lab",
    ),
    Claim(
        "first-token-cosine",
        "In middle layers the first token's cosine with the other tokens is <= 0",
        "Súkeník et al., Sink vs. diagonal patterns (docs/science.md#geometry)",
        "geometry at the attention input",
        "mean over the middle layers of mean_j>=1 cos(x_0, x_j) after the input norm",
        "attention input",
        "below",
        0.0,
        "model",
    ),
    Claim(
        "density-oversmooths",
        "Denser attention raises token similarity (oversmoothing)",
        "Súkeník et al., Sink vs. diagonal patterns (docs/science.md#oversmoothing)",
        "density mix: lam = 0.5 in the middle layers vs unmodified",
        "token similarity after the modified layers, perturbed minus unmodified",
        "attention input",
        "above",
        0.0,
        "model",
    ),
    Claim(
        "hard-switch-sink",
        "A hard attention switch is implemented by a sink",
        "Súkeník et al., Sink vs. diagonal patterns (docs/science.md#hard-switch); Guo et al. 2024",
        "lab backcopy: softmax with BOS",
        "first-token mass at non-trigger minus trigger queries of the switching head",
        "attention weights",
        "above",
        0.0,
        "lab",
    ),
    Claim(
        "sink-cheaper",
        "A sink costs less than a diagonal pattern: norm ~ T vs T^1.5",
        "Súkeník et al., Sink vs. diagonal patterns (docs/science.md#sink-vs-diagonal-cost)",
        "cost: smallest-norm fits of one attention layer",
        "exponent(diagonal) - exponent(sink) of ||W_QK||_F + ||W_VO||_F against T",
        "parameters",
        "above",
        0.0,
        "cost",
    ),
)

CLAIM_IDS = tuple(c.id for c in CLAIMS)


def get_claim(claim_id: str) -> Claim:
    for c in CLAIMS:
        if c.id == claim_id:
            return c
    raise SinklabError(f"unknown claim {claim_id!r}; claims are: {', '.join(CLAIM_IDS)}")


def judge(
    claim_id: str,
    effects: Sequence[float | None],
    *,
    not_measured: str | None = None,
    seed: int = 0,
) -> tuple[Interval | None, Verdict]:
    """The rule of docs/claims.md applied to ``effects`` (one per sample) of a registered claim:
    its bootstrap interval and verdict against the claim's direction and threshold."""
    c = get_claim(claim_id)
    return decide(effects, c.direction, c.threshold, not_measured=not_measured, seed=seed)
