"""What the probe measures (:class:`ProbeConfig`) and the sink-head thresholds every area
defaults to, kept apart from the probe's work so the metric declarations
(:mod:`sinklab.probe.spec`) and the probe (:mod:`sinklab.probe.core`) both import it, and
neither the other's module."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sinklab.errors import SinklabError

#: the sink-head thresholds every area defaults to: Gu et al.'s 0.3 and Barbero et al.'s stricter
#: 0.8 (docs/metrics.md#q0-eps)
DEFAULT_EPS: tuple[float, ...] = (0.3, 0.8)
#: what the probe measures: every metric, or only those a few columns of weights give
#: (docs/metrics.md#metric-sets)
METRIC_SETS = ("all", "fast")


@dataclass(frozen=True)
class ProbeConfig:
    """What the probe measures; every field is recorded in ``meta.params``."""

    q0: int = 0  # first query counted in means (0 = Gu et al.'s alpha); larger drops early rows
    eps: tuple[float, ...] = DEFAULT_EPS  # sink-head thresholds (docs/metrics.md#q0-eps)
    kind_floor: float = 0.3  # head_kind is "mixed" when its largest mass is below this
    sink_factor: float = 5.0  # sink position: received > factor x max(uniform, median over keys)
    max_sink_positions: int = 8  # report at most this many sink positions
    # "all", or "fast": only the metrics that need a few columns of weights (no entropy,
    # received attention or sink positions: they stay None); docs/metrics.md#metric-sets
    metrics: str = "all"

    def __post_init__(self) -> None:
        if self.metrics not in METRIC_SETS:
            raise SinklabError(
                f"metrics must be one of {', '.join(METRIC_SETS)}, got {self.metrics!r}; "
                "use --metrics all (every metric) or --metrics fast"
            )
        if isinstance(self.q0, bool) or not isinstance(self.q0, int) or self.q0 < 0:
            raise SinklabError(f"q0 must be an integer >= 0, got {self.q0!r}; use e.g. --q0 16")
        eps = tuple(self.eps) if isinstance(self.eps, Sequence) else (self.eps,)
        if not eps:
            raise SinklabError("eps is empty; pass thresholds in (0, 1), e.g. --eps 0.3,0.8")
        for e in eps:
            if not isinstance(e, int | float) or not 0.0 < float(e) < 1.0:
                raise SinklabError(
                    f"eps must lie strictly between 0 and 1, got {e!r}; use e.g. --eps 0.3,0.8"
                )
        object.__setattr__(self, "eps", tuple(float(e) for e in eps))
        if not 0.0 <= self.kind_floor <= 1.0:
            raise SinklabError(f"kind_floor must be in [0, 1], got {self.kind_floor}")
        if not self.sink_factor > 1.0:
            raise SinklabError(f"sink_factor must be > 1, got {self.sink_factor}; e.g. 5")
        if self.max_sink_positions < 1:
            raise SinklabError(f"max_sink_positions must be >= 1, got {self.max_sink_positions}")
