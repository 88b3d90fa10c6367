"""Per-sample effects that ``sinklab claims`` and an ``ablate`` experiment both compute, each
defined once (the definitions are docs/claims.md's table)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from sinklab.probe.geometry import middle_third


def first_token_cosine_effect(cosines: Sequence[float | None]) -> float | None:
    """``first-token-cosine`` for one sample: the mean over the middle layers
    (:func:`~sinklab.probe.geometry.middle_third` of ``len(cosines)`` layers) of the per-layer
    first-token cosine at the attention input; None when no middle layer was measured."""
    vals = [float(cosines[i]) for i in middle_third(len(cosines)) if cosines[i] is not None]
    return sum(vals) / len(vals) if vals else None


def sensitivity_effect(sensitivity: float, masked: float) -> float | None:
    """``sink-stops-mixing`` for one sample: ``log(S_masked / S)``, S the mean Jacobian norm
    over ``t > i >= 1`` with the sink and with it masked; None unless both are positive."""
    if not (sensitivity > 0 and masked > 0):  # also False for NaN
        return None
    return math.log(masked / sensitivity)
