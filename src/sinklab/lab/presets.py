"""Named defaults for :class:`sinklab.lab.config.TrainConfig`, per task: ``cpu`` (minutes on 2
cores) and ``gpu``. :func:`preset` builds a config from one, with overrides;
:func:`config_from_options` from ``sinklab train``'s options (:data:`OPTION_FIELDS`; the same
under ``torchrun ... -m sinklab train``)."""

from __future__ import annotations

from typing import Any

from sinklab.errors import SinklabError
from sinklab.lab.config import TrainConfig

# The backcopy CPU default: a 1-layer, 1-head decoder that grows a first-token sink (mass 0.44
# at non-trigger queries after these 300 steps, measured) in about 9 CPU-seconds: far under
# 3 minutes on 2 cores even when they are shared (docs/lab.md#backcopy).
BACKCOPY_CPU: dict[str, Any] = {
    "steps": 300,
    "layers": 1,
    "heads": 1,
    "d_model": 64,
    "seq_len": 64,
    "batch_size": 32,
    "lr": 3e-3,
    "warmup": 10,
    "weight_decay": 0.0,
}
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {},
    # ~30M parameters on 2,048-token sequences, 32,768 tokens per step: sized for sinks to
    # emerge on text within ~10 minutes of one modern GPU (Gu et al. 2025 see them after 1-2k
    # steps of a 60M model at T 2,048); benchmarks/lab_gpu.py runs its length sweep at constant
    # tokens per step. Untested on a GPU so far.
    "gpu": {
        "steps": 2000,
        "layers": 8,
        "d_model": 512,
        "heads": 8,
        "seq_len": 2048,
        "batch_size": 16,
        "lr": 1e-3,
        "warmup": 200,
        "device": "cuda",
        "vocab_size": 4096,
    },
}
TASK_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "text": PRESETS,
    "backcopy": {
        "cpu": BACKCOPY_CPU,
        # 4 layers x 8 heads, T 512: the backcopy sweeps at GPU scale
        "gpu": {
            **BACKCOPY_CPU,
            "steps": 3000,
            "layers": 4,
            "heads": 8,
            "d_model": 512,
            "seq_len": 512,
            "batch_size": 128,
            "device": "cuda",
        },
    },
}


def preset(name: str, **overrides: Any) -> TrainConfig:
    """A :class:`TrainConfig` from a named preset (``cpu``, ``gpu``) of ``overrides["task"]``
    (default ``text``), with overrides."""
    task = overrides.get("task", "text")
    presets = TASK_PRESETS.get(task, PRESETS)
    if name not in presets:
        raise SinklabError(f"unknown preset {name!r}; use one of: {', '.join(presets)}")
    return TrainConfig(**{**presets[name], **overrides})


# the TrainConfig fields a command line sets (as --task, --d-model, ...; --preset picks the rest)
OPTION_FIELDS = (
    "task",
    "variant",
    "data",
    "steps",
    "layers",
    "d_model",
    "heads",
    "seq_len",
    "batch_size",
    "vocab_size",
    "device",
    "n_triggers",
    "lr",
    "warmup",
    "decay_end",
    "weight_decay",
    "n_checkpoints",
    "seed",
)


def config_from_options(preset_name: str, **options: Any) -> TrainConfig:
    """The configuration a command line asks for: the preset of ``options["task"]`` (default
    ``text``) with every option that was given (not None) on top. Options are
    :data:`OPTION_FIELDS`."""
    if bad := sorted(set(options) - set(OPTION_FIELDS)):
        raise SinklabError(f"unknown train option(s): {', '.join(bad)}")
    return preset(preset_name, **{k: v for k, v in options.items() if v is not None})
