"""Architecture facts a config or a model class states, read one way for every command.

Pure functions of a transformers config or model (no weights are touched): which attention
implementation a model can be loaded with, whether its attention goes through transformers'
``AttentionInterface`` (the seam sinklab hooks), how many KV heads it has, and what each layer
does with positions (RoPE, no positions at all, a sliding window of its own).
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sinklab.errors import SinklabError

#: implementations sinklab loads a model with, best first
SDPA, SINKLAB, EAGER = "sdpa", "sinklab", "eager"


def decoder_config(config: Any) -> Any:
    """The decoder's config of a config or of a model (multimodal wrappers keep it inside):
    the one place sinklab reads a model's layer and head counts from."""
    cfg = config.config if isinstance(config, nn.Module) else config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def model_shape(config: Any) -> tuple[int, int]:
    """(decoder layers, attention heads per layer) of a config or a model."""
    cfg = decoder_config(config)
    return int(cfg.num_hidden_layers), int(cfg.num_attention_heads)


@functools.lru_cache(maxsize=64)
def _module_dispatches(module_name: str) -> bool:
    """Whether a modeling module looks its attention up in ``ALL_ATTENTION_FUNCTIONS``."""
    module = sys.modules.get(module_name)
    if module is None:
        return False
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(module)
    except (OSError, TypeError):  # no source (frozen, compiled): trust the class flag only
        return False


def dispatches_attention(model_class: type) -> bool:
    """True when the class's attention goes through transformers' ``AttentionInterface``: the
    class says so (``_supports_attention_backend``) or its modeling code dispatches through
    ``ALL_ATTENTION_FUNCTIONS`` without saying so (StableLM)."""
    if getattr(model_class, "_supports_attention_backend", False):
        return True
    return _module_dispatches(model_class.__module__)


def attn_implementation(model_class: type) -> str:
    """The attention implementation to load ``model_class`` with: SDPA where the class supports
    it; else sinklab's registered function where attention goes through the interface (Gemma 2
    and gpt-oss: soft-capping and learned sinks, which SDPA lacks); else eager (BLOOM, MPT)."""
    if getattr(model_class, "_supports_sdpa", False):
        return SDPA
    if dispatches_attention(model_class):
        return SINKLAB  # the loader registers it (sinklab.seam.register) before loading
    return EAGER


def kv_heads(config: Any) -> int:
    """Key/value heads per layer, from any of the names configs use (Falcon: ``num_kv_heads``,
    or 1 for its multi-query layout)."""
    cfg = decoder_config(config)
    n_heads = int(cfg.num_attention_heads)
    if cfg.model_type == "falcon":
        if getattr(cfg, "new_decoder_architecture", False):
            return int(cfg.num_kv_heads or n_heads)
        return 1 if getattr(cfg, "multi_query", False) else n_heads
    for name in ("num_key_value_heads", "num_kv_heads", "n_head_kv"):
        if value := getattr(cfg, name, None):
            return int(value)
    return n_heads


@dataclass(frozen=True)
class LayerKind:
    """What one layer does with positions: ``rotary`` (RoPE on its keys; False for NoPE layers)
    and ``window`` (the model's own sliding window in tokens, None for global attention)."""

    rotary: bool
    window: int | None


def layer_kinds(config: Any) -> list[LayerKind]:
    """Per layer: RoPE or not (SmolLM3's ``no_rope_layers``: 1 = RoPE), and its own sliding
    window (``layer_types``; a ``sliding_window`` with no ``layer_types`` applies to every
    layer, as Mistral, Phi-3 and Starcoder2 do)."""
    cfg = decoder_config(config)
    n = int(cfg.num_hidden_layers)
    rope_flags = getattr(cfg, "no_rope_layers", None)
    rotary = [bool(x) for x in rope_flags] if rope_flags is not None else [True] * n
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        windows = [window if t == "sliding_attention" else None for t in types]
    else:
        windows = [window] * n
    return [LayerKind(r, w) for r, w in zip(rotary, windows, strict=True)]


def decoder_layers(model: nn.Module, n_layers: int) -> list[nn.Module] | None:
    """The model's decoder blocks in order: the ModuleList of ``n_layers`` blocks holding the
    attention modules (``layer_idx`` 0..n-1); None if there is no such list."""
    for mod in model.modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) != n_layers:
            continue
        idx = [
            next((int(m.layer_idx) for m in blk.modules() if hasattr(m, "layer_idx")), None)
            for blk in mod
        ]
        if idx == list(range(n_layers)):
            return list(mod)
    return None


def block_attention(block: nn.Module) -> nn.Module | None:
    """A decoder block's attention module: the first module inside it with a ``layer_idx``
    (the module transformers passes to the attention function); None if there is none."""
    return next((m for m in block.modules() if m is not block and hasattr(m, "layer_idx")), None)


def attention_modules(model: nn.Module) -> list[nn.Module] | None:
    """Each decoder layer's attention module, in layer order (index = layer); None when the
    model has no list of decoder blocks (:func:`decoder_layers`) or a block has no attention."""
    blocks = decoder_layers(model, model_shape(model)[0])
    found = [block_attention(b) for b in blocks or ()]
    return found if blocks is not None and all(m is not None for m in found) else None


def check_windows(kinds: list[LayerKind], cache_config: Any) -> None:
    """Refuse a sink cache the model's own sliding window would cut.

    When every layer slides (a ``sliding_window`` and no global layer: Mistral v0.1, Phi-3,
    Starcoder2), the sink cache holds ``n_sink + window`` keys at cache-relative positions and
    the model's window applies to those positions; with ``n_sink + window + 1`` above the
    window it would hide the sinks themselves, so that is refused. Hybrid models (some global
    layers) keep the model's window on their sliding layers and need no check."""
    capacity = getattr(cache_config, "capacity", None)
    windows = [k.window for k in kinds]
    if capacity is None or not windows or any(w is None for w in windows):
        return
    smallest = min(w for w in windows if w is not None)
    if capacity + 1 > smallest:
        n_sink = int(getattr(cache_config, "n_sink", 0))
        raise SinklabError(
            f"n_sink + window + 1 = {capacity + 1} exceeds the model's own sliding window of "
            f"{smallest} tokens, which would hide the sinks; use --window at most "
            f"{smallest - 1 - n_sink}"
        )


# ----------------------------------------------------------------------- placement (dispatch)
_OFFLOADED = ("cpu", "disk")  # accelerate keeps such weights off the main device


def _as_device(where: Any) -> torch.device:
    """An accelerate placement (an int GPU index, a string, a device) as a torch device."""
    return torch.device("cuda", where) if isinstance(where, int) else torch.device(where)


def mapped_device(device_map: dict[str, Any], name: str) -> torch.device:
    """Where accelerate runs module ``name`` under ``device_map``: its entry (the longest key
    that is ``name`` or a parent of it); an entry ``cpu`` or ``disk`` (weights offloaded) runs on
    the map's main device (the first accelerator the map names, else the CPU), as
    ``accelerate.dispatch_model`` does."""
    keys = [k for k in device_map if k in ("", name) or name.startswith(k + ".")]
    entry = device_map[max(keys, key=len)] if keys else "cpu"
    if entry in _OFFLOADED:
        accelerators = [v for v in device_map.values() if v not in _OFFLOADED]
        return _as_device(accelerators[0]) if accelerators else torch.device("cpu")
    return _as_device(entry)


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    try:
        embed = model.get_input_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError):
        return None
    return embed if isinstance(embed, nn.Module) else None


def _hook_device(module: nn.Module | None) -> torch.device | None:
    """The execution device of an accelerate hook on ``module`` (None: no such hook)."""
    hook = getattr(module, "_hf_hook", None)
    for h in [hook, *getattr(hook, "hooks", ())]:  # a SequentialHook holds several
        if (where := getattr(h, "execution_device", None)) is not None:
            return _as_device(where)
    return None


def input_device(model: nn.Module) -> torch.device:
    """The device a model's inputs (token ids, positions, masks) are put on: where its input
    embedding runs. A model dispatched by accelerate (``device_map``, offloading) keeps some
    weights on ``meta``, so its first parameter says nothing: the embedding's (or the model's)
    accelerate hook says, else ``hf_device_map``, else the embedding's first real weight, else
    the model's first real parameter (the CPU if every weight is offloaded)."""
    embed = _input_embeddings(model)
    for mod in (embed, model):
        if (dev := _hook_device(mod)) is not None:
            return dev
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, dict) and device_map:
        name = next((n for n, m in model.named_modules() if m is embed), "")
        return mapped_device(device_map, name)
    params = [*(embed.parameters() if embed is not None else ()), *model.parameters()]
    return next((p.device for p in params if p.device.type != "meta"), torch.device("cpu"))


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's activations: its input embedding's weights' (offloaded weights
    keep their dtype on ``meta``), else its first floating-point parameter's."""
    embed = _input_embeddings(model)
    params = [*(embed.parameters() if embed is not None else ()), *model.parameters()]
    return next((p.dtype for p in params if p.is_floating_point()), torch.float32)
