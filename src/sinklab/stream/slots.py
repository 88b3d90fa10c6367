"""The bookkeeping of :class:`~sinklab.stream.cache.SinkCache`, per stream,
 in pure Python (no tensors).

A cache serves ``B`` independent streams, one per batch row. Each row has its own slots (which
stream position each physical KV slot holds), its own sinks and its own position ``base``: the
model is given position ``p - base`` for the row's stream position ``p`` (``base`` is 0 unless the
cache rebased the row to keep positions below a bound). One forward is *planned* here, once for
all layers: which slot each row writes, which sinks are re-rotated by how much, which slots are
valid keys (the attention mask), and what is kept afterwards.

Layout rule (what makes ``model.generate``'s 2D left-padding mask right): a row's slots in use are
always the *last* ones of the view; its invalid slots form a prefix. Rows grow together one slot a
step (every row writes the new last slot) until a row evicts; from then on every row writes into
a free slot of its own (the evicted one, or the invalid slot just left of its valid ones).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from sinklab.errors import SinklabError
from sinklab.stream.policy import kept_of


@dataclass
class Row:
    """One stream: what each slot holds (``-1``: nothing) and where its sinks are."""

    seen: int = 0  # tokens of this stream read so far
    base: int = 0  # the model is given position p - base for stream position p
    slot_pos: list[int] = field(default_factory=list)  # per physical slot
    free: list[int] = field(default_factory=list)  # at most one slot to write next
    ring: deque[int] = field(default_factory=deque)  # non-sink slots, oldest first
    sink_slot: dict[int, int] = field(default_factory=dict)  # sink index -> slot
    sink_rot: dict[int, int] = field(default_factory=dict)  # sink index -> position rotated at
    sink_base: dict[int, int] = field(default_factory=dict)  # sink index -> base when captured
    dense_valid: list[bool] = field(default_factory=list)  # dense only: per column, a real token?

    def copy(self) -> Row:
        return Row(
            self.seen,
            self.base,
            list(self.slot_pos),
            list(self.free),
            deque(self.ring),
            dict(self.sink_slot),
            dict(self.sink_rot),
            dict(self.sink_base),
            list(self.dense_valid),
        )

    def kept(self) -> int:
        return sum(p >= 0 for p in self.slot_pos)

    def positions(self) -> list[int]:
        """Stream positions cached now, in stream order."""
        return sorted(p for p in self.slot_pos if p >= 0)


@dataclass
class Plan:
    """One forward, for every layer. ``captures``: (row, sink index, new column) of sinks read now;
    ``rewrites``: (row, sink index, destination, delta positions) where destination is a slot
    (ring) or a row of the gathered old keys (columns)."""

    q: int
    real: list[int]  # per row, new real tokens (the last ``real[b]`` of the q columns)
    kv_len: int  # keys the queries attend to
    valid: list[list[bool]]  # (B, kv_len): a real key (pre-eviction); [] = all are
    slots: list[int] | None = None  # ring: per row, the slot written
    gather: list[list[int]] | None = None  # columns: per row, old slots right-aligned (L_old)
    keep: list[list[int]] | None = None  # columns: per row, kept rows of cat(old, new)
    keep_valid: list[list[bool]] | None = None
    captures: list[tuple[int, int, int]] = field(default_factory=list)
    rewrites: list[tuple[int, int, int, int]] = field(default_factory=list)

    @property
    def masked(self) -> bool:
        """Whether the queries need a mask beyond the causal one (a row has invalid keys)."""
        if any(r != self.q for r in self.real):
            return True
        return not all(all(v) for v in self.valid)


def _sink_rewrites(b: int, row: Row, sinks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(sink index, target, delta) of each sink of ``row`` whose rotation must change before a
    step: sinks before the window sit just before it (cache-relative), the others stay."""
    kept = row.kept()
    offset = row.seen - kept
    tail_min = row.slot_pos[row.ring[0]] if row.ring else row.seen
    out = []
    for k, i in enumerate(sorted(row.sink_slot)):
        p = sinks[i]
        target = offset + k if p < tail_min else p
        if target != row.sink_rot[i]:
            delta = (target - row.base) - (p - row.sink_base[i])
            out.append((i, target, delta))
    return out


def ring_slots(rows: Sequence[Row], n_used: int, limit: int) -> tuple[list[int], int]:
    """Where each row writes its one new token, and the slots in use after (at most ``limit``):
    rows with a free slot use it; if none has one, all take the next slot (they grow together);
    else a row without takes its last invalid slot, or the next slot if it has none."""
    if not any(r.free for r in rows) and n_used < limit:
        return [n_used] * len(rows), n_used + 1
    grow = False
    slots = []
    for r in rows:
        if r.free:
            slots.append(r.free[-1])
            continue
        invalid = [s for s in range(n_used) if r.slot_pos[s] < 0]
        if invalid:
            slots.append(invalid[-1])
        else:
            slots.append(n_used)
            grow = True
    return slots, n_used + grow


def plan_ring(
    rows: Sequence[Row], n_used: int, limit: int, sinks: Sequence[int], recent: int
) -> tuple[Plan, int]:
    """One token for every row (no padding): write a slot each, evict past the window."""
    sink_index = {p: i for i, p in enumerate(sinks)}
    slots, n_used = ring_slots(rows, n_used, limit)
    plan = Plan(1, [1] * len(rows), n_used, [], slots=slots)
    for b, (row, slot) in enumerate(zip(rows, slots, strict=True)):
        for i, target, delta in _sink_rewrites(b, row, sinks):
            row.sink_rot[i] = target
            plan.rewrites.append((b, i, row.sink_slot[i], delta))
        if row.free and row.free[-1] == slot:
            row.free.pop()
        while len(row.slot_pos) < n_used:
            row.slot_pos.append(-1)
        t = row.seen
        row.slot_pos[slot] = t
        if t in sink_index:
            i = sink_index[t]
            row.sink_slot[i], row.sink_rot[i], row.sink_base[i] = slot, t, row.base
            plan.captures.append((b, i, 0))
        else:
            row.ring.append(slot)
        plan.valid.append([p >= 0 for p in row.slot_pos[:n_used]])
        row.seen += 1
        while len(row.ring) > recent:
            old = row.ring.popleft()
            row.slot_pos[old] = -1
            row.free.append(old)
    return plan, n_used


def plan_columns(
    rows: Sequence[Row],
    q: int,
    real: Sequence[int],
    sinks: Sequence[int],
    recent: int,
) -> tuple[Plan, int]:
    """``q`` columns, of which row ``b``'s last ``real[b]`` are its new tokens (left padding):
    gather every row's kept keys right-aligned, attend (old, new), keep what the policy keeps and
    re-pack each row right-aligned into slots ``[L - kept, L)``."""
    sink_index = {p: i for i, p in enumerate(sinks)}
    old = [sorted((p, s) for s, p in enumerate(r.slot_pos) if p >= 0) for r in rows]
    width = max((len(o) for o in old), default=0)
    plan = Plan(q, list(real), width + q, [], gather=[], keep=[], keep_valid=[])
    kept: list[list[int]] = []  # per row: stream positions kept after the step
    index: list[dict[int, int]] = []  # per row: stream position -> row of cat(old, new)
    for b, (row, o, r) in enumerate(zip(rows, old, real, strict=True)):
        pad = width - len(o)
        plan.gather.append([0] * pad + [s for _, s in o])  # type: ignore[union-attr]
        row_of_slot = {s: pad + k for k, (_, s) in enumerate(o)}
        for i, target, delta in _sink_rewrites(b, row, sinks):
            row.sink_rot[i] = target
            plan.rewrites.append((b, i, row_of_slot[row.sink_slot[i]], delta))
        plan.valid.append([False] * pad + [True] * len(o) + [False] * (q - r) + [True] * r)
        new = list(range(row.seen, row.seen + r))
        at = {p: pad + k for k, (p, _) in enumerate(o)}
        at.update({p: width + q - r + k for k, p in enumerate(new)})
        for k, p in enumerate(new):
            if p in sink_index:
                i = sink_index[p]
                row.sink_rot[i], row.sink_base[i] = p, row.base
                plan.captures.append((b, i, q - r + k))
        kept.append(kept_of([p for p, _ in o] + new, sinks, recent))
        index.append(at)
        row.seen += r
    n_used = max((len(k) for k in kept), default=0)
    for row, keep, at in zip(rows, kept, index, strict=True):
        pad = n_used - len(keep)
        plan.keep.append([0] * pad + [at[p] for p in keep])  # type: ignore[union-attr]
        plan.keep_valid.append([False] * pad + [True] * len(keep))  # type: ignore[union-attr]
        rot, capt = row.sink_rot, row.sink_base
        row.slot_pos, row.free, row.ring = [-1] * pad + keep, [], deque()
        row.sink_slot, row.sink_rot, row.sink_base = {}, {}, {}
        for k, p in enumerate(keep):
            if p in sink_index:
                i = sink_index[p]
                row.sink_slot[i], row.sink_rot[i], row.sink_base[i] = pad + k, rot[i], capt[i]
            else:
                row.ring.append(pad + k)
    return plan, n_used


def real_tokens(rows: Sequence[Row], q: int, last: Sequence[int]) -> list[int]:
    """New real tokens per row from the last position each row was given (left padding), or
    :class:`SinklabError` when the positions do not continue the rows' streams."""
    real = []
    for row, p in zip(rows, last, strict=True):
        r = p + 1 - (row.seen - row.base)
        if not 1 <= r <= q:
            first = p - q + 1
            raise SinklabError(
                f"the model was given positions from {first} but this SinkCache has seen "
                f"{row.seen - row.base} tokens; pass the whole sequence (or its full attention "
                "mask) to generate to continue it, or call cache.reset() to start a new prompt"
            )
        real.append(r)
    return real
