"""Ablation config and result, and the helpers the experiments share
(:func:`sinklab.ablate.registry.run_experiment` runs one from its record)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sinklab.ablate.first_token import FIRST_TOKEN_MODES
from sinklab.errors import SinklabError
from sinklab.meta import write_json_atomic
from sinklab.probe.core import ProbeConfig
from sinklab.probe.spec import DEFAULT_EPS

DEFAULT_MODES = ("keep", "drop", "bos", "newline", "word")
DEFAULT_LAMS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)
DEFAULT_TEMPERATURES = (0.5, 0.75, 1.0, 1.5, 2.0, 4.0)
DENSITY_PROTOCOLS = ("mix", "temperature", "replace")


@dataclass(frozen=True)
class AblationConfig:
    """Parameters of all experiments (each reads its own); recorded in ``meta.params``."""

    q0: int = 0  # probe: first query counted in sink mass
    eps: tuple[float, ...] = DEFAULT_EPS  # probe: sink-head thresholds
    positions: tuple[int, ...] = (0,)  # sink key positions masked by mask-sink / sensitivity
    # layers of the "all" condition / sensitivity (None = all) / density (None = middle third)
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None  # heads masked / mixed (None = all)
    modes: tuple[str, ...] = DEFAULT_MODES  # first-token conditions
    protocol: str = "mix"  # density: mix | temperature | replace (docs/experiments.md)
    lams: tuple[float, ...] = DEFAULT_LAMS  # density mix / replace: lam values in [0, 1]
    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES  # density temperature: tau > 0
    grid: int = 16  # sensitivity: grid x grid (t, i) positions
    probes: int = 8  # sensitivity: Rademacher probes per query (0 = exact Frobenius norm)
    first_target: int = 2  # perplexity scores ids[first_target:]
    seed: int = 0

    def __post_init__(self) -> None:
        if self.q0 < 0:
            raise SinklabError(f"q0 must be >= 0, got {self.q0}; use e.g. --q0 0")
        ProbeConfig(q0=self.q0, eps=self.eps)  # the probe's own rule for thresholds
        for name in ("positions", "layers", "heads"):
            vals = getattr(self, name)
            if vals is not None and (not vals or min(vals) < 0):
                raise SinklabError(f"{name} must be non-empty integers >= 0, got {vals}")
        bad = [lam for lam in self.lams if not 0.0 <= lam <= 1.0]
        if not self.lams or bad:
            raise SinklabError(
                f"lam must be in [0, 1] (0 = the model's attention, 1 = uniform causal), got "
                f"{bad or 'none'}; pass e.g. --lams 0,0.5,1"
            )
        if self.protocol not in DENSITY_PROTOCOLS:
            raise SinklabError(
                f"unknown density protocol {self.protocol!r}; use one of: "
                f"{', '.join(DENSITY_PROTOCOLS)}"
            )
        bad_t = [t for t in self.temperatures if not (math.isfinite(t) and t > 0)]
        if not self.temperatures or bad_t:
            raise SinklabError(
                f"temperatures must be finite numbers > 0 (< 1 sharper, > 1 denser), got "
                f"{bad_t or 'none'}; pass e.g. --temperatures 0.5,1,2"
            )
        unknown = [m for m in self.modes if m not in FIRST_TOKEN_MODES]
        if not self.modes or unknown:
            raise SinklabError(
                f"unknown first-token modes {unknown}; use: {', '.join(FIRST_TOKEN_MODES)}"
            )
        if not 2 <= self.grid <= 256:
            raise SinklabError(f"grid must be in 2..256, got {self.grid}; e.g. --grid 16")
        if not 0 <= self.probes <= 256:
            raise SinklabError(f"probes must be in 0..256 (0 = exact), got {self.probes}")
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
    # the record's figure function (data, path) -> Figure, set by run_experiment
    plot: Callable[[dict[str, Any], Path], Any] | None = field(
        default=None, repr=False, compare=False
    )
    shape: tuple[int, int] = (1, 0)  # (texts, tokens) of the ids it read

    def params(self) -> dict[str, Any]:
        """``meta.params``: the config's fields, the experiment and the input's size."""
        texts, tokens = self.shape
        return {**asdict(self.config), "experiment": self.experiment, "tokens": tokens,
                "texts": texts}  # fmt: skip

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
        """Draw the figure to ``path`` (PNG; plotted numbers in ``path.with_suffix(".json")``).
        Its title names the model and text of ``meta`` (:func:`sinklab.meta.attach_meta`);
        a bare result's figure is titled by its parameters alone."""
        return self._draw(Path(path))

    def figures(self) -> dict[str, Any]:
        """The experiment's matplotlib Figure by name (nothing written), with or without
        ``meta``."""
        return {self.experiment: self._draw(None)}

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per condition: its name, then each of its numbers that
        is a single value (per-layer lists and matrices stay in :meth:`to_json`)."""
        from sinklab.frames import records_frame

        rows = [
            {"condition": name, **{k: v for k, v in numbers.items() if _scalar(v)}}
            for name, numbers in self.conditions.items()
        ]
        columns = list(dict.fromkeys(k for r in rows for k in r))
        return records_frame(rows, columns)

    def _draw(self, path: Path | None) -> Any:
        if self.plot is None:
            raise SinklabError(f"no figure function for experiment {self.experiment!r}")
        from sinklab.meta import bare_meta

        data = self.to_json()
        data["meta"] = self.meta or bare_meta(self.params())
        return self.plot(data, path)


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def thirds(n_layers: int) -> dict[str, tuple[int, ...]]:
    """Layer groups: first / middle / last third (np.array_split sizes)."""
    chunks = torch.arange(n_layers).tensor_split(3)
    return {
        name: tuple(int(x) for x in c)
        for name, c in zip(("first third", "middle third", "last third"), chunks, strict=True)
        if len(c)
    }
