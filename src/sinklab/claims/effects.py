"""Per-sample effects that ``sinklab claims`` and an ``ablate`` experiment both compute, each
defined once (the definitions are docs/claims.md's table)."""

from __future__ import annotations

from collections.abc import Sequence

from sinklab.probe.geometry import middle_third


def first_token_cosine_effect(cosines: Sequence[float | None]) -> float | None:
    """``first-token-cosine`` for one sample: the mean over the middle layers
    (:func:`~sinklab.probe.geometry.middle_third` of ``len(cosines)`` layers) of the per-layer
    first-token cosine at the attention input; None when no middle layer was measured."""
    vals = [float(cosines[i]) for i in middle_third(len(cosines)) if cosines[i] is not None]
    return sum(vals) / len(vals) if vals else None
