"""Ablation config and result, and the helpers the experiments share
(:func:`sinklab.ablate.experiments.run_experiment` runs one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sinklab.errors import SinklabError
from sinklab.interventions import FIRST_TOKEN_MODES
from sinklab.meta import write_json_atomic

EXPERIMENTS = ("first-token", "mask-sink", "density", "sensitivity", "geometry")
DEFAULT_MODES = ("keep", "drop", "bos", "newline", "word")
DEFAULT_LAMS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)
ProgressCallback = Callable[[int, int], None]


def check_experiment(name: str) -> str:
    if name not in EXPERIMENTS:
        raise SinklabError(f"unknown experiment {name!r}; choose one of: {', '.join(EXPERIMENTS)}")
    return name


@dataclass(frozen=True)
class AblationConfig:
    """Parameters of all experiments (each reads its own); recorded in ``meta.params``."""

    q0: int = 0  # probe: first query counted in sink mass
    eps: tuple[float, ...] = (0.3, 0.8)  # probe: sink-head thresholds
    positions: tuple[int, ...] = (0,)  # sink key positions masked by mask-sink / sensitivity
    layers: tuple[int, ...] | None = None  # layers of the "all" condition / density (None = all)
    heads: tuple[int, ...] | None = None  # heads masked / mixed (None = all)
    modes: tuple[str, ...] = DEFAULT_MODES  # first-token conditions
    lams: tuple[float, ...] = DEFAULT_LAMS  # density: lam values in [0, 1]
    grid: int = 16  # sensitivity: grid x grid (t, i) positions
    probes: int = 8  # sensitivity: Rademacher probes per query (0 = exact Frobenius norm)
    first_target: int = 2  # perplexity scores ids[first_target:]
    seed: int = 0

    def __post_init__(self) -> None:
        if self.q0 < 0:
            raise SinklabError(f"q0 must be >= 0, got {self.q0}; use e.g. --q0 0")
        for name in ("positions", "layers", "heads"):
            vals = getattr(self, name)
            if vals is not None and (not vals or min(vals) < 0):
                raise SinklabError(f"{name} must be non-empty integers >= 0, got {vals}")
        bad = [lam for lam in self.lams if not 0.0 <= lam <= 1.0]
        if not self.lams or bad:
            raise SinklabError(
                f"lam must be in [0, 1] (0 = diagonal, 1 = uniform causal), got {bad or 'none'}; "
                "pass e.g. --lams 0,0.5,1"
            )
        unknown = [m for m in self.modes if m not in FIRST_TOKEN_MODES]
        if not self.modes or unknown:
            raise SinklabError(
                f"unknown first-token modes {unknown}; use: {', '.join(FIRST_TOKEN_MODES)}"
            )
        if not 2 <= self.grid <= 256:
            raise SinklabError(f"grid must be in 2..256, got {self.grid}; e.g. --grid 16")
        if self.probes < 0:
            raise SinklabError(f"probes must be >= 0 (0 = exact), got {self.probes}")
        if self.first_target < 2:
            raise SinklabError(f"first_target must be >= 2, got {self.first_target}")

    def check_tokens(self, n_tokens: int) -> None:
        """Cheap checks against the input length (before any model is loaded)."""
        if n_tokens < max(8, self.first_target + 2):
            raise SinklabError(f"ablations need at least 8 tokens, got {n_tokens}; use --tokens 64")
        if self.q0 >= n_tokens:
            raise SinklabError(f"q0 = {self.q0} must be below the {n_tokens} tokens")
        if set(range(n_tokens)) <= set(self.positions):
            raise SinklabError(
                f"positions {list(self.positions)} mask every key position 0..{n_tokens - 1}; "
                "no query would have a key left: mask fewer positions"
            )
        if max(self.positions) >= n_tokens:
            raise SinklabError(
                f"position {max(self.positions)} is out of range: the input has positions "
                f"0..{n_tokens - 1}"
            )
        if self.grid > n_tokens:
            raise SinklabError(
                f"grid {self.grid} exceeds the {n_tokens} tokens; use a smaller grid"
            )

    def check_model(self, n_layers: int, n_heads: int) -> None:
        for name, vals, n in (("layer", self.layers, n_layers), ("head", self.heads, n_heads)):
            bad = [v for v in vals or () if v >= n]
            if bad:
                raise SinklabError(
                    f"{name} {bad[0]} is out of range: this model has {name}s 0..{n - 1}; "
                    f"pass {name}s in that range"
                )


@dataclass
class AblationResult:
    """One experiment's numbers: ``conditions`` maps a condition to its numbers (scalars/lists)."""

    experiment: str
    config: AblationConfig
    conditions: dict[str, dict[str, Any]]
    finding: str
    extra: dict[str, Any] = field(default_factory=dict)  # matrices, grids, skipped conditions
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "experiment": self.experiment,
            "finding": self.finding,
            "conditions": self.conditions,
            **self.extra,
        }

    def save(self, out_dir: Path) -> Path:
        """Write ``out_dir/ablate.json``; returns its path."""
        return write_json_atomic(Path(out_dir) / "ablate.json", self.to_json())

    def figure(self, path: Path) -> Any:
        """Draw the figure to ``path`` (PNG; plotted numbers in ``path.with_suffix(".json")``)."""
        from sinklab.ablate import plots

        return plots.PLOTS[self.experiment](self.to_json(), Path(path))


def model_shape(model: nn.Module) -> tuple[int, int]:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    cfg = cfg or model.config
    return int(cfg.num_hidden_layers), int(cfg.num_attention_heads)


def thirds(n_layers: int) -> dict[str, tuple[int, ...]]:
    """Layer groups: first / middle / last third (np.array_split sizes)."""
    chunks = torch.arange(n_layers).tensor_split(3)
    return {
        name: tuple(int(x) for x in c)
        for name, c in zip(("first third", "middle third", "last third"), chunks, strict=True)
        if len(c)
    }


def mean(xs: Any) -> float:
    t = torch.as_tensor(xs, dtype=torch.float64)
    return float(t.nanmean()) if t.numel() else float("nan")
