"""The probe: every layer's and head's sink metrics (docs/metrics.md#probe-metrics) on any
causal LM in one forward: each layer read from the fused kernel's log-sum-exp where it can
(sinklab.seam.observe), else block by block, so no layer's ``T x T`` weights are ever formed."""

import sys
import types
from typing import Any

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


class _CallableModule(types.ModuleType):
    """``sinklab.probe`` is also the probe itself: ``from sinklab import probe`` gives this
    package (Python binds a subpackage onto its parent once imported), and ``probe(model, ids)``
    then runs :func:`sinklab.probe.core.probe`."""

    def __call__(self, *args: Any, **kwargs: Any) -> ProbeResult:
        return probe(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
