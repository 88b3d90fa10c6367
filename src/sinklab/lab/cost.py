"""What does a sink cost against a diagonal pattern? (docs/science.md#sink-vs-diagonal-cost)

Setup, at each context length ``T``: ``T`` token embeddings ``X`` (T, d), unit-norm random
Gaussian rows (seeded), ``d = T`` by default (each position its own token, as in copy tasks;
``dim`` fixes ``d`` instead). ``shared = b`` adds a direction every token has, ``x_t ~ z_t + b e``
(then normalised; mean cosine between tokens ``b^2 / (1 + b^2)``), as residual streams share a
mean direction. Geometry may decide the answer: a sink needs one query direction common to every
query, which random tokens (``shared = 0``) lack and shared-direction tokens provide.

One causal attention layer with full matrices: scores
``s[t, j] = x_t W_QK x_j^T``, softmax over ``j <= t``, output ``o_t = sum_j A[t, j] x_j W_VO``.

Patterns (queries ``t >= 1``; query 0 sees only itself):

* ``sink``: ``A[t, 0] >= accuracy`` and output ``o_t = 0`` (the hard switch: the sink is a no-op);
* ``diagonal``: ``A[t, t] >= accuracy`` and output ``o_t = x_t`` (the soft switch).

Smallest norm, **norm-constrained fit**: ``W_QK = r * U / ||U||_F``; for a given radius ``r``,
Adam maximises the worst query's target weight (a soft minimum of ``log A[t, target]``); a
bisection on ``log r`` finds the smallest ``r`` at which every query reaches ``accuracy``.
``W_VO`` is then the minimum-Frobenius-norm least-squares solution of ``A X W_VO = Y``
(``torch.linalg.lstsq`` via the pseudo-inverse). Both conditions are then **checked** on the final
weights (``realised``): ``min_t A[t, target] >= accuracy`` and ``||A X W_VO - Y||_F <= (1 -
accuracy) * max(||Y||_F, 1)``. Frobenius and nuclear norms of both matrices are recorded, and
the exponent of cost against ``T`` is a least-squares fit in log-log space.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from sinklab.errors import SinklabError
from sinklab.lab.limits import MAX_BISECTIONS, MAX_DIM, MAX_STEPS
from sinklab.progress import Progress, quiet
from sinklab.seeds import derive_seed

log = logging.getLogger(__name__)

TASKS = ("sink", "diagonal")
DEFAULT_LENGTHS = (16, 32, 64, 128, 256)  # 512 works (d = T: minutes more on a CPU)


@dataclass(frozen=True)
class CostConfig:
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    tasks: tuple[str, ...] = TASKS
    accuracy: float = 0.9  # every query puts >= 90 % of its attention on the target key
    dim: int | None = None  # embedding dim d; None = T (one direction per position)
    steps: int = 300  # Adam steps per radius (warm-started); 1000 changes T=256 norms < 1 %
    shared: float = 0.0  # weight of a direction shared by every token (0: none)
    bisections: int = 7  # radius known to a factor 2^(1/128), under 1 %
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lengths or any(t < 4 or t > 4096 for t in self.lengths):
            raise SinklabError(f"--lengths must be integers in 4..4096, got {self.lengths}")
        if len(set(self.lengths)) != len(self.lengths):
            raise SinklabError(f"--lengths has a length twice ({self.lengths}); list each T once")
        if len(self.lengths) < 2:
            raise SinklabError(
                f"--lengths needs 2 or more distinct lengths to fit an exponent, got {self.lengths}"
            )
        if bad := [t for t in self.tasks if t not in TASKS]:
            raise SinklabError(f"unknown task(s) {bad}; use sink, diagonal or both")
        if not 0.5 <= self.accuracy < 1:
            raise SinklabError(f"accuracy must be in [0.5, 1), got {self.accuracy}")
        if self.dim is not None and not 2 <= self.dim <= MAX_DIM:
            raise SinklabError(f"--dim must be in 2..{MAX_DIM} or omitted (= T), got {self.dim}")
        if not 0 <= self.shared <= 10:
            raise SinklabError(f"shared must be in [0, 10], got {self.shared}")
        if not 10 <= self.steps <= MAX_STEPS:
            raise SinklabError(f"--steps must be in 10..{MAX_STEPS}, got {self.steps}")
        if not 1 <= self.bisections <= MAX_BISECTIONS:
            raise SinklabError(
                f"--bisections must be in 1..{MAX_BISECTIONS} (each halves the norm interval: "
                f"{MAX_BISECTIONS} reach float64's resolution), got {self.bisections}"
            )


def embeddings(t: int, d: int, seed: int, shared: float = 0.0) -> Tensor:
    """Unit-norm token embeddings (T, d), float64, seeded by ``(seed, T)``: random directions,
    plus ``shared`` times the first basis vector before the final normalisation."""
    g = torch.Generator().manual_seed(derive_seed(seed, 100_003, t))
    x = torch.randn(t, d, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    if shared:
        x[:, 0] += shared
        x = x / x.norm(dim=1, keepdim=True)
    return x


def attention(x: Tensor, w_qk: Tensor) -> Tensor:
    """Causal softmax weights (T, T) of scores ``X W_QK X^T``."""
    t = x.shape[0]
    s = x @ w_qk @ x.T  # (T, T), query x key
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)


def target_keys(task: str, t: int) -> Tensor:
    """The key each query must attend to: 0 (sink) or itself (diagonal), shape (T,)."""
    return torch.zeros(t, dtype=torch.long) if task == "sink" else torch.arange(t)


def target_outputs(task: str, x: Tensor) -> Tensor:
    """``Y`` (T, d): zeros for the sink (hard switch), ``X`` itself for the diagonal."""
    return torch.zeros_like(x) if task == "sink" else x.clone()


def _fit_at_radius(x: Tensor, keys: Tensor, r: float, u: Tensor, steps: int) -> Tensor:
    """Adam (float32) on direction ``u`` with ``||W_QK||_F = r``; returns the new direction."""
    x = x.float()
    u = u.float().clone().requires_grad_(True)
    opt = torch.optim.Adam([u], lr=0.05)
    rows = torch.arange(1, x.shape[0])
    for _ in range(steps):
        w = r * u / u.norm()
        logp = torch.log(attention(x, w)[rows, keys[1:]].clamp_min(1e-30))  # (T - 1,)
        loss = -(-20.0 * logp).logsumexp(0) / -20.0  # soft minimum of log A[t, target]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return u.detach().double()


def _worst(x: Tensor, w: Tensor, keys: Tensor) -> float:
    a = attention(x, w)
    return float(a[torch.arange(1, x.shape[0]), keys[1:]].min())


def norms(w: Tensor) -> dict[str, float]:
    s = torch.linalg.svdvals(w)
    return {"fro": float(s.square().sum().sqrt()), "nuc": float(s.sum())}


def fit_layer(task: str, t: int, config: CostConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Smallest-norm fit for ``task`` at length ``t``: ``X (T, d), W_QK (d, d), W_VO (d, d)``."""
    d = config.dim or t
    x = embeddings(t, d, config.seed, config.shared)
    keys = target_keys(task, t)
    g = torch.Generator().manual_seed(config.seed)
    u = torch.randn(d, d, generator=g, dtype=torch.float64) / d
    hi = 1.0
    while True:  # grow the radius until the pattern is reachable
        u = _fit_at_radius(x, keys, hi, u, config.steps)
        if _worst(x, hi * u / u.norm(), keys) >= config.accuracy:
            break
        hi *= 2.0
        if hi > 1e6:
            raise SinklabError(f"{task} pattern not reachable at T={t} with ||W_QK|| <= 1e6")
    best_u, lo = u, hi / 2.0
    for _ in range(config.bisections):  # smallest radius that still realises the pattern
        mid = math.sqrt(lo * hi)
        cand = _fit_at_radius(x, keys, mid, best_u, config.steps)
        if _worst(x, mid * cand / cand.norm(), keys) >= config.accuracy:
            hi, best_u = mid, cand
        else:
            lo = mid
    w_qk = hi * best_u / best_u.norm()
    w_vo = torch.linalg.pinv(attention(x, w_qk) @ x) @ target_outputs(task, x)  # min-norm lstsq
    return x, w_qk, w_vo


def fit_pattern(task: str, t: int, config: CostConfig) -> dict[str, Any]:
    """Fit (:func:`fit_layer`), then check the pattern on the final weights and record norms."""
    x, w_qk, w_vo = fit_layer(task, t, config)
    keys = target_keys(task, t)
    a = attention(x, w_qk)
    y = target_outputs(task, x)
    out_err = float((a @ x @ w_vo - y).norm())
    worst = _worst(x, w_qk, keys)
    tol = (1 - config.accuracy) * max(float(y.norm()), 1.0)
    qk, vo = norms(w_qk), norms(w_vo)
    cos = x @ x.T
    return {
        "task": task,
        "T": t,
        "d": x.shape[1],
        "mean_cosine": float((cos.sum() - cos.diagonal().sum()) / (t * (t - 1))),
        "worst_target_weight": worst,
        "output_error": out_err,
        "realised": bool(worst >= config.accuracy and out_err <= tol),
        "fro_qk": qk["fro"],
        "nuc_qk": qk["nuc"],
        "fro_vo": vo["fro"],
        "nuc_vo": vo["nuc"],
        "fro_total": qk["fro"] + vo["fro"],
        "nuc_total": qk["nuc"] + vo["nuc"],
    }


def fit_exponent(t: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """Least squares ``log y = a log T + b``: exponent ``a``, ``coef = e^b``, and R^2."""
    lt = torch.log(torch.as_tensor(t, dtype=torch.float64))
    ly = torch.log(torch.as_tensor(y, dtype=torch.float64))
    if lt.numel() < 2 or not torch.isfinite(ly).all():
        raise SinklabError("an exponent fit needs >= 2 lengths and positive costs")
    design = torch.stack([lt, torch.ones_like(lt)], dim=1)  # (n, 2)
    sol = torch.linalg.lstsq(design, ly[:, None]).solution[:, 0]
    pred = design @ sol
    ss_res = float((ly - pred).square().sum())
    ss_tot = float((ly - ly.mean()).square().sum()) or 1.0
    return {"exponent": float(sol[0]), "coef": math.exp(float(sol[1])), "r2": 1 - ss_res / ss_tot}


@dataclass
class CostResult:
    config: CostConfig
    rows: list[dict[str, Any]]
    fits: dict[str, dict[str, dict[str, float]]]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "rows": self.rows,
            "fits": self.fits,
            "meta": self.meta,
        }

    def summary_lines(self) -> list[str]:
        """The run in words: each pattern's fitted exponents, and where a pattern was not
        realised at the accuracy asked."""
        lines = []
        for name, fits in self.fits.items():
            f, n = fits.get("fro_total"), fits.get("nuc_total")
            if f is None or n is None:
                lines.append(f"{name}: no exponent (fewer than 2 lengths, or a zero norm)")
                continue
            lines.append(
                f"{name}: Frobenius ~ T^{f['exponent']:.2f} (R2 {f['r2']:.2f}), "
                f"nuclear ~ T^{n['exponent']:.2f} (R2 {n['r2']:.2f})"
            )
        bad = [f"{r['task']}@{r['T']}" for r in self.rows if not r["realised"]]
        lines.append("realised at every T" if not bad else f"not realised at: {', '.join(bad)}")
        return lines


NORM_KEYS = ("fro_qk", "nuc_qk", "fro_vo", "nuc_vo", "fro_total", "nuc_total")


def run_cost(config: CostConfig, progress: Progress = quiet) -> CostResult:
    """Fit every (task, T); fit exponents of every norm against T (norms that are 0 skipped).

    ``progress(done, total, note)`` (the one :data:`~sinklab.progress.Progress`) counts the
    (task, T) fits, the note naming the one just fitted (``sink T=64``)."""
    t0 = time.perf_counter()
    rows = []
    total = len(config.tasks) * len(config.lengths)
    for task in config.tasks:
        for t in config.lengths:
            row = fit_pattern(task, t, config)
            log.info("%s T=%d: %s", task, t, row)
            rows.append(row)
            progress(len(rows), total, f"{task} T={t}")
    fits: dict[str, dict[str, dict[str, float]]] = {}
    for task in config.tasks:
        sub = [r for r in rows if r["task"] == task]
        fits[task] = {}
        for key in NORM_KEYS:
            values = [r[key] for r in sub]
            if len(sub) >= 2 and min(values) > 1e-9:
                fits[task][key] = fit_exponent([r["T"] for r in sub], values)
    log.info("cost: %.1fs", time.perf_counter() - t0)
    return CostResult(config, rows, fits)  # meta: the caller's (sinklab.meta.attach_meta)
