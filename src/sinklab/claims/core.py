"""``run_claims(...) -> ClaimsResult``: measure every claim, apply the one rule, one row each.

Samples on a model are text windows: ``windows`` consecutive windows of each text in ``texts``
(docs/claims.md). The rule (bootstrap interval and verdict) is :mod:`sinklab.claims.rules`; the
claims' definitions are :data:`sinklab.claims.registry.CLAIMS`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sinklab.ablate.registry import experiments_for_claim
from sinklab.claims.lab_runs import LAB_SIZES, LabPlan, train_lab_runs
from sinklab.claims.limits import MAX_CLAIMS_SIZES
from sinklab.claims.measure_lab import LAB_CLAIMS, measure_cost, measure_lab, measure_lab_runs
from sinklab.claims.measure_model import (
    Measurement,
    Sample,
    measure_density,
    measure_geometry,
    measure_probe,
    measure_sensitivity,
    measure_stream,
)
from sinklab.claims.registry import CLAIM_IDS, CLAIMS, Claim, judge
from sinklab.claims.rules import (
    MIN_SAMPLES,
    N_RESAMPLES,
    Verdict,
    bootstrap_interval,
    valid_samples,
)
from sinklab.claims.validity import comparison_settled, lab_verdict, stated
from sinklab.corpus import Text, check_token_spec, first_token, load_text, token_windows
from sinklab.errors import SinklabError
from sinklab.meta import attach_meta
from sinklab.progress import Progress, counter, quiet

if TYPE_CHECKING:
    from sinklab.models.loading import LoadedModel

log = logging.getLogger(__name__)

DEFAULT_TEXTS = ("shakespeare:hamlet", "shakespeare:macbeth", "shakespeare:othello")
_GROUPS = {  # measurement group -> the claims it measures (one pass over the samples each)
    "probe": ("first-token-sinks", "sink-value-small", "sink-output-small"),
    "stream": ("evict-sinks-collapse",),
    "sensitivity": ("sink-stops-mixing",),
    "geometry": ("first-token-cosine",),
    "density": ("density-oversmooths",),
}


@dataclass(frozen=True)
class ClaimsConfig:
    """Sizes of every protocol (defaults: SmolLM2 in a few minutes on 2 cores)."""

    texts: tuple[str, ...] = DEFAULT_TEXTS
    windows: int = 1  # consecutive windows per text: samples = len(texts) * windows
    claims: tuple[str, ...] | None = None  # None = every claim
    q0: int = 16
    eps: float = 0.3
    probe_tokens: int = 256  # probe, geometry, density
    # the stream claim reads its own windows, longer: its first 320 tokens of a play are the cast
    # list (docs/claims.md#stream-claim-sizes)
    stream_tokens: int = 1280
    n_sink: int = 4
    window: int = 60
    sensitivity_tokens: int = 128
    grid: int = 4
    probes: int = 8  # sensitivity: Hutchinson probes per query (0: exact Frobenius norms)
    density_lam: float = 0.5
    # sink-cheaper: T 16-256, 100 Adam steps per radius decide it (docs/claims.md, sizes)
    cost_lengths: tuple[int, ...] = (16, 32, 64, 128, 256)
    cost_seeds: int = 3
    cost_steps: int = 100  # Adam steps per radius (sinklab cost --steps)
    lab: str | None = None  # folder of lab runs (train.json files); None: train them (cached)
    lab_size: str = "full"  # the sizes of the trained lab runs: "full" or "quick" (LAB_SIZES)
    lab_steps: int | None = None  # override the lab size's steps
    seed: int = 0  # bootstrap and sensitivity probes
    prepend: str | None = None  # the first token (sinklab.corpus.first_token); None: the model's

    def __post_init__(self) -> None:
        if not self.texts or any(not str(t).strip() for t in self.texts):
            raise SinklabError("--texts is empty; pass comma-separated texts, e.g. a,b,c")
        if self.claims is not None:
            bad = [c for c in self.claims if c not in CLAIM_IDS]
            if bad or not self.claims:
                raise SinklabError(
                    f"unknown claim(s) {', '.join(bad) or '(none)'}; choose from: "
                    f"{', '.join(CLAIM_IDS)}"
                )
        for name in ("windows", "grid", "cost_seeds", "cost_steps"):
            if getattr(self, name) < 1:
                raise SinklabError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.probes < 0:
            raise SinklabError(f"probes must be >= 0 (0: exact norms), got {self.probes}")
        for name in ("probe_tokens", "stream_tokens", "sensitivity_tokens"):
            if getattr(self, name) < 8:
                raise SinklabError(f"{name} must be >= 8, got {getattr(self, name)}")
        for name, hi in MAX_CLAIMS_SIZES.items():
            if getattr(self, name) > hi:
                raise SinklabError(
                    f"{name} must be at most {hi} (a claims run stays within one machine), got "
                    f"{getattr(self, name)}"
                )
        if not 0 <= self.q0 < self.probe_tokens:
            raise SinklabError(f"q0 must be in [0, {self.probe_tokens}), got {self.q0}")
        if not 0.0 < self.eps < 1.0:
            raise SinklabError(f"eps must be in (0, 1), got {self.eps}")
        if self.n_sink < 1 or self.window < 1:
            raise SinklabError("n_sink and window must be >= 1")
        if not 0.0 < self.density_lam <= 1.0:
            raise SinklabError(f"density_lam must be in (0, 1], got {self.density_lam}")
        if self.grid > self.sensitivity_tokens:
            raise SinklabError(f"grid {self.grid} exceeds sensitivity_tokens")
        if len(self.cost_lengths) < 2 or min(self.cost_lengths) < 4:
            raise SinklabError("cost_lengths needs >= 2 lengths, each >= 4 (e.g. 16,32,64)")
        if self.prepend is not None:
            check_token_spec(self.prepend)
        if self.lab is not None and not Path(self.lab).is_dir():
            raise SinklabError(f"--lab {self.lab!r} is not a folder; pass a folder of train runs")
        if self.lab_size not in LAB_SIZES:
            raise SinklabError(
                f"--lab-size must be one of {', '.join(LAB_SIZES)}, got {self.lab_size!r}"
            )
        if self.lab_steps is not None and self.lab_steps < 10:
            raise SinklabError(f"--lab-steps must be >= 10, got {self.lab_steps}")

    @property
    def lab_plan(self) -> LabPlan:
        """The lab runs ``run_claims`` trains when no ``lab`` folder is given."""
        plan = LAB_SIZES[self.lab_size]
        return plan if self.lab_steps is None else replace(plan, steps=self.lab_steps)

    @property
    def trains_lab(self) -> bool:
        """Whether a run of this config trains lab runs (a lab claim is wanted, no ``lab``
        folder; the depth claim alone needs none: no set-up here tests it)."""
        lab = [c for c in self.wanted() if c in LAB_CLAIMS and c != "sinks-grow-depth"]
        return self.lab is None and bool(lab)

    @property
    def window_tokens(self) -> int:
        """Tokens per text window of the probe, geometry, density and sensitivity protocols
        (the stream claim reads windows of ``stream_tokens`` of its own: :func:`text_samples`)."""
        return max(self.probe_tokens, self.sensitivity_tokens)

    def wanted(self) -> tuple[str, ...]:
        return self.claims or CLAIM_IDS

    @property
    def needs_model(self) -> bool:
        """Whether a wanted claim is measured on a model (not only in the lab or by cost)."""
        return any(c not in (*LAB_CLAIMS, "sink-cheaper") for c in self.wanted())

    def read_texts(self) -> list[Text]:
        """The texts the model claims read (none when no model is needed): a bad text, or the
        same text twice (by content: one text counted as several independent samples would
        narrow every interval for nothing), fails here, before any model loads."""
        if not self.needs_model:
            return []
        texts = [load_text(t) for t in self.texts]
        first: dict[str, str] = {}
        for spec, text in zip(self.texts, texts, strict=True):
            if text.sha256 in first:
                same = "twice" if first[text.sha256] == spec else f"and {first[text.sha256]!r}"
                raise SinklabError(
                    f"--texts names {spec!r} {same}: the same text (sha256 "
                    f"{text.sha256[:12]}) would count as several independent samples; pass "
                    "distinct texts (or --windows N for more samples of one text)"
                )
            first[text.sha256] = spec
        return texts


def _filled(text: str, sizes: dict[str, Any]) -> str:
    """An effect's definition in words, with the run's own sizes filled in (``{eps:g}``,
    ``{q0}``); as written when a size was not measured."""
    try:
        return text.format(**sizes)
    except (KeyError, IndexError, ValueError):
        return text


@dataclass
class ClaimRow:
    claim: Claim
    measurement: Measurement
    interval: Any  # rules.Interval | None
    verdict: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        c, iv = self.claim, self.interval
        n_valid = 0 if iv is None else iv.n
        return {
            "id": c.id,
            "statement": c.statement,
            "paper": c.paper,
            "protocol": c.protocol,
            "effect_definition": _filled(c.effect, self.measurement.sizes),
            "site": c.site,
            "direction": c.direction,
            "threshold": c.threshold,
            "source": c.source,
            "experiments": [r.name for r in experiments_for_claim(c.id)],
            "effect": None if iv is None else iv.mean,
            "interval": None if iv is None else [iv.low, iv.high],
            "n_samples": len(self.measurement.samples),
            "n_valid": n_valid,
            "verdict": self.verdict,
            "reason": self.reason,
            "samples": self.measurement.samples,
            "sizes": self.measurement.sizes,
            **self._validity(),
        }

    def _validity(self) -> dict[str, Any]:
        """A lab row's fidelity, scope, stated verdict and its runs' convergence and emergence
        checks (docs/claims.md#lab-validity); nothing for other rows."""
        m = self.measurement
        if m.fidelity is None:
            return {}
        return {
            "fidelity": m.fidelity.label,
            "scope": m.fidelity.scope,
            "verdict_stated": stated(self.verdict, m.fidelity.scope),
            "convergence": [c.to_json() for c in m.convergence],
            "emergence": [c.to_json() for c in m.emergence],
            "settled": None if m.settled is None else m.settled.to_json(),
        }


@dataclass
class ClaimsResult:
    config: ClaimsConfig
    rows: list[ClaimRow]
    run: dict[str, Any] = field(default_factory=dict)  # samples read, seconds by group, threads
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "run": self.run,
            "rule": {
                "interval": f"percentile bootstrap of the mean, {N_RESAMPLES} resamples, 95 %",
                "min_samples": MIN_SAMPLES,
                "docs": "docs/claims.md",
            },
            "claims": [r.to_json() for r in self.rows],
        }

    def figures(self) -> dict[str, Any]:
        """The claims figure (each effect and interval against its threshold), by name."""
        from sinklab.claims.plots import claims_figure

        return {"claims_effects": claims_figure([r.to_json() for r in self.rows])}

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per claim: id, verdict, effect, its 95 % interval, the
        threshold and its side, valid samples, and the reason."""
        from sinklab.frames import records_frame

        rows = []
        for r in (row.to_json() for row in self.rows):
            low, high = r["interval"] or (None, None)
            rows.append({**r, "low": low, "high": high})
        columns = ["id", "verdict", "effect", "low", "high", "threshold", "direction"]
        return records_frame(rows, [*columns, "n_valid", "n_samples", "reason"])


def text_samples(
    tokenizer: Any, config: ClaimsConfig, max_positions: int | None, tokens: int | None = None
) -> list[Sample]:
    """``windows`` consecutive windows of ``tokens`` (default ``config.window_tokens``; the
    stream claim's are ``config.stream_tokens`` long) of each text: [(name, ids (T,))], each
    starting with the run's first token(s) (``config.prepend``, by default the tokenizer's own:
    :func:`sinklab.corpus.first_token`). Window ``k`` of the stream claim starts where window
    ``k`` of the others does only for ``k = 0``."""
    n = tokens or config.window_tokens
    n = min(n, max_positions) if max_positions else n
    first = first_token(tokenizer, config.prepend)
    samples = []
    for spec in config.texts:
        try:
            rows = token_windows(load_text(spec), tokenizer, n, config.windows, first)
        except SinklabError as err:  # say which options asked for that many tokens
            if tokens is not None:  # the stream claim's windows
                raise SinklabError(
                    f"{err} (each text needs {n} tokens x --windows {config.windows} for the "
                    "stream claim: lower --stream-tokens)"
                ) from None
            sizes = {
                "--tokens": config.probe_tokens,
                "--sensitivity-tokens": config.sensitivity_tokens,
            }
            largest = max(sizes, key=lambda k: sizes[k])
            raise SinklabError(
                f"{err} (each text needs {n} tokens x --windows {config.windows}: {n} is "
                f"{largest} {sizes[largest]}, the larger of --tokens and --sensitivity-tokens; "
                f"lower {largest})"
            ) from None
        for k in range(config.windows):
            name = spec if config.windows == 1 else f"{spec}#{k}"
            samples.append((name, rows[k]))
    return samples


def _first_token_record(
    tokenizer: Any, config: ClaimsConfig, samples: Sequence[Sample]
) -> dict[str, Any] | None:
    """``meta.first_token`` of a run whose samples came through a tokenizer (else None)."""
    if tokenizer is None or not samples:
        return None
    return first_token(tokenizer, config.prepend).record(tokenizer, samples[0][1])


def _cap(config: ClaimsConfig, max_positions: int | None) -> ClaimsConfig:
    if not max_positions:
        return config
    from dataclasses import replace

    sizes = ("probe_tokens", "stream_tokens", "sensitivity_tokens")
    return replace(config, **{k: min(getattr(config, k), max_positions) for k in sizes})


def claims_on(
    loaded: LoadedModel | None,
    config: ClaimsConfig,
    progress: Progress = quiet,
    texts: list[Text] | None = None,
) -> ClaimsResult:
    """:func:`run_claims` on a loaded model (None: the lab and cost claims alone) with its
    provenance block (model, texts, config, seconds, first token): what ``sinklab claims`` runs
    on each model and the report's claims section runs. ``texts``: ``config.read_texts()``,
    when the caller read them already (before loading the model, to fail early)."""
    texts = config.read_texts() if texts is None else texts
    start = time.perf_counter()
    result = run_claims(
        loaded.model if loaded else None,
        loaded.tokenizer if loaded else None,
        config,
        max_positions=loaded.info.max_positions if loaded else None,
        progress=progress,
    )
    seconds, record = time.perf_counter() - start, result.run.get("first_token")
    attach_meta(result, loaded.info if loaded else None, texts or None, config, seconds, record)
    return result


def run_claims(
    model: nn.Module | None,
    tokenizer: Any,
    config: ClaimsConfig | None = None,
    *,
    samples: Sequence[Sample] | None = None,
    max_positions: int | None = None,
    progress: Progress = quiet,
) -> ClaimsResult:
    """Measure the wanted claims and decide each by the rule of docs/claims.md.

    ``samples`` overrides the text windows (``[(name, ids (T,))]``); ``progress`` (the one
    :data:`~sinklab.progress.Progress`) counts (group, sample) steps, cost seeds and lab runs.
    Model claims need ``model``; lab claims read ``config.lab``; the cost claim needs neither.
    """
    config = _cap(config or ClaimsConfig(), max_positions)
    wanted = config.wanted()
    groups = [g for g, ids in _GROUPS.items() if any(c in wanted for c in ids)]
    if groups and model is None:
        raise SinklabError("the model claims need a model; pass --model or choose lab claims")
    if samples is not None:  # the caller's samples, for every group
        samples = streamed = list(samples)
    else:  # the stream claim reads longer windows of its own (docs/claims.md#stream-claim-sizes)
        others = [g for g in groups if g != "stream"]
        samples = text_samples(tokenizer, config, max_positions) if others else []
        streamed = []
        if "stream" in groups:
            streamed = text_samples(tokenizer, config, max_positions, config.stream_tokens)
    total = sum(len(streamed if g == "stream" else samples) for g in groups)
    total += config.cost_seeds if "sink-cheaper" in wanted else 0
    total += len(config.lab_plan.configs()) if config.trains_lab else 0
    tick = counter(progress, total)
    measured: dict[str, Measurement] = {}
    seconds: dict[str, float] = {}
    runners: dict[str, Callable[[], dict[str, Measurement]]] = {
        "probe": lambda: measure_probe(model, samples, config, tick),
        "stream": lambda: measure_stream(model, streamed, config, tick),
        "sensitivity": lambda: measure_sensitivity(model, tokenizer, samples, config, tick),
        "geometry": lambda: measure_geometry(model, samples, config, tick),
        "density": lambda: measure_density(model, samples, config, tick),
    }
    for g in groups:
        t0 = time.perf_counter()
        with torch.no_grad() if g != "sensitivity" else _nullcontext():
            measured.update(runners[g]())
        seconds[g] = round(time.perf_counter() - t0, 2)
    if "sink-cheaper" in wanted:
        t0 = time.perf_counter()
        measured.update(measure_cost(config, tick))
        seconds["cost"] = round(time.perf_counter() - t0, 2)
    lab_wanted = [c for c in wanted if c in LAB_CLAIMS]
    lab_facts: dict[str, Any] = {}
    if config.lab:
        measured.update(measure_lab(Path(config.lab), lab_wanted))
    elif config.trains_lab:
        runs, lab_facts = train_lab_runs(config.lab_plan, tick)
        seconds["lab"] = lab_facts["seconds"]
        source = {"lab": "trained by sinklab claims", "lab_cache": lab_facts["cache"]}
        measured.update(measure_lab_runs(runs, lab_wanted, {**source, **lab_facts["plan"]}))
    elif lab_wanted:  # the depth claim alone: nothing here can test it, nothing is trained
        measured.update(measure_lab_runs([], lab_wanted, {}))
    rows = []
    for claim in CLAIMS:
        if claim.id not in wanted:
            continue
        m = measured[claim.id]
        why = m.not_measured or "no sample could be measured"
        if claim.source == "lab":
            interval, v = _judge_lab(claim, m, why, config.seed)
        else:
            interval, v = judge(claim.id, m.effects(), not_measured=why, seed=config.seed)
        rows.append(ClaimRow(claim, m, interval, v.verdict, v.reason))
    run = {
        "samples": [{"name": n, "tokens": int(ids.numel())} for n, ids in samples],
        "stream_samples": [{"name": n, "tokens": int(ids.numel())} for n, ids in streamed],
        "first_token": _first_token_record(tokenizer, config, samples or streamed),
        "seconds_by_group": seconds,
        "threads": torch.get_num_threads(),
    }
    if lab_facts:
        run["lab"] = {k: v for k, v in lab_facts.items() if k != "plan"}
    return ClaimsResult(config, rows, run)  # meta: the caller's (sinklab.meta.attach_meta)


def _judge_lab(claim: Claim, m: Measurement, why: str, seed: int) -> tuple[Any, Verdict]:
    """A lab row: the interval of its valid samples (shown whatever the verdict) and the verdict
    of :func:`sinklab.claims.validity.lab_verdict` (fidelity, convergence, emergence, then the
    rule)."""
    xs = valid_samples(m.effects())
    interval = bootstrap_interval(xs, seed=seed) if xs else None
    tails = [s.get("tail") or [] for s in m.samples if valid_samples([s["effect"]])]
    settled = comparison_settled(
        [[(int(st), e) for st, e in t] for t in tails],
        claim.direction,
        claim.threshold,
        seed=seed,
    )
    m.settled = settled
    v = lab_verdict(
        interval,
        claim.direction,
        claim.threshold,
        m.fidelity,
        m.convergence,
        m.emergence,
        not_measured=why,
        settled=settled,
    )
    return interval, v


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
