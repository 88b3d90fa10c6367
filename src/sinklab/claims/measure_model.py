"""The claims measured on a model, one number per text window each (docs/claims.md, "The claims").

Every function takes the model, the samples ``[(name, ids (T,))]`` and the config, calls the
library (probe, streaming, ablate's sensitivity and density experiments, geometry) and returns
``{claim_id: Measurement}``. A sample that cannot give the effect (e.g. no sink head on that text)
has effect ``None``; a protocol that cannot run on this model (e.g. a stream too short for
eviction) gives a Measurement with no samples and the reason.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from sinklab.claims.effects import first_token_cosine_effect
from sinklab.models.arch import model_shape
from sinklab.progress import Tick

Sample = tuple[str, Tensor]  # (name, ids (T,))


@dataclass
class Measurement:
    """A claim's samples ``[{"sample": name, "effect": x | None, ...}]``, or why there are none.

    Lab claims also carry their ``fidelity`` (:class:`sinklab.claims.validity.Fidelity`) and the
    ``convergence`` / ``emergence`` checks of their compared runs and, once judged, whether the
    comparison ``settled`` (:class:`sinklab.claims.validity.RunCheck`,
    docs/claims.md#lab-validity)."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    not_measured: str | None = None
    sizes: dict[str, Any] = field(default_factory=dict)
    fidelity: Any = None
    convergence: list[Any] = field(default_factory=list)
    emergence: list[Any] = field(default_factory=list)
    settled: Any = None  # the comparison's settling check (lab rows, set when judged)

    def effects(self) -> list[float | None]:
        return [s["effect"] for s in self.samples]


def _geomean(xs: Sequence[float]) -> float | None:
    xs = [float(x) for x in xs if math.isfinite(float(x)) and float(x) > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _n_layers(model: nn.Module) -> int:
    return model_shape(model)[0]


# --------------------------------------------------------------------------- probe
def sink_head_numbers(res: Any, eps: float) -> dict[str, Any]:
    """A probe result's sink heads at ``eps``: the probe's own sink rate, how many heads are
    sinks, and over them the geometric means of the value-norm ratio and of the output share per
    unit of sink mass (``sink-value-small``, ``sink-output-small``; None without a sink head)."""
    from sinklab.probe.spec import eps_key

    mass = res.sink_mass.double()  # (L, H)
    sink = mass > eps
    ratio = res.value_norm_ratio.double()[sink].tolist()
    share = (res.sink_output_share.double()[sink] / mass[sink]).tolist()
    return {
        "rate": float(res.sink_rate[eps_key(eps)]),  # the probe's own count of ``sink``
        "sink_heads": int(sink.sum()),
        "n_heads": int(mass.numel()),
        "value_ratio": _geomean(ratio),
        "output_share": _geomean(share),
    }


def measure_probe(
    model: nn.Module, samples: Sequence[Sample], cfg: Any, tick: Tick
) -> dict[str, Measurement]:
    """first-token-sinks, sink-value-small, sink-output-small: one probe per sample."""
    from sinklab.probe import ProbeConfig, probe

    eps = float(cfg.eps)
    pcfg = ProbeConfig(q0=cfg.q0, eps=(eps,))
    out = {k: Measurement() for k in ("first-token-sinks", "sink-value-small", "sink-output-small")}
    for name, ids in samples:
        ids = ids[: cfg.probe_tokens]
        heads = sink_head_numbers(probe(model, ids, pcfg), eps)
        common = {"sample": name, "tokens": int(ids.numel()), "sink_heads": heads["sink_heads"]}
        out["first-token-sinks"].samples.append(
            {**common, "effect": heads["rate"], "n_heads": heads["n_heads"]}
        )
        out["sink-value-small"].samples.append({**common, "effect": heads["value_ratio"]})
        out["sink-output-small"].samples.append({**common, "effect": heads["output_share"]})
        tick("probe")
    sizes = {"tokens": cfg.probe_tokens, "q0": cfg.q0, "eps": eps}
    for m in out.values():
        m.sizes = sizes
    return out


# --------------------------------------------------------------------------- streaming
def measure_stream(
    model: nn.Module, samples: Sequence[Sample], cfg: Any, tick: Tick
) -> dict[str, Measurement]:
    """evict-sinks-collapse: window vs sink policy, NLL on the targets after eviction starts."""
    from sinklab.stream.evaluate import StreamConfig, streaming_perplexity

    start = cfg.n_sink + cfg.window  # after reading token t >= start, the cache has evicted
    m = Measurement(
        sizes={
            "tokens": cfg.stream_tokens,
            "n_sink": cfg.n_sink,
            "window": cfg.window,
            "first_scored_position": start,
        }
    )
    if cfg.stream_tokens <= start + 1:
        m.not_measured = (
            f"stream_tokens {cfg.stream_tokens} leaves no target after eviction starts at {start}"
        )
        return {"evict-sinks-collapse": m}
    for name, ids in samples:
        ids = ids[: cfg.stream_tokens]
        sc = StreamConfig(
            policies=("window", "sink"),
            n_sink=cfg.n_sink,
            window=cfg.window,
            n_tokens=int(ids.numel()),
        )
        res = streaming_perplexity(model, ids, sc)
        m.sizes["method"] = (
            res.method
        )  # what ran (auto: chunked where it serves the model, else step)
        nll = {p: torch.tensor(r.nll[start:], dtype=torch.float64) for p, r in res.policies.items()}
        w, s = float(nll["window"].mean()), float(nll["sink"].mean())
        m.samples.append(
            {
                "sample": name,
                "effect": w - s,
                "ppl_window": math.exp(w),
                "ppl_sink": math.exp(s),
                "n_targets": int(nll["sink"].numel()),
            }
        )
        tick("stream")
    return {"evict-sinks-collapse": m}


# --------------------------------------------------------------------------- sensitivity
def measure_sensitivity(
    model: nn.Module, tokenizer: Any, samples: Sequence[Sample], cfg: Any, tick: Tick
) -> dict[str, Measurement]:
    """sink-stops-mixing: ``sinklab ablate -e sensitivity`` per sample, its effect
    ``log(S_masked / S)`` (:func:`~sinklab.claims.effects.sensitivity_effect`)."""
    from sinklab.ablate import AblationConfig, run_experiment

    acfg = AblationConfig(grid=cfg.grid, probes=cfg.probes, positions=(0,), seed=cfg.seed)
    m = Measurement(
        sizes={
            "tokens": cfg.sensitivity_tokens,
            "grid": cfg.grid,
            "probes": cfg.probes,
            "masked": [0],
        }
    )
    for name, ids in samples:
        ids = ids[: cfg.sensitivity_tokens]
        res = run_experiment("sensitivity", model, tokenizer, ids, acfg)
        (one,) = res.extra["texts"]  # the experiment's own effect (claims.effects) on this text
        m.samples.append(
            {
                "sample": name,
                "effect": one["effect"],
                "sensitivity": one["sensitivity"],
                "masked": one["masked"],
            }
        )
        tick("sensitivity")
    return {"sink-stops-mixing": m}


# --------------------------------------------------------------------------- geometry, density
def measure_geometry(
    model: nn.Module, samples: Sequence[Sample], cfg: Any, tick: Tick
) -> dict[str, Measurement]:
    """first-token-cosine: the attention input's first-token cosine (the layer's input after its
    own input norm), averaged over the middle layers (:func:`first_token_cosine_effect`, which
    ``sinklab ablate -e geometry`` applies too)."""
    from sinklab.probe.geometry import geometry, middle_third

    m = Measurement(sizes={"tokens": cfg.probe_tokens, "layers": middle_third(_n_layers(model))})
    for name, ids in samples:
        geo = geometry(model, ids[: cfg.probe_tokens], sites=("attention_input",))
        vals = geo.series("first_token_cosine", "attention_input")
        effect = first_token_cosine_effect(vals)
        m.samples.append({"sample": name, "effect": effect, "by_layer": vals})
        tick("geometry")
    return {"first-token-cosine": m}


def measure_density(
    model: nn.Module, samples: Sequence[Sample], cfg: Any, tick: Tick
) -> dict[str, Measurement]:
    """density-oversmooths: ``sinklab ablate -e density`` per sample (protocol mix, one lam, the
    middle third): token similarity at the attention input over the entries after the modified
    group (the experiment's :func:`~sinklab.ablate.density.after_group`), mixed minus unmodified."""
    from sinklab.ablate import AblationConfig, run_experiment
    from sinklab.ablate.density import after_entries, density_layers

    lam, site = cfg.density_lam, "attention_input"
    acfg = AblationConfig(protocol="mix", lams=(lam,), grid=2)  # grid: sensitivity's, unused
    n_layers = _n_layers(model)
    group = density_layers(acfg, n_layers)
    m = Measurement(
        sizes={
            "tokens": cfg.probe_tokens,
            "protocol": "mix",
            "lam": lam,
            "layers": group,
            "measured_layers": after_entries(group, n_layers),
        }
    )
    for name, ids in samples:
        res = run_experiment("density", model, None, ids[: cfg.probe_tokens], acfg)
        base = res.conditions["unmodified"]
        mixed = next(c for c in res.conditions.values() if c.get("lam") == lam)
        effect = mixed["after_group_similarity"][site] - base["after_group_similarity"][site]
        m.samples.append(
            {
                "sample": name,
                "effect": effect if math.isfinite(effect) else None,
                "unmodified": base["token_similarity"][site],
                "perturbed": mixed["token_similarity"][site],
            }
        )
        tick("density")
    return {"density-oversmooths": m}
