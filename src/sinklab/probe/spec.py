"""Each probe metric declared once: name, what it is per, where it is measured, how it is computed.

:data:`METRICS` is the one list. From it follow the accumulators of :mod:`sinklab.probe.capture`
(each attention metric's partial sums and reducer), the fields and JSON keys of
:class:`~sinklab.probe.core.ProbeResult` (in this order), and the table of ``docs/metrics.md``
(:func:`metrics_table`; a test checks the page holds exactly it). Definitions:
``docs/metrics.md#probe-metrics``.

Three sources: ``attention`` metrics add up partial sums chunk by chunk (:class:`Block` is what a
partial sum reads of one chunk) and reduce them once per layer; ``hidden`` metrics are computed
from one decoder block's output; ``derived`` ones are computed from the others and the config.
Each attention metric has its partial sums twice, with the same terms: from a block of weights
(``partial``, the block path) and from a whole layer's log-sum-exp (``rows``, the observation path
of :mod:`sinklab.seam.observe`, where no weights are formed: :class:`Rows`).

``needs`` names what a metric costs beyond a few columns of weights (``entropy`` and
``received``: a second fused call, with the roles of queries and keys swapped): ``--metrics
fast`` (:data:`METRIC_SETS`) measures only the metrics that need neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sinklab.probe import metrics as M
from sinklab.probe.config import DEFAULT_EPS as DEFAULT_EPS  # re-exported: areas import it here
from sinklab.probe.config import METRIC_SETS as METRIC_SETS  # re-exported
from sinklab.probe.config import ProbeConfig

if TYPE_CHECKING:
    from sinklab.seam.observe import LayerView

Term = Tensor | int  # one partial sum (or count) of one chunk


@dataclass(frozen=True)
class Block:
    """What a partial sum reads of one chunk of query rows (batch 1).

    ``weights`` (1, H, c, Tk) float32/64; ``value`` (1, H, Tk, D); ``output`` (1, H, c, D);
    ``pos0`` the key position of the first row; ``first`` whether this is the call's first chunk.
    The chunk's own keys (each key belongs to exactly one chunk) are ``own_keys``.
    """

    weights: Tensor
    value: Tensor
    output: Tensor
    pos0: int
    first: bool
    q0: int
    key: int

    @property
    def own_keys(self) -> tuple[int, int]:
        """Keys [start, end) first seen by this chunk: its rows' own positions (and every
        earlier key for the first chunk)."""
        return (0 if self.first else self.pos0), self.pos0 + self.weights.shape[-2]


@dataclass(frozen=True)
class Rows:
    """What a partial sum reads of one whole layer on the observation path (batch 1): the
    layer's :class:`~sinklab.seam.observe.LayerView`, the first counted query and the sink key."""

    view: LayerView
    q0: int
    key: int

    @property
    def n_tokens(self) -> int:
        return self.view.n_tokens


@dataclass(frozen=True)
class Metric:
    """One probe metric. ``per``: "head" (L, H), "layer" (L), "key" (L, H, T) or "model" (one
    summary); ``site``: where the number is measured; ``definition``/``notes``: the docs row."""

    name: str  # ProbeResult field and JSON key
    per: str
    source: str  # attention | hidden | derived
    site: str
    definition: str
    notes: str = ""
    in_json: bool = True
    partial: Callable[[Block], tuple[Term, ...]] | None = None  # attention: one chunk's sums
    rows: Callable[[Rows], tuple[Term, ...]] | None = None  # attention: the same, a whole layer
    needs: frozenset[str] = frozenset()  # beyond a few columns (sinklab.seam.observe.NEEDS)
    reduce: Callable[..., Tensor] | None = None  # attention: totals -> (H,) or (H, T)
    hidden: Callable[[Tensor], float] | None = None  # hidden: (T, d) -> float
    derive: Callable[[dict[str, Any], ProbeConfig], Any] | None = None  # derived

    @property
    def fast(self) -> bool:
        """Measured by ``--metrics fast``: it needs nothing beyond a few columns of weights."""
        return not self.needs


def eps_key(eps: float) -> str:
    """The JSON key of a threshold: 0.3 -> "0.3"."""
    return f"{eps:g}"


def rate_key(eps: float) -> str:
    """The flat key of a sink rate at a threshold, in tables and rows: 0.3 -> "sink_rate@0.3"."""
    return f"sink_rate@{eps_key(eps)}"


def _batch1(pair: tuple[Tensor, Any]) -> tuple[Term, ...]:
    return pair[0][0], pair[1]


def _ratio(total: Tensor, count: Term) -> Tensor:
    return M.ratio(total, count)


def _share(part: Tensor, total: Tensor) -> Tensor:
    return (part / total).float()


def _vnorm_ratio(key_norm: Tensor, others: Tensor, n_others: int) -> Tensor:
    return (key_norm / (others / max(1, n_others))).float()


def _value_partial(b: Block) -> tuple[Term, ...]:
    key_norm, others, n_others = M.value_norm_partial(b.value, b.key, *b.own_keys)
    return key_norm[0], others[0], n_others


def _share_partial(b: Block) -> tuple[Term, ...]:
    vnorm = torch.linalg.vector_norm(b.value[:, :, b.key].double(), dim=-1)  # (1, H)
    part, total = M.sink_output_partial(b.weights, vnorm, b.output, b.key, b.q0, b.pos0)
    return part[0], total[0]


def _rows_sink(r: Rows) -> tuple[Term, ...]:
    r0 = min(r.n_tokens, max(r.key, r.q0))
    a = r.view.weights_at(r.key)[0, :, r0:]  # (H, rows)
    return a.sum(-1).double(), a.shape[-1]


def _rows_diagonal(shift: int) -> Callable[[Rows], tuple[Term, ...]]:
    def partial(r: Rows) -> tuple[Term, ...]:
        d = r.view.diagonal(shift)[0, :, max(0, max(shift, r.q0) - shift) :]  # t >= max(s, q0)
        return d.sum(-1).double(), d.shape[-1]

    return partial


def _rows_entropy(r: Rows) -> tuple[Term, ...]:
    return r.view.entropy_sum(r.q0)[0], r.n_tokens - r.q0


def _rows_value(r: Rows) -> tuple[Term, ...]:
    key_norm, others, n_others = M.value_norm_partial(r.view.value, r.key)
    return key_norm[0], others[0], n_others


def _rows_share(r: Rows) -> tuple[Term, ...]:
    r0 = min(r.n_tokens, max(r.key, r.q0))
    vnorm = torch.linalg.vector_norm(r.view.value[0, :, r.key].double(), dim=-1)  # (H,)
    part = r.view.weights_at(r.key)[0, :, r0:].sum(-1).double() * vnorm
    out = r.view.output[0, :, r0:].float()
    return part, torch.linalg.vector_norm(out, dim=-1).double().sum(-1)


def _rows_received(r: Rows) -> tuple[Term, ...]:
    t = r.n_tokens
    sums = r.view.column_sums(r.q0)[0]  # (H, T)
    seen_from = torch.arange(t, device=sums.device).clamp(min=r.q0)
    return sums, t - seen_from


ATTN = "attention weights"
METRICS: tuple[Metric, ...] = (
    Metric(
        "sink_mass", "head", "attention", ATTN,
        "mean over queries `t >= max(k, q0)` of `A[t, k]`, `k = 0`",
        "`q0 = 0` is Gu et al.'s alpha; a larger `q0` drops the trivial share of the first "
        "queries, which see few keys",
        partial=lambda b: _batch1(M.sink_mass_partial(b.weights, b.key, b.q0, b.pos0)),
        rows=_rows_sink,
        reduce=_ratio,
    ),
    Metric(
        "diagonal_mass", "head", "attention", ATTN, "mean over `t >= q0` of `A[t, t]`",
        partial=lambda b: _batch1(M.diagonal_partial(b.weights, b.q0, b.pos0)),
        rows=_rows_diagonal(0),
        reduce=_ratio,
    ),
    Metric(
        "prev_token_mass", "head", "attention", ATTN,
        "mean over `t >= max(1, q0)` of `A[t, t-1]`",
        partial=lambda b: _batch1(M.prev_token_partial(b.weights, b.q0, b.pos0)),
        rows=_rows_diagonal(1),
        reduce=_ratio,
    ),
    Metric(
        "entropy", "head", "attention", ATTN,
        "mean over `t >= q0` of `-sum_j A[t, j] log A[t, j]` (nats)",
        partial=lambda b: _batch1(M.entropy_partial(b.weights, b.q0, b.pos0)),
        rows=_rows_entropy,
        reduce=_ratio,
        needs=frozenset({"entropy"}),
    ),
    Metric(
        "value_norm_ratio", "head", "attention", "value vectors",
        "`||v_0|| / mean_{j>=1} ||v_j||` per head, over every key",
        "is the sink a near no-op?",
        partial=_value_partial,
        rows=_rows_value,
        reduce=_vnorm_ratio,
    ),
    Metric(
        "sink_output_share", "head", "attention", "attention output",
        "`sum_t ||A[t,0] v_0|| / sum_t ||o_t||` over `t >= q0`",
        "ratio of sums, robust to tiny outputs",
        partial=_share_partial,
        rows=_rows_share,
        reduce=_share,
    ),
    Metric(
        "received", "key", "attention", ATTN,
        "mean over the queries `t >= max(j, q0)` that see key `j` of `A[t, j]`",
        "library only (`ProbeResult.received`), not written to `probe.json`; feeds "
        "`sink_positions`",
        in_json=False,
        partial=lambda b: _batch1(M.received_partial(b.weights, b.q0, b.pos0)),
        rows=_rows_received,
        reduce=_ratio,
        needs=frozenset({"received"}),
    ),
    Metric(
        "head_kind", "head", "derived", ATTN,
        "the largest of sink / diagonal / previous-token mass; `mixed` when that largest is "
        "below `kind_floor` (0.3)",
        derive=lambda v, c: M.head_kind(
            v["sink_mass"], v["diagonal_mass"], v["prev_token_mass"], c.kind_floor
        ),
    ),
    Metric(
        "first_token_cosine", "layer", "hidden", "residual stream (decoder block output)",
        "mean over `j >= 1` of `cos(h_0, h_j)`",
        "claimed `<= 0` in middle layers, at the attention input "
        "([science.md](science.md#geometry))",
        hidden=M.first_token_cosine,
    ),
    Metric(
        "token_similarity", "layer", "hidden", "residual stream (decoder block output)",
        "mean pairwise `cos(h_i, h_j)`, `i != j`, `i, j >= 1`",
        "oversmoothing; computed in `O(T d)`",
        hidden=M.token_similarity,
    ),
    Metric(
        "first_token_norm_ratio", "layer", "hidden", "residual stream (decoder block output)",
        "`||h_0|| / median_{j>=1} ||h_j||`",
        "massive activations",
        hidden=M.first_token_norm_ratio,
    ),
    Metric(
        "sink_rate", "model", "derived", ATTN,
        "fraction of (layer, head) pairs that are sink heads (`sink_mass > eps`), at each "
        "`eps` (default 0.3, Gu et al., and 0.8, Barbero et al.)",
        'keyed by threshold: `"0.3"`, `"0.8"`',
        derive=lambda v, c: {eps_key(e): M.sink_rate(v["sink_mass"], e) for e in c.eps},
    ),
    Metric(
        "sink_positions", "model", "derived", ATTN,
        "keys whose mean `received` attention is more than `sink_factor` (5) x the larger of "
        "uniform causal attention and the median key, among keys seen by at least "
        "`max(16, T/16)` queries; at most `max_sink_positions` (8), largest first",
        "catches delimiter sinks, not only key 0",
        derive=lambda v, c: M.sink_positions(
            v["received"], c.q0, c.sink_factor, c.max_sink_positions
        ),
        needs=frozenset({"received"}),
    ),
)  # fmt: skip

BY_NAME = {m.name: m for m in METRICS}


def measured(metric_set: str) -> tuple[str, ...]:
    """The names a metric set measures, in declaration order (the others stay None)."""
    return tuple(m.name for m in METRICS if metric_set == "all" or m.fast)


def fused_needs(metric_set: str) -> frozenset[str]:
    """What the observation path must compute beyond a few columns for a metric set."""
    return frozenset().union(*(BY_NAME[n].needs for n in measured(metric_set)))


def names(source: str | None = None, *, in_json: bool | None = None) -> tuple[str, ...]:
    """Declared metric names in order, optionally of one source / only those in the JSON."""
    return tuple(
        m.name
        for m in METRICS
        if (source is None or m.source == source) and (in_json is None or m.in_json == in_json)
    )


class Accumulator:
    """Running totals of the attention metrics of one layer (float64 sums, integer counts):
    every one, or those named in ``wanted``."""

    def __init__(self, wanted: tuple[str, ...] | None = None) -> None:
        self.totals: dict[str, list[Term]] = {}
        self.metrics = [
            m for m in METRICS if m.partial is not None and (wanted is None or m.name in wanted)
        ]

    def add(self, block: Block) -> None:
        """Add one chunk's partial sums (the block path)."""
        for m in self.metrics:
            self._add_terms(m.name, m.partial(block))

    def add_rows(self, rows: Rows) -> None:
        """Add a whole layer's partial sums (the observation path)."""
        for m in self.metrics:
            self._add_terms(m.name, m.rows(rows))

    def _add_terms(self, name: str, terms: tuple[Term, ...]) -> None:
        old = self.totals.get(name)
        self.totals[name] = [
            _add(a, t) for a, t in zip(old, terms, strict=True)
        ] if old else [_start(t) for t in terms]  # fmt: skip

    def result(self) -> dict[str, Tensor]:
        """Each attention metric of the layer: (H,) tensors, ``received`` (H, T)."""
        return {name: BY_NAME[name].reduce(*terms) for name, terms in self.totals.items()}


def _start(term: Term) -> Term:
    if not isinstance(term, Tensor):
        return term
    return term.double().clone() if term.is_floating_point() else term.long().clone()


def _add(total: Term, term: Term) -> Term:
    """``total + term``; a tensor term may be shorter along the last (key) axis: it adds into the
    first keys (trimmed chunks see fewer keys), a longer one extends the total with zeros."""
    if not isinstance(term, Tensor):
        return total + term
    if total.shape[-1] < term.shape[-1]:
        total = F.pad(total, (0, term.shape[-1] - total.shape[-1]))
    total[..., : term.shape[-1]] += term.to(total.dtype)
    return total


def metrics_table() -> str:
    """The markdown table of ``docs/metrics.md#probe-metrics``, from :data:`METRICS`."""
    rows = [
        "| name (JSON key) | per | measured on | definition | notes |",
        "|---|---|---|---|---|",
    ]
    per = {"head": "layer, head", "layer": "layer", "key": "layer, head, key", "model": "run"}
    for m in METRICS:
        cells = (f"`{m.name}`", per[m.per], m.site, m.definition, m.notes)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def write_docs(path: str) -> None:
    """Rewrite the generated table of ``docs/metrics.md`` (between its two marker lines)."""
    from pathlib import Path

    page = Path(path)
    head, rest = page.read_text(encoding="utf-8").split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    page.write_text(head + TABLE_START + "\n" + metrics_table() + TABLE_END + tail, "utf-8")


TABLE_START = "<!-- generated from sinklab.probe.spec.METRICS: start -->"
TABLE_END = "<!-- generated from sinklab.probe.spec.METRICS: end -->"
