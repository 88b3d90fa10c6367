"""Token geometry at three sites of every layer: where a cosine is measured decides what it says.

For layer ``l`` (docs/experiments.md, "Geometry"):

* ``residual``: the residual stream *entering* layer ``l`` (``hidden_states[l]`` of transformers);
* ``attention_input``: what the layer's attention module receives, i.e. the residual after the
  layer's own input norm (Llama RMSNorm, Gemma ``(1 + w)`` RMSNorm, GPT-2 ``ln_1``), captured with
  a forward pre-hook on the attention module: the model's own norm, never a re-implementation;
* ``key``: the keys of that input before RoPE, per KV head: the cosine of a head's key vectors,
  averaged over the KV heads. ``k_proj``'s output; where the model normalises its keys (``k_norm``
  of Qwen3, Gemma 3, OLMo 2, Cohere; StableLM's ``k_layernorm``) the norm's output, brought back to
  (B, T, KV, hd) from whichever layout the model gives its norm (Gemma 3 normalises (B, KV, T, hd),
  Qwen3 (B, T, KV, hd), OLMo 2 the flat (B, T, KV * hd)): the layout is found by matching the norm's
  input to the projection's output of the same forward, never guessed from shapes. Fused
  projections are split as the model splits them (GPT-2 ``c_attn``, Phi-3 ``qkv_proj``, GPT-NeoX,
  Falcon and BLOOM ``query_key_value``, MPT ``Wqkv``). ``None`` where no key is reachable, with a
  reason.

Pure functions (:func:`first_token_cosine`, :func:`token_similarity`: docs/metrics.md's
definitions, applied per head group) and one context manager, :func:`capture_geometry`, whose
hooks compute the numbers as each layer runs (a few floats per layer are kept) and are always
removed on exit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from sinklab.errors import SinklabError
from sinklab.models.arch import block_attention, decoder_config, decoder_layers, input_device
from sinklab.probe import metrics as M

SITES = ("residual", "attention_input", "key")
METRICS = ("first_token_cosine", "token_similarity")
FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_norm")


# --------------------------------------------------------------------------- pure functions
_first_cos = M.first_token_cosine  # (T, d) -> float
_pair_cos = M.token_similarity  # (T, d) -> float, tokens 1.. only


def _groups(x: Tensor) -> Tensor:
    """(T, d) -> (1, T, d); (T, G, d) (per-head vectors) -> (G, T, d)."""
    if x.dim() == 2:
        return x[None]
    if x.dim() == 3:
        return x.transpose(0, 1)
    raise ValueError(f"expected (T, d) or (T, G, d), got {tuple(x.shape)}")


def first_token_cosine(x: Tensor) -> float:
    """Mean over j >= 1 of ``cos(x_0, x_j)``; for (T, G, d) the mean over the G groups (heads)."""
    return sum(_first_cos(g) for g in _groups(x)) / _groups(x).shape[0]


def token_similarity(x: Tensor) -> float:
    """Mean pairwise cosine over i != j, i, j >= 1; for (T, G, d) the mean over the G groups."""
    return sum(_pair_cos(g) for g in _groups(x)) / _groups(x).shape[0]


def site_numbers(x: Tensor) -> dict[str, float]:
    """Both metrics of one site's vectors (B, T, ...) : the mean over the batch rows (and head
    groups), both from one normalisation of each group (:func:`sinklab.probe.metrics.cosines`)."""
    pairs = [M.cosines(g) for r in x.detach() for g in _groups(r)]
    per_row = len(pairs) // x.shape[0]
    first, similar = zip(*pairs, strict=True)
    return {  # a mean over groups within a row, then over rows: all rows have as many groups
        "first_token_cosine": sum(first) / per_row / x.shape[0],
        "token_similarity": sum(similar) / per_row / x.shape[0],
    }


# --------------------------------------------------------------------------- result
@dataclass
class Geometry:
    """Per-layer numbers by site: ``values[site][metric][layer]`` (None where not measured).

    ``final`` holds the same numbers after the last layer: ``residual`` on the final hidden state
    *before* the final norm, ``attention_input`` on its output (what the LM head reads); empty when
    the model has no final norm sinklab can find. ``key_note`` says why ``key`` is None, if it is.
    """

    n_layers: int
    values: dict[str, dict[str, list[float | None]]]
    final: dict[str, dict[str, float]] = field(default_factory=dict)
    key_note: str | None = None

    def series(self, metric: str, site: str, final: bool = False) -> list[float | None]:
        """``metric`` at ``site`` per layer (and the final entry when ``final``)."""
        out = list(self.values[site][metric])
        if final:
            out.append(self.final.get(site, {}).get(metric))
        return out

    def layers_json(self) -> list[dict[str, Any]]:
        """``[{"layer": l, "first_token_cosine": {site: x}, "token_similarity": {site: y}}]``."""
        return [
            {"layer": li, **{m: {s: self.values[s][m][li] for s in SITES} for m in METRICS}}
            for li in range(self.n_layers)
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "sites": list(SITES),
            "layers": self.layers_json(),
            "final": self.final,
            "key_note": self.key_note,
        }


# --------------------------------------------------------------------------- locating modules
def _attention(block: nn.Module) -> nn.Module:
    if (attn := block_attention(block)) is not None:
        return attn
    raise SinklabError(f"{type(block).__name__} holds no attention module with a layer_idx")


KEY_NORMS = ("k_norm", "k_layernorm")  # the module a family normalises its keys with


def _key_source(attn: nn.Module, cfg: Any) -> tuple[nn.Module, Any] | str:
    """(module, output -> (B, T, KV, hd) keys) of the key projection, or the reason the keys are not
    reachable. A key norm after the projection is :func:`_key_norm`'s business."""
    n_heads = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    hd = int(getattr(attn, "head_dim", 0) or getattr(attn, "head_size", 0) or 0)
    hd = hd or cfg.hidden_size // n_heads

    def heads(k: Tensor) -> Tensor:
        return k.reshape(*k.shape[:2], -1, hd)  # (B, T, KV, hd)

    if isinstance(getattr(attn, "k_proj", None), nn.Module):
        return attn.k_proj, heads
    if isinstance(getattr(attn, "c_attn", None), nn.Module) and not getattr(
        attn, "is_cross_attention", False
    ):  # GPT-2: fused [q | k | v], each hidden_size wide
        d = int(cfg.hidden_size)
        return attn.c_attn, lambda out: heads(out[..., d : 2 * d])
    if isinstance(getattr(attn, "qkv_proj", None), nn.Module):  # Phi-3: [q (H hd) | k | v]
        q, k = n_heads * hd, n_kv * hd
        return attn.qkv_proj, lambda out: heads(out[..., q : q + k])
    fused = getattr(attn, "query_key_value", None)
    if isinstance(fused, nn.Module):
        if callable(getattr(attn, "_split_heads", None)):  # Falcon: its own split, (B, T, H', hd)
            return fused, lambda out: attn._split_heads(out)[1]
        if callable(getattr(attn, "_reshape", None)):  # BLOOM: its own split, (B, H, T, hd)
            return fused, lambda out: attn._reshape(out)[1].transpose(1, 2)
        # GPT-NeoX: per head [q | k | v], each hd wide
        return fused, lambda out: out.reshape(*out.shape[:2], -1, 3 * hd)[..., hd : 2 * hd]
    if isinstance(getattr(attn, "Wqkv", None), nn.Module):  # MPT: [q | k | v], clipped first
        clip = getattr(attn, "clip_qkv", None)

        def mpt(out: Tensor) -> Tensor:
            out = out.clamp(min=-clip, max=clip) if clip else out
            return heads(out.chunk(3, dim=-1)[1])

        return attn.Wqkv, mpt
    return (
        f"{type(attn).__name__} has no k_proj, c_attn, qkv_proj, query_key_value or Wqkv sinklab "
        "can split, so its keys are not reachable"
    )


def _key_norm(attn: nn.Module) -> nn.Module | None:
    """The module the attention normalises its keys with before RoPE, if it has one."""
    for name in KEY_NORMS:
        if isinstance(mod := getattr(attn, name, None), nn.Module):
            return mod
    return None


def normed_key_heads(norm_in: Tensor, norm_out: Tensor, keys: Tensor) -> Tensor | None:
    """The key norm's output as (B, T, KV, hd), given its input and the projection's keys
    ``keys`` (B, T, KV, hd) of the same forward: the layout in which ``norm_in`` equals the keys
    (flat (B, T, KV * hd), (B, T, KV, hd) or (B, KV, T, hd)) is undone on ``norm_out``.
    ``None`` when the norm's input is none of them (something ran between the two)."""
    b, t, kv, hd = keys.shape
    layouts = (
        (keys.reshape(b, t, kv * hd), lambda y: y.reshape(b, t, kv, hd)),
        (keys, lambda y: y),
        (keys.transpose(1, 2), lambda y: y.transpose(1, 2)),
    )
    for view, back in layouts:
        if norm_in.shape == view.shape and torch.equal(norm_in, view):
            return back(norm_out)
    return None


def _final_norm(model: nn.Module) -> nn.Module | None:
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    for name in FINAL_NORMS:
        mod = getattr(base, name, None)
        if isinstance(mod, nn.Module):
            return mod
    return None


def _hidden_arg(args: tuple, kwargs: dict[str, Any]) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


# --------------------------------------------------------------------------- capture
@contextmanager
def capture_geometry(
    model: nn.Module, sites: tuple[str, ...] = SITES, final: bool = True
) -> Iterator[Geometry]:
    """Hooks that fill a :class:`Geometry` during every forward inside the block (the last forward
    wins); removed on exit, also on error. ``sites`` limits the work (unlisted sites stay None)."""
    unknown = [s for s in sites if s not in SITES]
    if unknown:
        raise SinklabError(f"unknown geometry sites {unknown}; use: {', '.join(SITES)}")
    cfg = decoder_config(model)
    n_layers = int(cfg.num_hidden_layers)
    blocks = decoder_layers(model, n_layers)
    if blocks is None:
        raise SinklabError(
            f"{type(model).__name__}: no list of {n_layers} decoder layers found, so sinklab "
            "cannot measure per-layer geometry"
        )
    geo = Geometry(n_layers, {s: {m: [None] * n_layers for m in METRICS} for s in SITES})
    handles: list[RemovableHandle] = []
    projected: dict[int, Tensor] = {}  # layer -> keys before the key norm, this forward

    def put(site: str, layer: int, x: Tensor) -> None:
        for m, v in site_numbers(x).items():
            geo.values[site][m][layer] = v

    def pre(site: str, layer: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            put(site, layer, _hidden_arg(args, kwargs))

        return hook

    def keys(layer: int, to_heads, normed: bool):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            if normed:  # the key norm's hook below measures them
                projected[layer] = to_heads(output)
            else:
                put("key", layer, to_heads(output))  # (B, T, KV, hd): per-head cosines

        return hook

    def normed_keys(layer: int):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            raw = projected.pop(layer, None)
            got = None if raw is None else normed_key_heads(args[0], output, raw)
            if got is None:
                geo.key_note = (
                    f"{type(module).__name__} (the key norm) does not read the key projection's "
                    "output, so its keys are not measured"
                )
                return
            put("key", layer, got)

        return hook

    def final_hook(module: nn.Module, args: tuple, output: Tensor) -> None:
        geo.final["residual"] = site_numbers(args[0])
        geo.final["attention_input"] = site_numbers(output)

    try:
        for li, blk in enumerate(blocks):
            attn = _attention(blk)
            if "residual" in sites:
                handles.append(blk.register_forward_pre_hook(pre("residual", li), with_kwargs=True))
            if "attention_input" in sites:
                hook = pre("attention_input", li)
                handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
            if "key" in sites:
                src, norm = _key_source(attn, cfg), _key_norm(attn)
                if isinstance(src, str):
                    geo.key_note = src
                else:
                    hook = keys(li, src[1], normed=norm is not None)
                    handles.append(src[0].register_forward_hook(hook))
                    if norm is not None:
                        handles.append(norm.register_forward_hook(normed_keys(li)))
        norm = _final_norm(model) if final else None
        if norm is not None:
            handles.append(norm.register_forward_hook(final_hook))
        yield geo
    finally:
        for hd in handles:
            hd.remove()


def geometry(model: nn.Module, ids: Tensor, sites: tuple[str, ...] = SITES) -> Geometry:
    """One forward over ``ids`` ((T,) or (B, T); B rows are averaged) with the hooks on."""
    ids = torch.as_tensor(ids).long()
    ids = ids if ids.dim() == 2 else ids[None]  # (B, T)
    if ids.shape[-1] < 3:
        raise SinklabError(f"geometry needs at least 3 tokens, got {ids.shape[-1]}")
    device = input_device(model)
    with torch.no_grad(), capture_geometry(model, sites) as geo:
        model(ids.to(device), use_cache=False)
    return geo


def middle_third(n_layers: int) -> list[int]:
    """The middle third of ``range(n_layers)`` (np.array_split sizes; all layers if < 3)."""
    chunks = torch.arange(n_layers).tensor_split(3)
    mid = [int(x) for x in chunks[1]] if n_layers >= 3 else []
    return mid or list(range(n_layers))
