"""The plugin's options: StreamingLLM's ``n_sink`` and ``window``, read from vLLM's
``additional_config`` under the key ``"sinklab"`` (docs/vllm.md#options).

``LLM(model, additional_config={"sinklab": {"n_sink": 4, "window": 252}})`` or
``vllm serve MODEL --additional-config '{"sinklab": {"n_sink": 4, "window": 252}}'``. Without the
key the plugin does nothing and vLLM runs as it would without it. A key it does not know, a value
that is not a positive integer, or a missing size is refused: an option is honoured or refused,
never accepted and ignored.

This module imports nothing from vLLM (nor from sinklab, which lives in another venv with another
transformers), so it is checked without starting an engine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

KEY = "sinklab"
FIELDS = ("n_sink", "window")
EXAMPLE = '{"sinklab": {"n_sink": 4, "window": 252}}'


class SinklabVllmError(ValueError):
    """A configuration the plugin refuses, said in one sentence: what is wrong, and the fix.

    A ``ValueError`` so that vLLM's argument handling reports it as a bad argument."""


@dataclass(frozen=True)
class SinkOptions:
    """Per request, keep the first ``n_sink`` tokens and the ``window`` most recent ones, as
    ``sinklab.stream.SinkCache`` with the ``sink`` policy (docs/streaming.md#policies)."""

    n_sink: int
    window: int

    def __post_init__(self) -> None:
        for name in FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SinklabVllmError(
                    f"sinklab: {name} must be a positive integer, got {value!r}; e.g. {EXAMPLE}"
                )

    @property
    def capacity(self) -> int:
        """Tokens kept per request between steps: the sinks plus the window."""
        return self.n_sink + self.window


def options_of(additional_config: object) -> SinkOptions | None:
    """The plugin's options in vLLM's ``additional_config``, or ``None`` when it has no
    ``"sinklab"`` key (the plugin is then off)."""
    if not isinstance(additional_config, Mapping) or KEY not in additional_config:
        return None
    raw = additional_config[KEY]
    if not isinstance(raw, Mapping):
        raise SinklabVllmError(
            f"sinklab: additional_config['sinklab'] must be an object, got {raw!r}; e.g. {EXAMPLE}"
        )
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise SinklabVllmError(
            f"sinklab: unknown option(s) {', '.join(map(repr, unknown))}; "
            f"the options are {', '.join(FIELDS)} (e.g. {EXAMPLE})"
        )
    missing = [name for name in FIELDS if name not in raw]
    if missing:
        raise SinklabVllmError(
            f"sinklab: missing option(s) {', '.join(missing)}; give both, e.g. {EXAMPLE}"
        )
    return SinkOptions(n_sink=raw["n_sink"], window=raw["window"])
