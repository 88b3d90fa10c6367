"""``window``: the ``n_sink + window`` most recent positions and no sink: the same memory as
``sink``, StreamingLLM's collapsing baseline (docs/science.md)."""

from __future__ import annotations

from sinklab.stream.policy.base import CachePolicy, Sizes


class Window(CachePolicy):
    name = "window"

    def sinks(self, config: Sizes) -> tuple[int, ...]:
        return ()

    def recent(self, config: Sizes) -> int | None:
        return config.n_sink + config.window
