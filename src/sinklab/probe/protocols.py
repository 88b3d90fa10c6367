"""Published sink-rate protocols, reproducible beside sinklab's own (``q0``).

sinklab's own sink rate (``sinklab probe``, protocol ``q0``) reads one long input: the mean
attention on key 0 over queries ``t >= q0``, thresholded per (layer, head). The papers measure
differently, and their numbers are only comparable under their own protocol
(docs/metrics.md#protocols):

* ``gu``: Gu et al. 2025, "When Attention Sink Emerges in Language Models" (ICLR 2025), as their
  public ``eval_sink_open_source.py`` computes it: each sample is cut to its first 64 tokens (as
  the model's tokenizer encodes it, its own first token included), and for every key ``k``

      alpha_k = sum_{i >= k} A[i, k] / (T - k)        (0-based; query 0 included)

  is the mean attention key ``k`` receives from the queries that can see it. A (sample, layer,
  head) is a sink for ``k`` when ``alpha_k > eps``; the indicator is averaged over samples, layers
  and (query) heads and reported in %, at eps 0.3. The headline is ``k = 0``, the first token;
  ``rate_by_key`` keeps the whole vector the script prints.
* ``barbero``: the same computation at eps 0.8, the threshold Barbero et al. 2025 ("Why do LLMs
  attend to the first token?") use.

:class:`AlphaCapture` is the collector: an attention handler that adds each block of query rows'
column sums into one ``(B, H, T)`` accumulator per layer, so a batch of samples costs one forward.
:func:`sample_alphas` runs it; :func:`protocol_result` thresholds the alphas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from sinklab.errors import SinklabError
from sinklab.models.arch import input_device, model_shape
from sinklab.probe.core import _forward_kwargs
from sinklab.progress import Progress, quiet
from sinklab.seam import AttentionChunk, AttentionHandler, check_supported, sinklab_attention
from sinklab.seam.observe import LayerView

OWN = "q0"  # sinklab's own protocol: sinklab.probe.probe


@dataclass(frozen=True)
class Protocol:
    """A published sink-rate protocol: its threshold, sample length and source."""

    name: str
    eps: float
    tokens: int  # each sample's first ``tokens`` tokens
    source: str


PROTOCOLS: dict[str, Protocol] = {
    "gu": Protocol(
        "gu",
        0.3,
        64,
        "Gu et al. 2025, When Attention Sink Emerges in Language Models (ICLR 2025), "
        "eval_sink_open_source.py",
    ),
    "barbero": Protocol(
        "barbero",
        0.8,
        64,
        "Barbero et al. 2025, Why do LLMs attend to the first token? "
        "(Gu et al.'s metric at eps 0.8)",
    ),
}
NAMES = (OWN, *PROTOCOLS)

#: Gu et al. 2025, Table 1: the ``gu`` sink rate (%, eps 0.3, first token) of larger models
PUBLISHED_GU = {"GPT2-XL": 77.00, "Llama2-7B": 92.47, "Mistral-7B": 97.49, "Llama3-8B": 99.02}


def get_protocol(name: str) -> Protocol:
    """The published protocol ``name``; a one-line error for anything else."""
    if name not in PROTOCOLS:
        raise SinklabError(
            f"unknown protocol {name!r}; use one of {', '.join(NAMES)} "
            f"({OWN} is sinklab's own probe)"
        )
    return PROTOCOLS[name]


class AlphaCapture(AttentionHandler):
    """Column sums of every layer's attention: ``sums[layer]`` (B, H, T), float64.

    ``sums[l][b, h, k] = sum_i A[i, k]`` over every query row of sample ``b`` (the queries of a
    plain causal forward without cache: ``A[i, k] = 0`` for ``i < k``)."""

    causal_trim = True  # the trimmed key columns are zeros: nothing to add
    fused_needs = frozenset({"received"})  # the observation path's column sums serve it

    def observe_layer(self, view: LayerView) -> None:
        """The whole layer's column sums from the fused kernel's log-sum-exp (no weights)."""
        if view.n_tokens != self.n_tokens:
            raise SinklabError(
                f"the protocols read one cache-free forward of {self.n_tokens} tokens per "
                f"sample; got {view.n_tokens}"
            )
        self.sums[view.layer] = view.column_sums(0)
        if self.on_layer is not None:
            self.on_layer(view.layer)

    def __init__(self, n_tokens: int, on_layer: Callable[[int], None] | None = None) -> None:
        self.n_tokens = n_tokens
        self.on_layer = on_layer
        self.sums: dict[int, Tensor] = {}

    def observe(self, chunk: AttentionChunk) -> None:
        w = chunk.weights  # (B, H, c, Tk)
        if chunk.q_offset != 0 or w.shape[-1] > self.n_tokens:
            raise SinklabError(
                "the protocols read one cache-free forward per batch of samples; "
                f"got queries from position {chunk.q_offset} over {w.shape[-1]} keys"
            )
        b, h = w.shape[:2]
        acc = self.sums.get(chunk.layer)
        if acc is None:
            acc = torch.zeros(b, h, self.n_tokens, dtype=torch.float64, device=w.device)
            self.sums[chunk.layer] = acc
        acc[..., : w.shape[-1]] += w.sum(dim=-2, dtype=torch.float64)
        if self.on_layer is not None and chunk.q_start + w.shape[-2] >= chunk.n_queries:
            self.on_layer(chunk.layer)

    def alphas(self, n_layers: int) -> Tensor:
        """``alpha`` (B, L, H, T) on the CPU: each column sum over the queries that see the key."""
        missing = sorted(set(range(n_layers)) - set(self.sums))
        if missing:
            raise SinklabError(
                f"the attention of layers {missing} did not go through transformers' "
                "AttentionInterface, so sinklab cannot read it"
            )
        sums = torch.stack([self.sums[li].cpu() for li in range(n_layers)], dim=1)
        seen_by = torch.arange(self.n_tokens, 0, -1, dtype=torch.float64)  # T - k queries
        return sums / seen_by


def sample_alphas(
    model: nn.Module,
    ids: Tensor,
    batch: int = 8,
    progress: Progress = quiet,
) -> Tensor:
    """``alpha`` (N, L, H, T) of every sample (row of ``ids`` (N, T)), ``batch`` rows a forward.

    ``progress(done, total, note)`` (:data:`~sinklab.progress.Progress`) counts samples."""
    ids = torch.as_tensor(ids)
    if ids.dim() != 2 or ids.shape[1] < 2 or ids.dtype not in (torch.long, torch.int):
        raise SinklabError(f"samples must be token ids (N, T) with T >= 2, got {tuple(ids.shape)}")
    if batch < 1:
        raise SinklabError(f"batch must be >= 1, got {batch}")
    check_supported(model)
    n_layers = model_shape(model)[0]
    device = input_device(model)
    out = []
    for start in range(0, ids.shape[0], batch):
        rows = ids[start : start + batch].long()
        capture = AlphaCapture(int(rows.shape[1]))
        with torch.no_grad(), sinklab_attention(model, capture):
            model(rows.to(device), **_forward_kwargs(model))
        out.append(capture.alphas(n_layers))
        done = start + int(rows.shape[0])
        progress(done, int(ids.shape[0]), f"sample {done}/{ids.shape[0]}")
    return torch.cat(out)


@dataclass
class ProtocolResult:
    """One protocol's sink rate over samples: the indicator ``alpha_k > eps`` per (sample, layer,
    head), averaged; in %, as the papers report it."""

    protocol: Protocol
    n_samples: int
    n_tokens: int
    sink_rate: float  # % of (sample, layer, head) with alpha_0 > eps
    by_sample: list[float]  # % of (layer, head) per sample: the unit of a confidence interval
    by_layer: list[float]  # % of (sample, head) per layer
    first_sink_layer: int | None  # first layer where some head is a sink in most samples
    rate_by_key: list[float]  # % for each key k (the vector the script prints)
    alpha0: list[list[float]]  # mean alpha_0 over samples, [layer][head]

    def to_json(self) -> dict[str, Any]:
        p = self.protocol
        data: dict[str, Any] = {
            "protocol": p.name,
            "source": p.source,
            "eps": p.eps,
            "samples": self.n_samples,
            "tokens": self.n_tokens,
            "published_tokens": p.tokens,
            "sink_rate_pct": self.sink_rate,
            "by_sample_pct": self.by_sample,
            "by_layer_pct": self.by_layer,
            "first_sink_layer": self.first_sink_layer,
            "rate_by_key_pct": self.rate_by_key,
            "alpha0": self.alpha0,
        }
        if p.name == "gu":
            data["published_pct"] = dict(PUBLISHED_GU)
        return data


def protocol_result(alpha: Tensor, protocol: Protocol) -> ProtocolResult:
    """Threshold ``alpha`` (N, L, H, T) at the protocol's eps."""
    sink = (alpha > protocol.eps).double()  # (N, L, H, T)
    first = sink[..., 0]  # (N, L, H)
    majority = (first.mean(0) > 0.5).any(dim=-1).nonzero()  # layers with a sink head
    return ProtocolResult(
        protocol=protocol,
        n_samples=int(alpha.shape[0]),
        n_tokens=int(alpha.shape[-1]),
        sink_rate=100.0 * float(first.mean()),
        by_sample=(100.0 * first.mean(dim=(1, 2))).tolist(),
        by_layer=(100.0 * first.mean(dim=(0, 2))).tolist(),
        first_sink_layer=int(majority[0, 0]) if majority.numel() else None,
        rate_by_key=(100.0 * sink.mean(dim=(0, 1, 2))).tolist(),
        alpha0=alpha[..., 0].mean(0).tolist(),
    )


def run_protocol(
    model: nn.Module,
    ids: Tensor,
    protocol: Protocol | str,
    batch: int = 8,
    progress: Progress = quiet,
) -> ProtocolResult:
    """The protocol's sink rate on the samples ``ids`` (N, T); ``progress(done, total, note)``
    (:data:`~sinklab.progress.Progress`) counts samples."""
    p = protocol if isinstance(protocol, Protocol) else get_protocol(protocol)
    return protocol_result(sample_alphas(model, ids, batch, progress), p)


def protocol_sentences(data: dict[str, Any]) -> list[str]:
    """What a protocol run found, in words (the command prints them)."""
    lines = [
        f"{data['protocol']} protocol ({data['source']}): {data['sink_rate_pct']:.2f} % of "
        f"(sample, layer, head) have alpha_0 > {data['eps']:g}, over {data['samples']} samples of "
        f"{data['tokens']} tokens"
    ]
    if data["tokens"] != data["published_tokens"]:
        lines.append(f"the published protocol reads {data['published_tokens']} tokens per sample")
    first = data["first_sink_layer"]
    lines.append(
        "no layer has a head that sinks in most samples"
        if first is None
        else f"first layer with a head that sinks in most samples: {first}"
    )
    if "published_pct" in data:
        cited = ", ".join(f"{k} {v:.2f}" for k, v in data["published_pct"].items())
        lines.append(f"published (Gu et al., Table 1, eps 0.3): {cited}")
    return lines


def sample_windows(
    text: Any, tokenizer: Any, n_tokens: int, n: int, prepend: str | None = None
) -> Tensor:
    """``n`` samples (n, n_tokens): consecutive stretches of ``text``, each started as the
    model's tokenizer starts a sequence (``add_special_tokens=True``: Gemma's ``<bos>``, nothing
    for Qwen2.5 or SmolLM2), as Gu et al.'s script encodes each sample; ``prepend`` ("default",
    "none", "bos", "eos", an id or one token) overrides that start, which counts toward
    ``n_tokens``. The corpus's own windows (:func:`sinklab.corpus.token_windows`), so the
    protocols start their samples exactly as every other run does."""
    from sinklab.corpus import token_windows

    return token_windows(text, tokenizer, n_tokens, n, prepend)
