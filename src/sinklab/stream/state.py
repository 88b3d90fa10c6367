"""One stream of a :class:`~sinklab.stream.cache.SinkCache` as a value that can leave the cache
and come back: :class:`StreamState` (what :meth:`SinkCache.state` returns and
:meth:`SinkCache.from_state` rebuilds a cache from).

Why: a server keeps many conversations but decodes only the busy ones together; a conversation
leaves the batch between its turns and must survive a restart. A state is the stream's kept keys
and values *as the cache holds them* (never re-rotated, so nothing drifts), in stream order, the
sinks' original keys, and the bookkeeping of :class:`~sinklab.stream.slots.Row` (positions, sinks'
rotations, the position base). Rebuilt, a stream gives the logits it would have given had it never
left (the keys are the same numbers; only their slot order may differ, which attention ignores).

Only bounded caches of one kind of layer are served (``sink``, ``window``, ``sink-auto`` policies
on models without the hybrid sliding-window layers): a dense stream has no bound to keep, and a
hybrid model's sliding layers share one cache across rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from sinklab.errors import SinklabError
from sinklab.stream.policy import CacheConfig
from sinklab.stream.slots import Row

_ROW_FIELDS = ("seen", "base", "positions", "ring", "sinks")


@dataclass
class StreamState:
    """One stream, compacted: ``positions[k]`` is the stream position whose key and value sit at
    index ``k`` of every layer's ``keys``/``values`` (H_kv, kept, D); ``ring``: the indices of the
    non-sinks, oldest first; ``sinks``: sink index -> (index, position rotated at, base when read);
    ``tensors``: ``"{layer}.keys"``, ``"{layer}.values"``, ``"{layer}.sink_keys"`` (empty when the
    stream has read nothing)."""

    config: CacheConfig
    seen: int = 0
    base: int = 0
    positions: list[int] = field(default_factory=list)
    ring: list[int] = field(default_factory=list)
    sinks: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)

    @property
    def kept(self) -> int:
        return len(self.positions)

    def to_json(self) -> dict[str, Any]:
        """Everything but the tensors, as JSON (the tensors go to safetensors beside it)."""
        cfg = self.config
        return {
            "config": {
                "policy": cfg.policy,
                "n_sink": cfg.n_sink,
                "window": cfg.window,
                "sink_positions": list(cfg.sink_positions) if cfg.sink_positions else None,
            },
            "seen": self.seen,
            "base": self.base,
            "positions": self.positions,
            "ring": self.ring,
            "sinks": {str(i): list(v) for i, v in self.sinks.items()},
        }

    @classmethod
    def from_json(
        cls, data: dict[str, Any], tensors: dict[str, Tensor], n_layers: int | None = None
    ) -> StreamState:
        """The inverse of :meth:`to_json`; a malformed record raises :class:`SinklabError`
        (``n_layers``: the model's layer count, which the tensors must cover; see :meth:`check`)."""
        try:
            c = data["config"]
            pos = c.get("sink_positions")
            config = CacheConfig(
                str(c["policy"]), int(c["n_sink"]), int(c["window"]), tuple(pos) if pos else None
            )
            state = cls(
                config,
                int(data["seen"]),
                int(data["base"]),
                [int(p) for p in data["positions"]],
                [int(k) for k in data["ring"]],
                {int(i): tuple(int(x) for x in v) for i, v in data["sinks"].items()},  # type: ignore[misc]
                dict(tensors),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise SinklabError(f"not a stream state ({type(err).__name__}: {err})") from None
        state.check(n_layers)
        return state

    def check(self, n_layers: int | None = None) -> None:
        """Refuse a state whose parts do not fit together (a corrupt or hand-edited file).

        A state that holds tensors must hold exactly ``{i}.keys``, ``{i}.values`` and
        ``{i}.sink_keys`` for every layer ``i`` below ``n_layers`` (the model's layer count;
        None: one past the highest layer named), so that a missing tensor is refused here, not
        by every later turn."""
        n = self.kept
        cap = self.config.capacity
        ok = (
            cap is not None
            and n <= cap
            and self.positions == sorted(set(self.positions))
            and all(0 <= p < self.seen for p in self.positions)
            and 0 <= self.base <= self.seen
            and sorted(self.ring + [k for k, _, _ in self.sinks.values()]) == list(range(n))
            and all(0 <= i < len(self.config.sinks) for i in self.sinks)
        )
        if not ok:
            raise SinklabError("the stream state's positions, ring and sinks do not fit together")
        if n and not self.tensors:
            raise SinklabError(f"the stream state keeps {n} positions but has no tensors")
        if self.tensors:
            _check_layers(self.tensors, n_layers)
        for name, t in self.tensors.items():
            want = len(self.config.sinks) if name.endswith(".sink_keys") else n
            if t.dim() != 3 or t.shape[1] != want:
                raise SinklabError(
                    f"tensor {name} has shape {tuple(t.shape)}; expected (heads, {want}, dim)"
                )


_LAYER_TENSORS = ("keys", "values", "sink_keys")


def _check_layers(tensors: dict[str, Tensor], n_layers: int | None) -> None:
    """Refuse ``tensors`` unless they are exactly each layer's keys, values and sink keys."""
    found: set[tuple[int, str]] = set()
    for name in tensors:
        layer, _, kind = name.partition(".")
        if not layer.isdigit() or kind not in _LAYER_TENSORS:
            raise SinklabError(f"the stream state holds an unknown tensor {name!r}")
        found.add((int(layer), kind))
    count = n_layers if n_layers is not None else 1 + max((i for i, _ in found), default=-1)
    want = {(i, kind) for i in range(count) for kind in _LAYER_TENSORS}
    missing = sorted(want - found)
    if missing:
        i, kind = missing[0]
        raise SinklabError(
            f"the stream state lacks tensor {i}.{kind} ({len(missing)} missing of "
            f"{len(want)} for {count} layers)"
        )
    extra = sorted(found - want)
    if extra:
        i, kind = extra[0]
        raise SinklabError(
            f"the stream state holds tensor {i}.{kind}, past the model's {count} layers"
        )


def _servable(cache: Any) -> None:
    if cache.capacity is None or cache.hybrid:
        raise SinklabError(
            "only a bounded sink cache on a model with one kind of attention layer can be "
            "saved and restored (not the dense policy, not hybrid sliding-window models)"
        )


def state_of(cache: Any, row: int = 0) -> StreamState:
    """Copy stream ``row`` of ``cache`` (a :class:`~sinklab.stream.cache.SinkCache`) out,
    compacted to its kept positions in stream order (each layer saves its own rows)."""
    _servable(cache)
    r: Row = cache.rows[row]
    order = sorted((p, s) for s, p in enumerate(r.slot_pos) if p >= 0)
    index = {s: k for k, (_, s) in enumerate(order)}
    state = StreamState(
        cache.config,
        r.seen,
        r.base,
        [p for p, _ in order],
        [index[s] for s in r.ring],
        {i: (index[s], r.sink_rot[i], r.sink_base[i]) for i, s in r.sink_slot.items()},
    )
    if not order:
        return state
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            raise SinklabError(f"layer {i} of this cache holds nothing; it cannot be saved")
        for name, tensor in layer.save_row(row, [s for _, s in order]).items():
            state.tensors[f"{i}.{name}"] = tensor
    return state


def check_states(states: Sequence[StreamState]) -> CacheConfig:
    """The one cache config of ``states`` (at least one), each checked."""
    if not states:
        raise SinklabError("a cache is rebuilt from at least one stream state")
    config = states[0].config
    if any(s.config != config for s in states):
        raise SinklabError("stream states of different cache configs cannot share a cache")
    for s in states:
        s.check()
    return config


def fill_from_states(cache: Any, states: Sequence[StreamState]) -> Any:
    """Make the fresh ``cache`` (a :class:`~sinklab.stream.cache.SinkCache` of the states'
    config) continue ``states``: row ``b`` is ``states[b]``, each row's kept slots right-aligned
    (the layout :mod:`sinklab.stream.slots` keeps; each layer restores its own tensors)."""
    _servable(cache)
    n_used = max(s.kept for s in states)
    rows = []
    for s in states:
        pad = n_used - s.kept
        rows.append(
            Row(
                seen=s.seen,
                base=s.base,
                slot_pos=[-1] * pad + list(s.positions),
                ring=deque(pad + k for k in s.ring),
                sink_slot={i: pad + k for i, (k, _, _) in s.sinks.items()},
                sink_rot={i: rot for i, (_, rot, _) in s.sinks.items()},
                sink_base={i: b for i, (_, _, b) in s.sinks.items()},
            )
        )
    cache.rows, cache.n_used = rows, n_used
    cache.seen = max(s.seen for s in states)
    with_tensors = [s for s in states if s.tensors]
    if not with_tensors:
        return cache
    names = ("keys", "values", "sink_keys")
    for i, layer in enumerate(cache.layers):
        saved = [{n: s.tensors[f"{i}.{n}"] for n in names} if s.tensors else None for s in states]
        layer.restore(saved, n_used, cache.seen, cache._device)
    return cache
