"""The cache-policy protocol and its one registry.

A policy says, for a :class:`~sinklab.stream.policy.CacheConfig`, which stream positions it keeps
for good (its *sinks*: re-rotated to sit just before the recent window once a gap opens, so the
query-to-sink distance stays bounded) and how many of the most recent other positions it keeps
(its *window*: contiguous, never re-rotated). Every policy of this shape runs on every path
sinklab has (the :class:`~sinklab.stream.SinkCache` step loop, the band evaluator, generation,
chat, serve), because those paths read only :meth:`CachePolicy.sinks`,
:meth:`CachePolicy.recent` and :meth:`CachePolicy.capacity`.

Adding a policy is one file with one :class:`CachePolicy` subclass and one line in
:data:`sinklab.stream.policy.REGISTRY` (or :func:`register` at run time, as the tests do).
"""

from __future__ import annotations

from typing import ClassVar, Protocol


class Sizes(Protocol):
    """What a policy reads of its :class:`~sinklab.stream.policy.CacheConfig`."""

    n_sink: int
    window: int
    sink_positions: tuple[int, ...] | None


class CachePolicy:
    """One eviction rule over stream positions. Subclasses set :attr:`name` and override what
    differs; the defaults are the sinks + window family's (``n_sink`` first positions kept,
    ``window`` most recent others)."""

    #: what ``--policy`` / ``CacheConfig.policy`` call it
    name: ClassVar[str] = ""
    #: whether its sinks come from ``CacheConfig.sink_positions`` (chosen by a measurement)
    takes_positions: ClassVar[bool] = False

    def check(self, config: Sizes) -> None:
        """Raise :class:`~sinklab.errors.SinklabError` (one line) where ``config`` does not fit
        this policy; sizes are checked by the config itself."""

    def sinks(self, config: Sizes) -> tuple[int, ...]:
        """Stream positions kept for good, ascending, each below :meth:`capacity`."""
        return tuple(range(config.n_sink))

    def recent(self, config: Sizes) -> int | None:
        """How many of the most recent non-sink positions are kept (None: every one)."""
        return config.window

    def capacity(self, config: Sizes) -> int | None:
        """Most positions kept between steps (None: unbounded). The engine sizes its slots by
        it, so it is ``len(sinks) + recent`` or more."""
        return config.n_sink + config.window


_REGISTRY: dict[str, CachePolicy] = {}


def register(policy: CachePolicy) -> CachePolicy:
    """Add ``policy`` under its name (a name already taken by another class is refused)."""
    old = _REGISTRY.get(policy.name)
    if not policy.name or (old is not None and type(old) is not type(policy)):
        raise ValueError(f"cache policy name {policy.name!r} is empty or already registered")
    _REGISTRY[policy.name] = policy
    return policy


def unregister(name: str) -> None:
    """Remove a policy added at run time (a test's toy policy)."""
    _REGISTRY.pop(name, None)


def registered() -> dict[str, CachePolicy]:
    """Every policy, in registration order (the order ``--policy all`` and the figures use)."""
    return dict(_REGISTRY)
