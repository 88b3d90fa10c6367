"""Density: does denser attention raise token similarity (oversmoothing)? Three protocols.

* ``mix`` (default): ``(1 - lam) * w_model + lam * uniform-causal`` in the chosen layers;
* ``temperature``: ``softmax(s / tau)`` in those layers (``tau < 1`` sharper, ``> 1`` denser);
* ``replace``: ``(1 - lam) * identity + lam * uniform-causal``, the model's weights discarded.

Each condition is one forward: perplexity, and the mean token similarity at the residual and
attention-input sites of every layer (:mod:`sinklab.probe.geometry`), plus the final hidden
state. The finding applies the rule of docs/experiments.md to the entries after the modified layers.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from torch import Tensor, nn

from sinklab.ablate.core import AblationConfig
from sinklab.ablate.perplexity import perplexity
from sinklab.claims.quote import claim_block, claim_sentence
from sinklab.models.arch import model_shape
from sinklab.probe.geometry import capture_geometry, middle_third
from sinklab.probe.metrics import nan_mean
from sinklab.progress import Progress, quiet
from sinklab.seam.interventions import (
    AttentionMix,
    AttentionReplace,
    AttentionTemperature,
    intervene,
)

PROTOCOLS = ("mix", "temperature", "replace")
DENSITY_SITES = ("residual", "attention_input")
TOLERANCE = 0.01  # cosine: smaller changes (and steps against the trend) count as no change
CLAIM_DENSITY = (
    "Súkeník et al., 'Sink vs. diagonal patterns' (denser attention raises token similarity)"
)
CLAIM_ID_DENSITY = "density-oversmooths"  # the claims row the finding quotes
CLAIM_LAM = 0.5  # the mix the claims rule reads (docs/claims.md; ClaimsConfig.density_lam)
CONFOUND = (
    "confound: at small lam every token attends only to itself, i.e. behaves as a first token, "
    "and first tokens carry the model's massive activations; use --protocol mix or temperature "
    "to perturb the trained attention instead"
)


def density_layers(config: AblationConfig, n_layers: int) -> list[int]:
    """The modified layers: ``config.layers`` or the middle third."""
    return sorted(config.layers) if config.layers else middle_third(n_layers)


def _plan(config: AblationConfig) -> tuple[str, tuple[float, ...]]:
    """(parameter name, values ordered from sparsest to densest attention)."""
    if config.protocol == "temperature":
        return "tau", tuple(sorted(config.temperatures))
    return "lam", tuple(sorted(config.lams))


def _handler(protocol: str, value: float, layers: frozenset[int], heads: frozenset[int] | None):
    if protocol == "mix":
        return AttentionMix(layers, heads, lam=value)
    if protocol == "temperature":
        return AttentionTemperature(layers, heads, tau=value)
    return AttentionReplace(layers, heads, lam=value)


def after_group(series: list[float | None], group: list[int]) -> float:
    """The one "after the group" rule (docs/experiments.md#density; ``sinklab claims`` reads it
    too): the mean of a per-layer series (L + 1 entries: entering layers 0..L-1, then the final
    state) over the entries after the modified ``group``, :func:`after_entries`."""
    return nan_mean(series[max(group) + 1 :])


def after_entries(group: list[int], n_layers: int) -> list[int | str]:
    """The entries :func:`after_group` averages: layers max(group)+1 .. L-1, then "final"."""
    return [*range(max(group) + 1, n_layers), "final"]


def density_verdict(values: list[float], tolerance: float = TOLERANCE) -> tuple[str, float]:
    """The curve rule of docs/experiments.md on ``values`` ordered from sparsest to densest
    attention: (``rises`` | ``rises in trend`` | ``no change`` | ``falls``, densest - sparsest).
    A description of the curve, not a verdict on the claim (the claims rule gives that)."""
    delta = values[-1] - values[0]
    steps = [b - a for a, b in itertools.pairwise(values)]
    if abs(delta) <= tolerance:
        return "no change", delta
    if delta < 0:
        return "falls", delta
    return ("rises" if all(s >= -tolerance for s in steps) else "rises in trend"), delta


def _one_text(
    model: nn.Module,
    row: Tensor,
    config: AblationConfig,
    handler: Any,
    group: list[int],
) -> dict[str, Any]:
    """One condition on one text (one forward): perplexity and token similarity per site."""
    handlers = [] if handler is None else [handler]
    with intervene(model, *handlers), capture_geometry(model, DENSITY_SITES) as geo:
        ppl = perplexity(model, row, config.first_target)
    sim = {s: geo.series("token_similarity", s, final=True) for s in DENSITY_SITES}
    return {"ppl": ppl, "sim": sim, "after": {s: after_group(sim[s], group) for s in DENSITY_SITES}}


def _mean_series(series: list[list[float | None]]) -> list[float | None]:
    """Entry-wise mean over texts (None where any text has None)."""
    return [None if None in col else nan_mean(list(col)) for col in zip(*series, strict=True)]


def density_claim(
    per_text: dict[str, list[dict[str, Any]]], config: AblationConfig
) -> dict[str, Any] | None:
    """``density-oversmooths`` by the claims rule on this run's texts: per text, ``S(lam =
    CLAIM_LAM) - S(unmodified)`` at the attention input (what ``sinklab claims`` measures);
    None when the run has no such condition (protocol not ``mix``, or ``CLAIM_LAM`` not in
    ``lams``)."""
    name = f"lam={CLAIM_LAM:g}"
    if config.protocol != "mix" or name not in per_text:
        return None
    site = "attention_input"
    effects = []
    for mixed, base in zip(per_text[name], per_text["unmodified"], strict=True):
        d = mixed["after"][site] - base["after"][site]
        effects.append(d if math.isfinite(d) else None)
    return claim_block(CLAIM_ID_DENSITY, effects, config.seed)


def density_experiment(
    model: nn.Module,
    tokenizer: Any,
    ids: Tensor,
    config: AblationConfig,
    progress: Progress = quiet,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any], str]:
    """Every condition on every text (row of ``ids``); ``conditions`` hold the means over texts
    (perplexity: ``exp`` of the mean NLL) and the finding quotes ``density-oversmooths`` by the
    claims rule over the texts (:func:`density_claim`)."""
    n_layers, _ = model_shape(model)
    group = density_layers(config, n_layers)
    heads = frozenset(config.heads) if config.heads else None
    param, values = _plan(config)
    plan: list[float | None] = [None, *values]
    conditions: dict[str, dict[str, Any]] = {}
    per_text: dict[str, list[dict[str, Any]]] = {}
    layers = frozenset(group)
    for n, value in enumerate(plan):
        handler = None if value is None else _handler(config.protocol, value, layers, heads)
        name = "unmodified" if value is None else f"{param}={value:g}"
        per_text[name] = [_one_text(model, row, config, handler, group) for row in ids]
        rows = per_text[name]
        nll = nan_mean([r["ppl"].nll for r in rows])
        sim = {s: _mean_series([r["sim"][s] for r in rows]) for s in DENSITY_SITES}
        conditions[name] = {
            param: value,
            "ppl": math.exp(nll),
            "nll": nll,
            "n_targets": sum(r["ppl"].n_targets for r in rows),
            "token_similarity": sim,
            "after_group_similarity": {s: after_group(sim[s], group) for s in DENSITY_SITES},
        }
        progress(n + 1, len(plan), name)
    curves = {
        s: [conditions[f"{param}={v:g}"]["after_group_similarity"][s] for v in values]
        for s in DENSITY_SITES
    }
    claim = density_claim(per_text, config)
    finding = _finding(config.protocol, param, values, curves, conditions, group, n_layers)
    finding = f"{CLAIM_DENSITY}: " + (
        f"{claim_sentence(claim)}; {finding}"
        if claim is not None
        else f"{finding} (the claims rule judges `{CLAIM_ID_DENSITY}` with --protocol mix at "
        f"lam {CLAIM_LAM:g}, not run here)"
    )
    extra = {
        "protocol": config.protocol,
        "parameter": param,
        "values": list(values),
        "modified_layers": group,
        "after_layers": after_entries(group, n_layers),
        "sites": list(DENSITY_SITES),
        "curve_shapes": {s: density_verdict(curves[s])[0] for s in DENSITY_SITES},
        "claim": claim,
        "texts": int(ids.shape[0]),
    }
    return conditions, extra, finding


def _finding(
    protocol: str,
    param: str,
    values: tuple[float, ...],
    curves: dict[str, list[float]],
    conditions: dict[str, dict[str, Any]],
    group: list[int],
    n_layers: int,
) -> str:
    after = f"layers {max(group) + 1}..{n_layers - 1} and the final hidden state"
    if max(group) + 1 >= n_layers:
        after = "the final hidden state"
    parts = []
    for site in ("attention_input", "residual"):
        verdict, delta = density_verdict(curves[site])
        c = curves[site]
        parts.append(
            f"at the {site.replace('_', ' ')} it goes {c[0]:.3f} -> {c[-1]:.3f} ({delta:+.3f}): "
            f"{verdict}"
        )
    lo, hi = (conditions[f"{param}={v:g}"]["ppl"] for v in (values[0], values[-1]))
    how = {
        "mix": "mixing the model's attention with uniform causal attention",
        "temperature": "dividing the attention scores by a temperature",
        "replace": "replacing the attention by identity/uniform mixtures",
    }[protocol]
    text = (
        f"{how} in layers {group[0]}..{group[-1]} from {param}={values[0]:g} "
        f"(sparsest) to {param}={values[-1]:g} (densest), mean token similarity over {after} "
        + "; ".join(parts)
        + f"; perplexity {lo:.1f} -> {hi:.1f}"
    )
    return f"{text}; {CONFOUND}" if protocol == "replace" else text
