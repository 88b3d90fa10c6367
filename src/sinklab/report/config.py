"""The report's sizes: :class:`ReportConfig` (every stage's parameters, the two presets the CLI
offers, the checks a size must pass) and :func:`parse_overrides` for ``--set KEY=VALUE``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from sinklab.errors import SinklabError
from sinklab.parsing import parse_int_list
from sinklab.probe.spec import DEFAULT_EPS

MAX_TOKENS = 1 << 20  # the largest length, window or sink count a report accepts (--set)
MAX_GRID = 32  # the largest sensitivity grid side (grid^2 Jacobian rows)


@dataclass(frozen=True)
class ReportConfig:
    """Sizes of every stage. :meth:`preset` gives the two sizes the CLI offers."""

    quick: bool = False
    probe_tokens: int = 1024  # the probe's main length
    probe_lengths: tuple[int, ...] = (128, 512, 1024, 2048)  # the length trend
    q0: int = 16  # first query counted in sink mass (docs/metrics.md#q0-eps)
    eps: float = 0.3  # sink-head threshold
    stream_tokens: int = 20000  # streaming perplexity length (eviction starts at n_sink + window)
    n_sink: int = 4
    window: int = 508  # recent tokens kept by the window and sink policies
    recompute_every: int = 500  # the recompute oracle scores every K-th position
    ablate_tokens: int = 256  # length of the ablation experiments' input
    sensitivity_grid: int = 6  # (t, i) grid side for the Jacobian experiment
    seed: int = 0
    lab_steps: int | None = None  # steps of the claims' lab runs (None: the lab size's)
    stages: tuple[str, ...] | None = None  # None = every stage

    def __post_init__(self) -> None:
        positive = {
            "probe_tokens": self.probe_tokens,
            "stream_tokens": self.stream_tokens,
            "n_sink": self.n_sink,
            "window": self.window,
            "recompute_every": self.recompute_every,
            "ablate_tokens": self.ablate_tokens,
            "sensitivity_grid": self.sensitivity_grid,
        }
        for name, value in positive.items():
            if value < 1:
                raise SinklabError(f"report {name} must be at least 1, got {value}")
            top = MAX_GRID if name == "sensitivity_grid" else MAX_TOKENS
            if value > top:
                raise SinklabError(
                    f"report {name} must be at most {top:,} (a run that fits this machine), "
                    f"got {value:,}; pass a smaller --set {name}"
                )
        if not self.probe_lengths or min(self.probe_lengths) < 2:
            raise SinklabError(
                f"report probe_lengths must be non-empty lengths >= 2, got {self.probe_lengths}"
            )
        if max(self.probe_lengths) > MAX_TOKENS:
            raise SinklabError(
                f"report probe_lengths must be at most {MAX_TOKENS:,} tokens, got "
                f"{max(self.probe_lengths):,}; pass smaller --set probe_lengths"
            )
        if self.lab_steps is not None and self.lab_steps < 10:
            raise SinklabError(f"report lab_steps must be at least 10, got {self.lab_steps}")
        if not 0 < self.eps < 1:
            raise SinklabError(f"report eps must be in (0, 1), got {self.eps}")
        if not 0 <= self.q0 < min(self.probe_tokens, self.ablate_tokens):
            raise SinklabError(
                f"report q0 must be in [0, {min(self.probe_tokens, self.ablate_tokens)}), "
                f"got {self.q0}"
            )

    def check_stream(
        self,
        stages: Sequence[str],
        max_positions: int | None = None,
        text_holds: int | None = None,
        text_name: str = "the text",
    ) -> None:
        """Refuse a streaming stage whose sinks and window are not below its length: nothing
        would ever be evicted (every policy would be dense), or, where the length was clamped to
        the model, the cache would run past the model's positions. Called before the model
        loads and again once the sizes are fitted to it (``max_positions``: the model's) and to
        the text (``text_holds``: the tokens it fills of a ``stream_tokens`` sequence, where it
        has fewer), so the report never runs to find out."""
        n = self.stream_tokens if text_holds is None else min(self.stream_tokens, text_holds)
        if "stream" not in stages or self.n_sink + self.window < n:
            return
        if n < min(self.stream_tokens, max_positions or self.stream_tokens):
            why, longer = f" ({text_name} holds no more)", " or a longer text"
        else:
            why = " (the model's positions)" if n == max_positions else ""
            longer = " or a larger --set stream_tokens"
        raise SinklabError(
            f"report n_sink + window = {self.n_sink + self.window:,} is not below stream_tokens "
            f"= {n:,}{why}, so the stream stage would evict nothing; pass a smaller --set window "
            f"(at most {max(1, n - self.n_sink - 1):,}){longer}"
        )

    @property
    def thresholds(self) -> tuple[float, ...]:
        """The page's ``eps`` first, then the stricter defaults beside it (0.3 -> 0.3, 0.8;
        0.6 -> 0.6, 0.8; 0.9 -> 0.9): every stage that probes uses these."""
        return (self.eps, *(e for e in DEFAULT_EPS if e > self.eps))

    def fit(self, max_positions: int | None, model: str) -> tuple[ReportConfig, list[str]]:
        """The sizes that run on a model with ``max_positions`` positions (every length past it
        clamped to it), and one sentence per clamp, to say so (the config records what ran)."""
        if not max_positions:
            return self, []
        notes, changes = [], {}
        for name in ("probe_tokens", "stream_tokens", "ablate_tokens"):
            value = getattr(self, name)
            if value > max_positions:
                changes[name] = max_positions
                notes.append(f"{name} {value} is past the {max_positions} positions of {model}")
        past = [n for n in self.probe_lengths if n > max_positions]
        if past:
            changes["probe_lengths"] = tuple(
                sorted({min(n, max_positions) for n in self.probe_lengths})
            )
            notes.append(
                f"probe_lengths {', '.join(map(str, past))} "
                f"{'is' if len(past) == 1 else 'are'} past the {max_positions} positions of {model}"
            )
        if not changes:
            return self, []
        fitted = replace(self, **changes)
        ran = ", ".join(f"{k}={getattr(fitted, k)}" for k in changes)
        return fitted, [f"Sizes: {'; '.join(notes)}, so the report ran {ran}."]

    @classmethod
    def preset(cls, quick: bool, **overrides: Any) -> ReportConfig:
        """Defaults for a 2-core CPU and SmolLM2: full < 15 min, quick < 3 min."""
        if quick:
            base: dict[str, Any] = dict(
                quick=True,
                probe_tokens=512,
                probe_lengths=(128, 256, 512),
                stream_tokens=4000,
                window=252,
                recompute_every=200,
                ablate_tokens=128,
                sensitivity_grid=4,
            )
        else:
            base = {}
        return cls(**{**base, **overrides})


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["window=252", "probe_lengths=128,512"]`` -> typed ReportConfig overrides (one-line
    SinklabError for an unknown key or a bad value)."""
    types = {f.name: f.type for f in fields(ReportConfig) if f.name not in ("quick", "stages")}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in types:
            raise SinklabError(
                f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(types)}"
            )
        if key in out:
            raise SinklabError(
                f"--set {key} is given twice; pass each KEY once (the last would silently win)"
            )
        if "tuple" in str(types[key]):
            out[key] = tuple(parse_int_list(value, f"--set {key}") or ())
            continue
        try:
            out[key] = float(value) if "float" in str(types[key]) else int(value)
        except ValueError:
            raise SinklabError(f"--set {item!r}: {value!r} is not a valid {key}") from None
    return out
