"""What the plugin refuses, checked once on vLLM's final configuration (docs/vllm.md#refuses).

Each refusal is one sentence naming the setting and the fix. Everything here reads attributes of
a ``VllmConfig`` and never starts an engine, so a refusal costs a config parse, not a model load.
"""

from __future__ import annotations

from typing import Any

from sinklab_vllm.options import SinklabVllmError, SinkOptions

FAMILIES = ("llama", "qwen2")  # the families the design starts with (issue 32)
MOVABLE_ROPE = ("default", "linear", "llama3")  # angles that do not depend on the length


def _rope_types(hf_config: Any) -> list[str]:
    """The rope types a config declares (transformers 5 ``rope_parameters``, or the older
    ``rope_scaling``), ``"default"`` when it declares none."""
    found = []
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(hf_config, name, None)
        if isinstance(params, dict) and params:
            nested = all(isinstance(v, dict) for v in params.values())
            for p in params.values() if nested else [params]:
                found.append(str(p.get("rope_type", p.get("type", "default"))))
    return found or ["default"]


def _sliding(hf_config: Any) -> str | None:
    """Why a config has sliding-window layers, or ``None``."""
    window = getattr(hf_config, "sliding_window", None)
    uses = getattr(hf_config, "use_sliding_window", None)
    if window is not None and uses is not False:
        return f"sliding_window={window}"
    kinds = set(getattr(hf_config, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        return f"layer_types {sorted(kinds)}"
    return None


def refusal(vllm_config: Any, options: SinkOptions) -> str | None:
    """The first reason the plugin cannot run ``vllm_config`` with ``options`` exactly, or
    ``None`` when nothing in it is refused."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return (
            "only vLLM's CPU build is supported in this version (the CUDA attention path is not "
            "built yet, docs/vllm.md#status); remove additional_config['sinklab']"
        )
    model = vllm_config.model_config
    hf = model.hf_text_config
    family = getattr(hf, "model_type", None)
    if family not in FAMILIES:
        return (
            f"model type {family!r} is not supported yet (supported: {', '.join(FAMILIES)}); "
            "remove additional_config['sinklab'] to run it without the plugin"
        )
    if (why := _sliding(hf)) is not None:
        return f"the model has sliding-window layers ({why}); sliding-window models are refused"
    if bad := [t for t in _rope_types(hf) if t not in MOVABLE_ROPE]:
        return (
            f"rope type {bad[0]!r} cannot be re-rotated exactly (its angles depend on the "
            f"length); supported: {', '.join(MOVABLE_ROPE)}"
        )
    if model.uses_mrope or model.is_multimodal_model:
        return "multimodal / M-RoPE models are refused"
    if getattr(model, "runner_type", "generate") != "generate":
        return f"runner {model.runner_type!r} is refused; the plugin serves generation only"
    if vllm_config.cache_config.enable_prefix_caching:
        return (
            "prefix caching is refused: pass enable_prefix_caching=False "
            "(--no-enable-prefix-caching)"
        )
    if not model.enforce_eager:
        return (
            "CUDA graphs and torch.compile are refused: pass enforce_eager=True (--enforce-eager)"
        )
    if vllm_config.speculative_config is not None:
        return "speculative decoding is refused: remove speculative_config"
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        return (
            "tensor and pipeline parallelism are refused in this version: pass "
            "tensor_parallel_size=1 and pipeline_parallel_size=1"
        )
    if str(model.dtype) != "torch.float32":
        return (
            f"dtype {model.dtype} is refused: only float32 KV caches have been read back "
            "(docs/vllm.md#layout); pass dtype='float32'"
        )
    limit = getattr(hf, "max_position_embeddings", None)
    if limit is not None and options.capacity >= int(limit):
        return (
            f"n_sink + window = {options.capacity} must be below the model's {limit} positions "
            "(the rebase wraps positions back to n_sink + window, docs/vllm.md#positions); "
            "pass a smaller window"
        )
    if vllm_config.cache_config.cache_dtype != "auto":
        return (
            f"kv_cache_dtype {vllm_config.cache_config.cache_dtype!r} is refused "
            "(a re-rotated quantized key is no longer the model's): use 'auto'"
        )
    return None


def check(vllm_config: Any, options: SinkOptions) -> None:
    """Raise :class:`SinklabVllmError` with :func:`refusal`'s reason, if any."""
    if (why := refusal(vllm_config, options)) is not None:
        raise SinklabVllmError(f"sinklab: {why}")
