"""What a streaming cache keeps: :class:`CacheConfig` and :func:`kept_positions`, the eviction
policy as a pure function over positions (kept apart from the cache's tensor work)."""

from __future__ import annotations

from dataclasses import dataclass

from sinklab.errors import SinklabError

#: what a cache can keep (every streaming policy but the recompute oracle, which has no cache;
#: the streaming policies are :data:`sinklab.stream.evaluate.POLICIES`)
CACHE_POLICIES = ("dense", "window", "sink", "sink-auto")


@dataclass(frozen=True)
class CacheConfig:
    """What to keep. ``window`` policy keeps ``n_sink + window`` recent positions (same memory as
    ``sink``, no sinks: StreamingLLM's collapsing baseline); ``sink-auto`` keeps ``sink_positions``
    (chosen from measured attention, each below ``n_sink + window``) instead of 0..n_sink-1."""

    policy: str = "sink"
    n_sink: int = 4
    window: int = 508
    sink_positions: tuple[int, ...] | None = None  # only for sink-auto

    def __post_init__(self) -> None:
        if self.policy not in CACHE_POLICIES:
            raise SinklabError(
                f"cache policy {self.policy!r} is not one of {', '.join(CACHE_POLICIES)}"
            )
        if self.n_sink < 1 or self.window < 1:
            raise SinklabError(
                f"n_sink and window must be positive, got n_sink={self.n_sink}, "
                f"window={self.window}; e.g. --n-sink 4 --window 508"
            )
        if self.policy == "sink-auto":
            pos = self.sink_positions
            if not pos or len(pos) > self.n_sink or len(set(pos)) != len(pos):
                raise SinklabError(
                    f"sink-auto needs 1..{self.n_sink} distinct sink positions, got {pos!r}"
                )
            if min(pos) < 0 or max(pos) >= self.n_sink + self.window:
                raise SinklabError(
                    f"sink positions must lie in 0..{self.n_sink + self.window - 1} (they must "
                    f"still be cached when eviction starts), got {pos!r}"
                )
        elif self.sink_positions is not None:
            raise SinklabError("sink_positions is only meaningful for the sink-auto policy")

    @property
    def capacity(self) -> int | None:
        """Most positions kept between steps (None: unbounded)."""
        return None if self.policy == "dense" else self.n_sink + self.window

    @property
    def sinks(self) -> tuple[int, ...]:
        """Stream positions kept as sinks."""
        if self.policy == "sink":
            return tuple(range(self.n_sink))
        if self.policy == "sink-auto":
            return tuple(sorted(self.sink_positions or ()))
        return ()

    @property
    def recent(self) -> int | None:
        """How many most-recent non-sink positions are kept."""
        return {"dense": None, "window": self.n_sink + self.window}.get(self.policy, self.window)


def kept_positions(n_seen: int, sinks: tuple[int, ...], recent: int | None) -> list[int]:
    """The stream positions kept after ``n_seen`` tokens: the sinks seen so far plus the
    ``recent`` most recent non-sink positions, in stream order. (The eviction policy, pure.)"""
    if recent is None:
        return list(range(n_seen))
    sink_set = set(sinks)
    tail: list[int] = []
    t = n_seen - 1
    while t >= 0 and len(tail) < recent:
        if t not in sink_set:
            tail.append(t)
        t -= 1
    return sorted([s for s in sinks if s < n_seen] + tail)


def kept_of(
    positions: list[int], sinks: tuple[int, ...] | list[int], recent: int | None
) -> list[int]:
    """What the policy keeps of the stream positions ``positions`` (in stream order): the sinks
    among them plus the ``recent`` most recent others. ``kept_of(range(n), ...)`` equals
    :func:`kept_positions` ``(n, ...)``; a cache that evicted early (to fit a prompt) passes
    what it still holds plus the new tokens."""
    if recent is None:
        return list(positions)
    sink_set = set(sinks)
    others = [p for p in positions if p not in sink_set]
    tail = set(others[-recent:]) if recent > 0 else set()
    return [p for p in positions if p in sink_set or p in tail]
