"""Upper bounds of the claims' sizes, in a module without torch so that ``--help`` can state
them. Each keeps one claims run within one small machine (the token counts are also capped by
the model's positions)."""

from __future__ import annotations

MAX_CLAIMS_SIZES = {
    "windows": 100,  # windows per text (samples = texts x windows)
    "grid": 64,  # sensitivity: grid x grid Jacobian norms per sample
    "probes": 256,  # sensitivity: Hutchinson probes per query
    "cost_seeds": 20,
    "cost_steps": 100_000,
    "probe_tokens": 1 << 17,
    "stream_tokens": 1 << 20,
    "sensitivity_tokens": 4096,
}
