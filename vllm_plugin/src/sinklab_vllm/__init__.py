"""sinklab-vllm: StreamingLLM's sink + window KV eviction for vLLM, as a plugin, never a fork
(docs/vllm.md).

vLLM calls :func:`register` (entry point ``vllm.general_plugins``) in each of its processes before
it builds its configuration. It hooks three of vLLM's extension points, none of vLLM's files:

* the platform's ``check_and_update_config`` (the last step of ``VllmConfig`` validation): when
  ``additional_config`` has a ``"sinklab"`` key, the options and the final configuration are
  checked, and whatever the design cannot run exactly is refused with one sentence
  (:mod:`sinklab_vllm.refuse`);
* the platform's ``register_custom_kv_cache_specs``: :class:`~sinklab_vllm.blocks.SinkWindowSpec`
  and its block manager join vLLM's ``KVCacheSpecRegistry``;
* ``register_backend(CPU_ATTN)``: :class:`~sinklab_vllm.backend.SinkCPUAttentionBackend`, which is
  vLLM's own CPU backend while the plugin is off and evicts while it is on.

Without the ``"sinklab"`` key vLLM runs as without the plugin.
"""

from __future__ import annotations

from typing import Any

from sinklab_vllm.options import SinklabVllmError, SinkOptions, options_of
from sinklab_vllm.refuse import check

__all__ = ["SinkOptions", "SinklabVllmError", "check_config", "register"]


def check_config(vllm_config: Any) -> SinkOptions | None:
    """The plugin's options for ``vllm_config``, or ``None`` when it is off; raises
    :class:`SinklabVllmError` for bad options or a refused setting."""
    options = options_of(getattr(vllm_config, "additional_config", None))
    if options is not None:
        check(vllm_config, options)
    return options


def register() -> None:
    """Hook the plugin into vLLM's extension points (above). Idempotent: vLLM may call it more
    than once per process."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if getattr(platform, "_sinklab_checked", False):
        return
    original_check = platform.check_and_update_config.__func__
    original_specs = platform.register_custom_kv_cache_specs.__func__

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        original_check(cls, vllm_config)
        options = check_config(vllm_config)
        if current_platform.is_cpu():
            from sinklab_vllm.backend import set_active

            set_active(options, vllm_config)

    def register_custom_kv_cache_specs(cls: type, vllm_config: Any) -> None:
        original_specs(cls, vllm_config)
        if current_platform.is_cpu():
            from vllm.v1.kv_cache_interface import FullAttentionSpec
            from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

            from sinklab_vllm.blocks import SinkWindowManager, SinkWindowSpec

            KVCacheSpecRegistry.register(
                SinkWindowSpec, SinkWindowManager, uniform_type_base_spec=FullAttentionSpec
            )

    platform.check_and_update_config = classmethod(check_and_update_config)
    platform.register_custom_kv_cache_specs = classmethod(register_custom_kv_cache_specs)
    platform._sinklab_checked = True
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        from sinklab_vllm.backend import CLASS_PATH

        register_backend(AttentionBackendEnum.CPU_ATTN, CLASS_PATH)
