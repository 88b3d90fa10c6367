"""The probe: every layer's and head's sink metrics (docs/metrics.md#probe-metrics) on any
causal LM in one forward: each layer read from the fused kernel's log-sum-exp where it can
(sinklab.seam.observe), else block by block, so no layer's ``T x T`` weights are ever formed."""

from sinklab.probe import metrics
from sinklab.probe.core import (
    LengthTrend,
    ProbeConfig,
    ProbeResult,
    check_lengths,
    probe,
    probe_lengths,
)

__all__ = [
    "LengthTrend",
    "ProbeConfig",
    "ProbeResult",
    "check_lengths",
    "metrics",
    "probe",
    "probe_lengths",
]
