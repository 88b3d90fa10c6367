"""The probe: every layer's and head's sink metrics (docs/metrics.md#probe-metrics) on any
causal LM, chunked so no layer's ``T x T`` weights outlive their query block."""

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
