"""``dense``: keep everything (the unbounded baseline every bounded policy is judged against)."""

from __future__ import annotations

from sinklab.stream.policy.base import CachePolicy, Sizes


class Dense(CachePolicy):
    name = "dense"

    def sinks(self, config: Sizes) -> tuple[int, ...]:
        return ()

    def recent(self, config: Sizes) -> int | None:
        return None

    def capacity(self, config: Sizes) -> int | None:
        return None
