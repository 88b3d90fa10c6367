"""``probe(model, ids, config) -> ProbeResult``: every layer's and head's sink metrics in one
forward, memory-bounded; ``probe_lengths`` repeats it over prefixes of the same ids."""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from sinklab.errors import SinklabError
from sinklab.models.arch import decoder_layers, input_device, model_shape
from sinklab.probe.capture import HiddenCapture, ProbeCapture
from sinklab.probe.config import ProbeConfig
from sinklab.probe.geometry import Geometry, capture_geometry
from sinklab.probe.metrics import layer_means, nan_mean
from sinklab.probe.spec import BY_NAME, measured, names
from sinklab.progress import Progress, quiet
from sinklab.seam import check_supported, sinklab_attention

log = logging.getLogger(__name__)


@dataclass
class ProbeResult:
    """Per (layer, head) tensors (L, H), per layer lists (L), and summaries.

    The metric fields are :data:`sinklab.probe.spec.METRICS`, in that order (a test checks it);
    definitions in ``docs/metrics.md#probe-metrics``. A metric the config's metric set does not
    measure (``--metrics fast``) is None.
    """

    config: ProbeConfig
    n_tokens: int
    sink_mass: Tensor
    diagonal_mass: Tensor
    prev_token_mass: Tensor
    entropy: Tensor | None  # nats
    value_norm_ratio: Tensor
    sink_output_share: Tensor
    received: Tensor | None  # (L, H, T): mean attention each key receives (not in probe.json)
    head_kind: list[list[str]]
    first_token_cosine: list[float]
    token_similarity: list[float]
    first_token_norm_ratio: list[float]
    sink_rate: dict[str, float]
    sink_positions: list[dict[str, float | int]] | None
    meta: dict[str, Any] = field(default_factory=dict)
    # first-token cosine / token similarity per layer at three sites (sinklab.probe.geometry)
    geometry: Geometry | None = None
    # per layer, the path its attention took: "fused" (the log-sum-exp, no weights formed) or
    # "block: <why not fused>" (sinklab.seam.observe.route)
    attention_path: list[str] = field(default_factory=list)

    @property
    def n_layers(self) -> int:
        return int(self.sink_mass.shape[0])

    @property
    def n_heads(self) -> int:
        return int(self.sink_mass.shape[1])

    def to_json(self) -> dict[str, Any]:
        """``meta`` and every declared metric written to ``probe.json``
        (:func:`sinklab.probe.spec.names`), indexed [layer][head] or [layer]; NaN stays NaN."""
        data: dict[str, Any] = {"meta": self.meta}
        for key in names(in_json=True):
            value = getattr(self, key)
            if value is not None:
                value = value.tolist() if isinstance(value, Tensor) else type(value)(value)
            data[key] = value
        data["geometry"] = None if self.geometry is None else self.geometry.to_json()
        data["attention_path"] = list(self.attention_path)
        return data

    def params(self) -> dict[str, Any]:
        """The run's parameters (what a command records as ``meta.params``)."""
        return {**asdict(self.config), "tokens": self.n_tokens, "lengths": None}

    def figures(self) -> dict[str, Any]:
        """The probe's matplotlib Figures by name (heatmap, per-layer curves), with or without
        ``meta`` (a bare result is titled by its parameters)."""
        from sinklab.meta import bare_meta
        from sinklab.probe.plots import probe_figure_set

        data = self.to_json()
        data["meta"] = self.meta or bare_meta(self.params())
        return probe_figure_set(data)

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per (layer, head): ``layer``, ``head``, then every metric
        declared per head, then every metric declared per layer
        (:data:`sinklab.probe.spec.METRICS`)."""
        from sinklab.frames import layer_head_frame

        per = {name: BY_NAME[name].per for name in names(in_json=True)}
        data = self.to_json()
        return layer_head_frame(
            {k: data[k] for k, p in per.items() if p == "head"},
            {k: data[k] for k, p in per.items() if p == "layer"},
        )


def _as_ids(ids: Tensor) -> Tensor:
    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.dtype not in (torch.long, torch.int):
        raise SinklabError(f"ids must be a LongTensor (T,) or (1, T), got {tuple(ids.shape)}")
    return ids.long()


def _forward_kwargs(model: nn.Module) -> dict[str, Any]:
    params = inspect.signature(model.forward).parameters
    kw: dict[str, Any] = {"use_cache": False}
    if "logits_to_keep" in params:  # the probe needs no logits: skip the (T, vocab) matrix
        kw["logits_to_keep"] = 1
    return kw


def probe(
    model: nn.Module,
    ids: Tensor,
    config: ProbeConfig | None = None,
    progress: Progress = quiet,
) -> ProbeResult:
    """Run ``model`` once on ``ids`` (LongTensor (T,) or (1, T)) and measure every layer and head.

    Composes with active interventions: inside ``with sinklab_attention(model, handler):`` the
    probe measures the weights after ``handler`` changed them. ``progress(done, n_layers, note)``
    (:data:`~sinklab.progress.Progress`) is called as each layer finishes. Raises
    :class:`SinklabError` for bad inputs or a model whose attention can't be captured.
    """
    config = config or ProbeConfig()
    ids = _as_ids(ids)
    n_tokens = int(ids.shape[1])
    if config.q0 >= n_tokens:
        raise SinklabError(
            f"q0 = {config.q0} leaves no query among {n_tokens} tokens; use q0 < {n_tokens}"
        )
    check_supported(model)
    n_layers, n_heads = model_shape(model)
    blocks = decoder_layers(model, n_layers)
    done: set[int] = set()

    def tick(layer: int) -> None:
        if layer not in done:
            done.add(layer)
            progress(len(done), n_layers, f"layer {len(done)}/{n_layers}")

    capture = ProbeCapture(
        n_heads,
        n_tokens,
        q0=config.q0,
        on_layer=tick if blocks is None else None,
        metrics=config.metrics,
    )
    hidden = HiddenCapture(blocks or [], on_layer=tick)
    start = time.perf_counter()
    device = input_device(model)
    sites = capture_geometry(model) if blocks is not None else contextlib.nullcontext()
    with torch.no_grad(), sinklab_attention(model, capture), hidden, sites as geo:
        model(ids.to(device), **_forward_kwargs(model))
    seconds = time.perf_counter() - start
    missing = sorted(set(range(n_layers)) - set(capture.sums))
    if missing:
        raise SinklabError(
            f"{type(model).__name__}: the attention of layers {missing} did not go through "
            "transformers' AttentionInterface, so sinklab cannot capture it; use a model whose "
            "attention does (Llama, Mistral, Qwen2, Gemma, GPT-2, ...)"
        )
    # each layer's metrics on the CPU: a dispatched model's layers live on different devices
    per_layer = [
        {k: v.cpu() for k, v in capture.layer_metrics(layer).items()} for layer in range(n_layers)
    ]
    values: dict[str, Any] = {k: torch.stack([p[k] for p in per_layer]) for k in per_layer[0]}
    values |= {k: _layer_list(v, n_layers) for k, v in hidden.values.items()}
    wanted = measured(config.metrics)
    for name in names("derived"):  # in declaration order: a derived metric may use an earlier one
        if name in wanted:
            values[name] = BY_NAME[name].derive(values, config)
    values |= {name: None for name in names() if name not in wanted}
    result = ProbeResult(
        config=config,
        n_tokens=n_tokens,
        **values,
        geometry=geo,
        attention_path=[str(capture.routes[layer]) for layer in range(n_layers)],
    )
    log.info("probe: %d tokens, %d layers x %d heads, %.1fs", n_tokens, n_layers, n_heads, seconds)
    return result


def _layer_list(values: list[float], n_layers: int) -> list[float]:
    return list(values) if len(values) == n_layers else [math.nan] * n_layers


@dataclass
class LengthTrend:
    """Sink rate and mean sink mass per length, and mean sink mass per layer per length."""

    lengths: list[int]
    sink_rate: list[dict[str, float]]
    mean_sink_mass: list[float]
    sink_mass_by_layer: list[list[float]]  # [length][layer]: mean over heads

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {"tokens": n, "sink_rate": r, "mean_sink_mass": m, "sink_mass_by_layer": by}
            for n, r, m, by in zip(
                self.lengths,
                self.sink_rate,
                self.mean_sink_mass,
                self.sink_mass_by_layer,
                strict=True,
            )
        ]


def check_lengths(lengths: Sequence[int], n_available: int, q0: int = 0) -> list[int]:
    """Sorted unique lengths, each in (q0, n_available]; SinklabError otherwise."""
    if not lengths:
        raise SinklabError("--lengths is empty; pass comma-separated token counts, e.g. 128,512")
    for n in lengths:
        if n < 2 or n > n_available:
            raise SinklabError(
                f"length {n} is outside 2..{n_available} (the tokens available); "
                "pass lengths within it"
            )
        if q0 >= n:
            raise SinklabError(f"q0 = {q0} leaves no query at length {n}; use q0 < {n}")
    return sorted(set(int(n) for n in lengths))


def probe_lengths(
    model: nn.Module,
    ids: Tensor,
    lengths: Sequence[int],
    config: ProbeConfig | None = None,
    progress: Progress = quiet,
    known: ProbeResult | None = None,
) -> LengthTrend:
    """Probe the prefixes ``ids[:n]`` for each n in ``lengths`` (same text, growing context).

    ``known`` (a result on ``ids[:known.n_tokens]`` with the same config) is reused for its length.
    ``progress(done, total, note)`` (:data:`~sinklab.progress.Progress`) counts layers over all
    lengths, its note naming the length.
    """
    config = config or ProbeConfig()
    ids = _as_ids(ids)
    ns = check_lengths(lengths, int(ids.shape[1]), config.q0)
    trend = LengthTrend([], [], [], [])
    offset = 0
    for n in ns:
        if known is not None and known.n_tokens == n and known.config == config:
            res = known
        else:

            def one(done: float, total: float, _note: str, base: int = offset, n: int = n) -> None:
                progress(base + done, total * len(ns), f"{n} tokens")

            res = probe(model, ids[:, :n], config, one)
        offset += res.n_layers
        progress(offset, res.n_layers * len(ns), f"{n} tokens")
        trend.lengths.append(n)
        trend.sink_rate.append(res.sink_rate)
        trend.mean_sink_mass.append(nan_mean(res.sink_mass))
        trend.sink_mass_by_layer.append(layer_means(res.sink_mass))
    return trend
