"""``sink-auto``: the sinks are the positions a measurement chose (``sink_positions``, e.g. the
probe's most-attended positions on a prefix) instead of ``0..n_sink-1``, plus the window."""

from __future__ import annotations

from sinklab.errors import SinklabError
from sinklab.stream.policy.base import CachePolicy, Sizes


class SinkAuto(CachePolicy):
    name = "sink-auto"
    takes_positions = True

    def check(self, config: Sizes) -> None:
        pos = config.sink_positions
        if not pos or len(pos) > config.n_sink or len(set(pos)) != len(pos):
            raise SinklabError(
                f"sink-auto needs 1..{config.n_sink} distinct sink positions, got {pos!r}"
            )
        if min(pos) < 0 or max(pos) >= config.n_sink + config.window:
            raise SinklabError(
                f"sink positions must lie in 0..{config.n_sink + config.window - 1} (they must "
                f"still be cached when eviction starts), got {pos!r}"
            )

    def sinks(self, config: Sizes) -> tuple[int, ...]:
        return tuple(sorted(config.sink_positions or ()))
