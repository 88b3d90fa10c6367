"""sinklab-vllm: StreamingLLM's sink + window KV eviction for vLLM, as a plugin, never a fork
(docs/vllm.md).

vLLM calls :func:`register` (entry point ``vllm.general_plugins``) in each of its processes before
it builds its configuration. What this version does: when ``additional_config`` has a
``"sinklab"`` key, it checks the options and the final configuration (after the platform's own
adjustments) and refuses, with one sentence, whatever the design cannot run exactly
(:mod:`sinklab_vllm.refuse`). The eviction itself is not built yet, so a configuration that passes
every check is refused too, saying so: the options are never accepted and ignored. Without the
key, vLLM runs exactly as without the plugin.
"""

from __future__ import annotations

from typing import Any

from sinklab_vllm.options import SinklabVllmError, SinkOptions, options_of
from sinklab_vllm.refuse import check

__all__ = ["SinkOptions", "SinklabVllmError", "check_config", "register"]

NOT_BUILT = (
    "sinklab: the configuration passes every check, but the sink + window eviction itself is "
    "not built in sinklab-vllm 0.1 yet (docs/vllm.md#status); remove additional_config['sinklab'] "
    "to run plain vLLM"
)


def check_config(vllm_config: Any) -> SinkOptions | None:
    """The plugin's options for ``vllm_config``, or ``None`` when it is off; raises
    :class:`SinklabVllmError` for bad options, a refused setting, or (this version) any use."""
    options = options_of(getattr(vllm_config, "additional_config", None))
    if options is None:
        return None
    check(vllm_config, options)
    raise SinklabVllmError(NOT_BUILT)


def register() -> None:
    """Hook :func:`check_config` after the current platform's ``check_and_update_config`` (the
    last step of ``VllmConfig`` validation). Idempotent: vLLM may call it more than once per
    process."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if getattr(platform, "_sinklab_checked", False):
        return
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        original(cls, vllm_config)
        check_config(vllm_config)

    platform.check_and_update_config = classmethod(check_and_update_config)
    platform._sinklab_checked = True
