"""What a streaming cache keeps: :class:`CacheConfig` (the one place ``n_sink`` and ``window``
live), the registered policies (:mod:`~sinklab.stream.policy.base`: one class per policy, one
registry) and :func:`kept_positions` / :func:`kept_of`, eviction as a pure function over
positions (kept apart from the cache's tensor work)."""

from __future__ import annotations

from dataclasses import dataclass

from sinklab.errors import SinklabError
from sinklab.stream.policy.base import CachePolicy, register, registered, unregister
from sinklab.stream.policy.dense import Dense
from sinklab.stream.policy.sink import Sink
from sinklab.stream.policy.sink_auto import SinkAuto
from sinklab.stream.policy.window import Window

__all__ = [
    "CACHE_POLICIES",
    "CacheConfig",
    "CachePolicy",
    "cache_policies",
    "kept_of",
    "kept_positions",
    "policy_of",
    "register",
    "unregister",
]

# The registry: adding a policy is its file and one line here.
for _policy in (Dense(), Window(), Sink(), SinkAuto()):
    register(_policy)

#: the built-in cache policies (every streaming policy but the recompute oracle, which has no
#: cache; the streaming policies are :data:`sinklab.stream.evaluate.POLICIES`). Policies added
#: with :func:`register` later are in :func:`cache_policies`.
CACHE_POLICIES = tuple(registered())


def cache_policies() -> tuple[str, ...]:
    """Every registered cache policy's name, in registration order."""
    return tuple(registered())


def policy_of(name: str) -> CachePolicy:
    """The registered policy ``name`` (one-line error naming the registered ones)."""
    found = registered().get(name)
    if found is None:
        raise SinklabError(f"cache policy {name!r} is not one of {', '.join(registered())}")
    return found


@dataclass(frozen=True)
class CacheConfig:
    """What to keep: a registered policy's name and its sizes. ``window`` policy keeps
    ``n_sink + window`` recent positions (same memory as ``sink``, no sinks: StreamingLLM's
    collapsing baseline); ``sink-auto`` keeps ``sink_positions`` (chosen from measured attention,
    each below ``n_sink + window``) instead of 0..n_sink-1."""

    policy: str = "sink"
    n_sink: int = 4
    window: int = 508
    sink_positions: tuple[int, ...] | None = None  # only for a policy that takes positions

    def __post_init__(self) -> None:
        rule = policy_of(self.policy)
        if self.n_sink < 1 or self.window < 1:
            raise SinklabError(
                f"n_sink and window must be positive, got n_sink={self.n_sink}, "
                f"window={self.window}; e.g. --n-sink 4 --window 508"
            )
        if not rule.takes_positions and self.sink_positions is not None:
            raise SinklabError("sink_positions is only meaningful for the sink-auto policy")
        rule.check(self)

    @property
    def rule(self) -> CachePolicy:
        """The policy object this config names."""
        return policy_of(self.policy)

    @property
    def capacity(self) -> int | None:
        """Most positions kept between steps (None: unbounded)."""
        return self.rule.capacity(self)

    @property
    def sinks(self) -> tuple[int, ...]:
        """Stream positions kept as sinks."""
        return self.rule.sinks(self)

    @property
    def recent(self) -> int | None:
        """How many most-recent non-sink positions are kept."""
        return self.rule.recent(self)


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
