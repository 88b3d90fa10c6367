"""First-token, mask-sink, sensitivity and geometry (density: :mod:`sinklab.ablate.density`).

Each takes ``(model, tokenizer, ids, config, progress)`` and returns ``(conditions, extra,
finding)``: ``progress(done, total, note)`` (the one :data:`~sinklab.progress.Progress`) counts
its conditions, the note naming the one just done; the finding is computed from the numbers by
the rule of docs/experiments.md, and names the claim and its paper."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from sinklab.ablate.core import AblationConfig, thirds
from sinklab.ablate.first_token import first_token
from sinklab.ablate.perplexity import perplexity
from sinklab.claims.effects import first_token_cosine_effect, sensitivity_effect
from sinklab.claims.quote import claim_block, claim_sentence
from sinklab.errors import SinklabError
from sinklab.models.arch import model_shape
from sinklab.probe import ProbeConfig, ProbeResult, probe
from sinklab.probe.geometry import METRICS, SITES, middle_third
from sinklab.probe.metrics import HEAD_KINDS, layer_means
from sinklab.probe.metrics import nan_mean as mean  # NaN-skipping, as every per-head mean
from sinklab.probe.spec import rate_key
from sinklab.probe.summary import ranges
from sinklab.progress import Progress, quiet
from sinklab.seam.interventions import MaskSink, intervene, jacobian_sensitivity

# The claims, as the findings name them (paper, then the claim).
CLAIM_BOS = (
    "Barbero et al. 2025 (the sink forms at the first token whatever it is; removing the first "
    "token costs quality)"
)
CLAIM_MIXING = "Barbero et al. 2025 (sinks stop over-mixing)"
CLAIM_ID_MIXING = "sink-stops-mixing"  # the claims row the sensitivity finding quotes
CLAIM_ID_GEOMETRY = "first-token-cosine"  # the claims row the geometry finding quotes
CLAIM_GEOMETRY = (
    "Súkeník et al., 'Sink vs. diagonal patterns' (the first token's cosine with the others is "
    "<= 0 in middle layers)"
)

Out = tuple[dict[str, dict[str, Any]], dict[str, Any], str]


def _probe(model: nn.Module, ids: Tensor, config: AblationConfig) -> ProbeResult:
    return probe(model, ids, ProbeConfig(q0=config.q0, eps=config.eps))


def _sink_numbers(res: ProbeResult) -> dict[str, Any]:
    mass = res.sink_mass  # (L, H)
    return {
        **{rate_key(float(k)): v for k, v in res.sink_rate.items()},
        "mean_sink_mass": mean(mass),
        "sink_mass_by_layer": layer_means(mass),
    }


def _pct(new: float, old: float) -> str:
    return f"{100.0 * (new - old) / old:+.0f}%" if old else "n/a"


# --------------------------------------------------------------------------- first-token
def first_token_experiment(
    model: nn.Module,
    tokenizer: Any,
    ids: Tensor,
    config: AblationConfig,
    progress: Progress = quiet,
) -> Out:
    conditions: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for n, mode in enumerate(config.modes):
        try:
            edit = first_token(ids, mode, tokenizer, seed=config.seed)
        except SinklabError as exc:  # e.g. "\n" is not one token for this tokenizer
            skipped[mode] = str(exc)
            continue
        ppl = perplexity(model, edit.ids, config.first_target + edit.shift)
        conditions[mode] = {
            **edit.to_json(),
            **ppl.to_json(),
            **_sink_numbers(_probe(model, edit.ids, config)),
        }
        progress(n + 1, len(config.modes), mode)
    key = rate_key(config.eps[0])
    base = conditions.get("keep") or next(iter(conditions.values()))
    base_name = "keep" if "keep" in conditions else next(iter(conditions))
    parts = [
        f"{m}: perplexity {c['perplexity']:.2f} ({_pct(c['perplexity'], base['perplexity'])}), "
        f"{key} {c[key]:.2f}"
        for m, c in conditions.items()
        if m != base_name
    ]
    rates = {m: c[key] for m, c in conditions.items()}
    lo, hi = min(rates, key=rates.get), max(rates, key=rates.get)
    spread = rates[hi] - rates[lo]
    verdict = (
        f"no sink heads ({key} = 0) in any mode"
        if rates[hi] == 0
        else f"the sink forms whatever token comes first ({key} within {spread:.2f} across modes)"
        if spread <= 0.1
        else f"the sink depends on the first token ({key} from {rates[lo]:.2f} with {lo} "
        f"to {rates[hi]:.2f} with {hi})"
    )
    finding = (
        f"{CLAIM_BOS}: with the first token kept perplexity is {base['perplexity']:.2f} and {key} "
        f"{base[key]:.2f}; " + "; ".join(parts) + f"; {verdict} (the claims rule judges "
        "`bos-reliance` on lab runs trained with and without BOS, docs/claims.md)"
    )
    return conditions, {"skipped": skipped, "layers": model_shape(model)[0]}, finding


# --------------------------------------------------------------------------- mask-sink
def _layer_conditions(model: nn.Module, config: AblationConfig) -> dict[str, tuple[int, ...]]:
    n_layers, _ = model_shape(model)
    groups = {"all layers": config.layers or tuple(range(n_layers))}
    groups.update(thirds(n_layers))
    return groups


def mask_sink_experiment(
    model: nn.Module,
    tokenizer: Any,
    ids: Tensor,
    config: AblationConfig,
    progress: Progress = quiet,
) -> Out:
    pos = frozenset(config.positions)
    heads = frozenset(config.heads) if config.heads else None
    plan: dict[str, tuple[int, ...] | None] = {"never": None, **_layer_conditions(model, config)}
    conditions: dict[str, dict[str, Any]] = {}
    for n, (name, layers) in enumerate(plan.items()):
        handlers = [] if layers is None else [MaskSink(frozenset(layers), heads, pos)]
        with intervene(model, *handlers):
            ppl = perplexity(model, ids, config.first_target)
            res = _probe(model, ids, config)
        conditions[name] = {
            "layers": list(layers or ()),
            **ppl.to_json(),
            "token_similarity": list(res.token_similarity),
            "mean_token_similarity": mean(res.token_similarity),
            **_sink_numbers(res),
        }
        progress(n + 1, len(plan), name)
    never, full = conditions["never"], conditions["all layers"]
    parts = ", ".join(
        f"{k}: {c['perplexity']:.2f}" for k, c in conditions.items() if k.endswith("third")
    )
    direction = "raises" if full["perplexity"] > never["perplexity"] else "lowers"
    sim = "raises" if full["mean_token_similarity"] > never["mean_token_similarity"] else "lowers"
    finding = (
        f"{CLAIM_MIXING}: masking the sink (positions {sorted(pos)}) in all layers {direction} "
        f"perplexity from {never['perplexity']:.2f} to {full['perplexity']:.2f} ({parts}) and "
        f"{sim} mean token similarity (decoder block outputs) from "
        f"{never['mean_token_similarity']:.3f} to {full['mean_token_similarity']:.3f} (the "
        f"claims rule judges `{CLAIM_ID_MIXING}` on the Jacobian: the sensitivity experiment)"
    )
    return conditions, {"positions": sorted(pos)}, finding


# --------------------------------------------------------------------------- sensitivity
def grid_positions(n_tokens: int, n: int) -> list[int]:
    """``n`` evenly spaced positions in 0..n_tokens-1 (both ends included)."""
    return sorted({round(x) for x in torch.linspace(0, n_tokens - 1, n).tolist()})


def by_distance(s: Tensor, t: list[int], i: list[int]) -> dict[str, float]:
    """Mean of ``s[a, b]`` over grid cells with the same distance ``t - i >= 0``."""
    out: dict[int, list[float]] = {}
    for a, ta in enumerate(t):
        for b, ib in enumerate(i):
            if ta >= ib:
                out.setdefault(ta - ib, []).append(float(s[a, b]))
    return {str(d): sum(v) / len(v) for d, v in sorted(out.items())}


def _sensitivity_numbers(s: Tensor, pos: list[int], sinks: tuple[int, ...]) -> dict[str, Any]:
    """One condition's numbers from its grid matrix ``s`` (len(pos), len(pos)): the mean over
    ``t > i``, ``i`` not a sink (the claim's ``S``), the diagonal, the column of the sink, and
    the mean by distance."""
    off = [(a, b) for a, ta in enumerate(pos) for b, ib in enumerate(pos) if ta > ib]
    return {
        "mean_sensitivity": mean([float(s[a, b]) for a, b in off if pos[b] not in sinks]),
        "mean_self_sensitivity": mean(torch.diagonal(s)),
        "mean_sensitivity_to_sink": mean(
            [float(s[a, pos.index(p)]) for p in sinks if p in pos for a in range(1, len(pos))]
        ),
        "by_distance": by_distance(s, pos, pos),
    }


def sensitivity_experiment(
    model: nn.Module,
    tokenizer: Any,
    ids: Tensor,
    config: AblationConfig,
    progress: Progress = quiet,
) -> Out:
    """Per text (row of ``ids``), the grid of Jacobian norms with and without the sink masked;
    the claim's effect per text is ``log(S_masked / S)``
    (:func:`~sinklab.claims.effects.sensitivity_effect`) and the finding quotes the verdict of
    ``sink-stops-mixing`` by the claims rule over the texts (one text: inconclusive, too few
    samples), never a verdict of its own. ``conditions`` hold the means over texts."""
    pos = grid_positions(int(ids.shape[-1]), config.grid)
    probes = config.probes or None
    heads = frozenset(config.heads) if config.heads else None
    layers = frozenset(config.layers) if config.layers else None
    plan = {"sink": (), "sink masked": (MaskSink(layers, heads, frozenset(config.positions)),)}
    for handlers in plan.values():
        for h in handlers:
            h.check(model)
    n_rows, steps = int(ids.shape[0]), len(plan) * int(ids.shape[0])
    per_text: list[dict[str, Any]] = []
    mats: dict[str, list[Tensor]] = {name: [] for name in plan}
    for row in range(n_rows):
        numbers: dict[str, dict[str, Any]] = {}
        for n, (name, handlers) in enumerate(plan.items()):
            k = row * len(plan) + n

            where = f"text {row}, {name}" if n_rows > 1 else name

            def inner(done: float, total: float, note: str, k: int = k, where: str = where) -> None:
                progress(k * total + done, steps * total, f"{where}: {note}")

            s = jacobian_sensitivity(
                model,
                ids[row : row + 1],
                pos,
                pos,
                handlers=handlers,
                probes=probes,
                seed=config.seed,
                progress=inner,
                batch=8 if probes else 64,
            )
            numbers[name] = _sensitivity_numbers(s, pos, config.positions)
            mats[name].append(s)
        a, b = numbers["sink"]["mean_sensitivity"], numbers["sink masked"]["mean_sensitivity"]
        per_text.append(
            {"text": row, "sensitivity": a, "masked": b, "effect": sensitivity_effect(a, b)}
        )
    mean_mats = {name: torch.stack(m).mean(0) for name, m in mats.items()}
    conditions = {
        name: _sensitivity_numbers(s, pos, config.positions) for name, s in mean_mats.items()
    }
    claim = claim_block(CLAIM_ID_MIXING, [t["effect"] for t in per_text], config.seed)
    a, b = conditions["sink"]["mean_sensitivity"], conditions["sink masked"]["mean_sensitivity"]
    how = "exact Frobenius norms" if probes is None else f"Hutchinson estimate, {probes} probes"
    ratios = ", ".join(
        f"x{t['masked'] / t['sensitivity']:.2f}" if t["effect"] is not None else "n/a"
        for t in per_text
    )
    finding = (
        f"{CLAIM_MIXING}: {claim_sentence(claim)}; masking the sink changes the mean "
        f"||d h_L[t]/d x_i|| over t > i >= 1 from {a:.4g} to {b:.4g} (mean over {n_rows} "
        f"text{'s' * (n_rows > 1)}, {how}; per text {ratios})"
    )
    extra = {
        "positions": pos,
        "norm": "frobenius",
        "method": how,
        "texts": per_text,
        "claim": claim,
        "matrices": {name: s.tolist() for name, s in mean_mats.items()},
    }
    return conditions, extra, finding


# --------------------------------------------------------------------------- geometry
def _mean_layers(rows: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per-layer site numbers averaged over texts (None stays None)."""
    out = []
    for li in range(len(rows[0])):
        entry: dict[str, Any] = {"layer": li}
        for m in METRICS:
            vals = {s: [r[li][m][s] for r in rows] for s in SITES}
            entry[m] = {s: None if None in v else mean(v) for s, v in vals.items()}
        out.append(entry)
    return out


def geometry_claim(cos: Tensor, seed: int = 0) -> dict[str, Any]:
    """The claims rule of docs/claims.md on the attention-input cosines ``cos`` (texts, layers):
    one effect per text (:func:`~sinklab.claims.effects.first_token_cosine_effect`, the mean over
    the middle layers), their bootstrap interval and the verdict of ``first-token-cosine``:
    what ``sinklab claims`` computes from the same numbers."""
    effects = [first_token_cosine_effect(row) for row in cos.tolist()]
    return claim_block(CLAIM_ID_GEOMETRY, effects, seed)


def _positive_layers(cos: Tensor, middle: list[int]) -> str:
    """Which middle layers have a positive first-token cosine (mean over texts), and how many
    (text, layer) cells are positive."""
    mid = cos[:, middle]
    pos = [li for li, x in zip(middle, mid.mean(0).tolist(), strict=True) if x > 0]
    cells = f"{int((mid > 0).sum())} of {mid.numel()} (text, layer) cells > 0"
    if not pos:
        return f"every middle layer <= 0 on average ({cells})"
    return f"layer{'s' * (len(pos) > 1)} {ranges(pos)} positive on average ({cells})"


def geometry_experiment(
    model: nn.Module,
    tokenizer: Any,
    ids: Tensor,
    config: AblationConfig,
    progress: Progress = quiet,
) -> Out:
    n_layers, n_heads = model_shape(model)
    conditions: dict[str, dict[str, Any]] = {}
    rows: list[list[dict[str, Any]]] = []
    key_note = None
    for n, row in enumerate(ids):
        res = _probe(model, row, config)
        if res.geometry is None:
            raise SinklabError(f"{type(model).__name__}: sinklab cannot measure its geometry")
        key_note = res.geometry.key_note
        census = {
            kind: [sum(k == kind for k in layer) for layer in res.head_kind] for kind in HEAD_KINDS
        }
        rows.append(res.geometry.layers_json())
        conditions[f"text {n}"] = {
            "layers": rows[-1],
            "head_kind_census": census,
            "head_kind": res.head_kind,
        }
        progress(n + 1, len(ids), f"text {n}")
    site = "attention_input"
    cos = torch.tensor([[e["first_token_cosine"][site] for e in r] for r in rows])  # (B, L)
    middle = middle_third(n_layers)
    mid = cos[:, middle]
    others = []
    for s in ("residual", "key"):
        vals = [e["first_token_cosine"][s] for r in rows for e in r if e["layer"] in middle]
        if None not in vals:
            others.append(f"{s} mean {mean(vals):.3f}")
    kinds = [k for c in conditions.values() for layer in c["head_kind"] for k in layer]
    counts = {k: kinds.count(k) for k in sorted(set(kinds))}
    claim = geometry_claim(cos, config.seed)
    finding = (
        f"{CLAIM_GEOMETRY}: {claim_sentence(claim)}, the effect per text the mean over the "
        f"middle layers {middle[0]}..{middle[-1]} of the first-token cosine at the attention "
        f"input (each layer's input after its own input norm); per "
        f"layer, {_positive_layers(cos, middle)}, cells range {float(mid.min()):.3f}.."
        f"{float(mid.max()):.3f}; the same layers at the other sites: "
        + (", ".join(others) or "none measured")
        + "; head kinds over all texts: "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
    )
    extra = {
        "layers": _mean_layers(rows),
        "sites": list(SITES),
        "verdict_site": site,
        "middle_layers": middle,
        "claim": claim,
        "key_note": key_note,
        "n_heads": n_heads,
    }
    return conditions, extra, finding
