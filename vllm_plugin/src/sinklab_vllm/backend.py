"""Worker side, wired: vLLM's CPU attention backend with StreamingLLM's sink + window eviction
(docs/vllm.md#wiring).

:class:`SinkCPUAttentionBackend` replaces the class behind ``AttentionBackendEnum.CPU_ATTN``
(``register_backend``, from the plugin's ``register()``). With the plugin off it *is* vLLM's
backend: the subclass adds nothing to a forward. With ``additional_config["sinklab"]`` on:

* ``customize_spec`` turns each decoder layer's ``FullAttentionSpec`` into a
  :class:`sinklab_vllm.blocks.SinkWindowSpec`, so the scheduler's
  :class:`~sinklab_vllm.blocks.SinkWindowManager` frees whole blocks as they fall out of the window
  and vLLM's start-up check sees the bounded footprint of a decoding request (a long prompt's
  chunk holds its own blocks until the next step, which admission counts, docs/vllm.md#wiring);
* each forward first runs vLLM's own kernel for the whole batch: every query whose position
  ``s`` is at most ``n_sink + window`` sees everything before it, which is what StreamingLLM
  attends to then, so those outputs are vLLM's unchanged (a decode request past the window is
  handed to the kernel one token long, :class:`SinkCPUAttentionMetadataBuilder`, since its
  output is replaced). Then every query past that point (decode or a long prompt's chunk) is
  recomputed over exactly its kept slots (sinks moved next to the window, the window as
  cached), the layer's such queries in one gather and one batched softmax per
  ``QUERIES_AT_ONCE`` (:func:`sinklab_vllm.attention.attend_evicted`), and its output row
  is overwritten. Where those slots sit and how the sinks turn is the same in every layer: the
  first layer of a forward plans it (:func:`sinklab_vllm.attention.plan_evicted`) and the
  others reuse the plan. Freed blocks (vLLM's ``null_block``) and the evicted tails of held
  blocks are never read by that path.

vLLM's slot mapping and lengths keep the stream index. RoPE positions are the stream index
below the model's ``max_position_embeddings`` and are wrapped past it (the rebase,
:func:`sinklab_vllm.attention.rotated_at`, a pre-hook on the model's rotary embedding), so a
request may run as long as ``max_model_len`` allows (``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` lets it
pass the model's positions) and no token is rotated past the model's table.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from sinklab_vllm.attention import attend_evicted, plan_evicted, rotated_at
from sinklab_vllm.blocks import SinkWindowSpec
from sinklab_vllm.options import SinkOptions, options_of
from sinklab_vllm.rotary import KeyMover, mover_of

CLASS_PATH = "sinklab_vllm.backend.SinkCPUAttentionBackend"
QUERIES_AT_ONCE = 64  # evicted queries per gather: a long prompt's chunk is taken in pieces

# The options of the engine this process serves, and its in-flight tokens (vLLM's
# ``max_in_flight_tokens``), recorded when its configuration is checked or its layers are built
# (a worker process sees the layers, the engine core the configuration).
_ACTIVE: dict[str, Any] = {"options": None, "in_flight": 0}


def set_active(options: SinkOptions | None, vllm_config: Any = None) -> None:
    """Record the options of the engine being built in this process (``None``: plugin off) and,
    from ``vllm_config``, its in-flight tokens."""
    _ACTIVE["options"] = options
    if vllm_config is not None:
        _ACTIVE["in_flight"] = int(vllm_config.max_in_flight_tokens)


def active_options() -> SinkOptions | None:
    """The plugin's options for the engine being built or run here, or ``None`` when off: read
    from vLLM's current configuration when one is set, else what was last recorded."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is not None and getattr(config, "additional_config", None) is not None:
        options = options_of(config.additional_config)
        set_active(options, config)
        return options
    return _ACTIVE["options"]


def sink_spec(
    spec: FullAttentionSpec, options: SinkOptions, max_in_flight_tokens: int | None = None
) -> SinkWindowSpec:
    """``spec`` with the request footprint of a sink + window cache; ``max_in_flight_tokens``
    (default: the engine's, as :func:`set_active` recorded it) bounds what a prompt chunk adds."""
    if max_in_flight_tokens is None:
        max_in_flight_tokens = int(_ACTIVE["in_flight"])
    values = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
    return SinkWindowSpec(
        **values,
        n_sink=options.n_sink,
        window=options.window,
        max_in_flight_tokens=max_in_flight_tokens,
    )


def _model_rope() -> tuple[Any, int]:
    """The rotary embedding of the model being built and its ``max_position_embeddings``:
    vLLM's ``get_rope`` caches one object per set of arguments, and this is the call vLLM's Llama
    and Qwen2 layers make, so it returns the very object their attention calls."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    hf = get_current_vllm_config().model_config.hf_text_config
    head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    max_position = int(hf.max_position_embeddings)
    rope = get_rope(
        int(head),
        max_position=max_position,
        rope_parameters=getattr(hf, "rope_parameters", None),
        is_neox_style=True,
    )
    return rope, max_position


def _rebase_positions(rope: Any, capacity: int, max_position: int) -> None:
    """Make ``rope`` rotate each token at :func:`~sinklab_vllm.attention.rotated_at` of its
    position (a forward pre-hook on the module: the model calls ``rotary_emb(positions, q, k)``);
    once per rotary object. vLLM's slot mapping and lengths keep the stream index."""
    if getattr(rope, "_sinklab_rebase", None) is not None:
        if rope._sinklab_rebase != (capacity, max_position):
            raise ValueError("sinklab: one rotary embedding serves two different caches")
        return

    def remap(module: Any, args: tuple) -> tuple:
        module._sinklab_calls += 1
        return (rotated_at(args[0], capacity, max_position), *args[1:])

    rope.register_forward_pre_hook(remap)
    rope._sinklab_rebase = (capacity, max_position)
    rope._sinklab_calls = 0


class SinkCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata, with each evicted decode request's length cut to 1 for vLLM's kernel.

    The kernel's output for a query past the window is replaced anyway (below), so it need not
    attend over the whole stream: a decode request (one query) past the window is handed to the
    kernel as if it were one token long (it reads the request's slot 0, a kept sink), which keeps
    a decode step's cost bounded however long the stream. The real lengths travel as
    ``sink_seq_lens`` for the plugin's own path. A prompt's chunk keeps its length (the kernel's
    causal mask needs it)."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.sink_options = options_of(getattr(vllm_config, "additional_config", None))

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False):
        options = self.sink_options
        if options is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        common = common_attn_metadata
        seq_lens = common.seq_lens
        q_lens = common.query_start_loc[1:] - common.query_start_loc[:-1]
        evicted = (q_lens == 1) & (seq_lens > options.capacity + 1)
        if bool(evicted.any()):
            short = torch.where(evicted, torch.ones_like(seq_lens), seq_lens)
            common = replace(common, seq_lens=short, max_seq_len=int(short.max()))
        metadata = super().build(common_prefix_len, common, fast_build)
        metadata.sink_seq_lens = seq_lens
        return metadata


class SinkCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, then StreamingLLM's attention for every query past the window."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sink_options = active_options()
        self.mover: KeyMover | None = None
        self.max_position: int | None = None
        self.rope: Any = None
        if self.sink_options is not None:
            self.rope, self.max_position = _model_rope()
            # one mover a rotary object (vLLM shares it between layers): a forward's plan, keyed
            # by its mover, then serves every layer
            self.mover = getattr(self.rope, "_sinklab_mover", None) or mover_of(self.rope)
            self.rope._sinklab_mover = self.mover
            _rebase_positions(self.rope, self.sink_options.capacity, self.max_position)

    def _plan(self, attn_metadata: Any, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, Any]]:
        """This forward's queries past the window, ``QUERIES_AT_ONCE`` at a time: each piece's
        output rows and its :class:`~sinklab_vllm.attention.EvictedPlan`. Built by the first
        layer that reads ``attn_metadata`` and kept on it: vLLM hands one metadata object to
        every layer of a KV-cache group, and the slots and the sinks' rotations are the same
        in each, so a decode step plans once instead of once a layer."""
        options, mover = self.sink_options, self.mover
        block_size = kv_cache.shape[2]
        key = (kv_cache.dtype, block_size, int(attn_metadata.num_actual_tokens))
        cached = getattr(attn_metadata, "sink_plan", None)  # (mover, key, pieces)
        if cached is not None and cached[0] is mover and cached[1] == key:
            return cached[2]
        limit = options.capacity  # a query at s <= n_sink + window sees everything before it
        seq_lens = getattr(attn_metadata, "sink_seq_lens", attn_metadata.seq_lens).tolist()
        pieces: list[tuple[torch.Tensor, Any]] = []
        if max(seq_lens, default=0) > limit + 1:
            qsl = attn_metadata.query_start_loc.tolist()
            index, where, request = [], [], []  # each evicted query: its row, position, request
            for r, seq_len in enumerate(seq_lens):
                start, end = qsl[r], qsl[r + 1]
                first = seq_len - (end - start)  # stream position of the request's first query
                for i in range(max(start, start + limit + 1 - first), end):
                    index.append(i)
                    where.append(first + (i - start))
                    request.append(r)
            if where and max(where) >= self.max_position and not self.rope._sinklab_calls:
                # the model rotated with another rotary object than the one hooked: past the
                # table its positions would be wrong, so stop rather than answer wrongly
                raise RuntimeError(
                    "sinklab: the rebase hook is not on this model's rotary embedding; positions "
                    f"past {self.max_position} cannot be run exactly (docs/vllm.md#positions)"
                )
            # pieces bound each layer's gathered keys; the plans (block ids and offsets, cos and
            # sin) live for the forward, some 17-25 MB at 4,096 evicted queries with 4 + 252
            for at in range(0, len(index), QUERIES_AT_ONCE):
                reqs = torch.tensor(request[at : at + QUERIES_AT_ONCE], dtype=torch.long)
                plan = plan_evicted(
                    attn_metadata.block_table[reqs],
                    torch.tensor(where[at : at + QUERIES_AT_ONCE], dtype=torch.long),
                    options.n_sink,
                    options.window,
                    mover,
                    block_size,
                    kv_cache.dtype,
                    self.max_position,
                )
                idx = torch.tensor(index[at : at + QUERIES_AT_ONCE], dtype=torch.long)
                pieces.append((idx, plan))
        attn_metadata.sink_plan = (mover, key, pieces)
        return pieces

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = super().forward(
            layer,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            output,
            output_scale,
            output_block_scale,
        )
        options = self.sink_options
        if options is None or attn_metadata is None or self.mover is None:
            return out
        pieces = self._plan(attn_metadata, kv_cache)
        if not pieces:
            return out
        rows = output[: attn_metadata.num_actual_tokens].view(-1, self.num_heads, self.head_size)
        for idx, plan in pieces:
            rows[idx] = attend_evicted(query[idx], kv_cache, plan, self.mover, self.scale)
        return out


class SinkCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with the plugin's spec and forward; vLLM's own when the plugin is off."""

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        spec = super().customize_spec(spec)
        options = active_options()
        if options is None or type(spec) is not FullAttentionSpec:
            return spec
        return sink_spec(spec, options)

    @staticmethod
    def get_impl_cls() -> type[SinkCPUAttentionImpl]:
        return SinkCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SinkCPUAttentionMetadataBuilder]:
        return SinkCPUAttentionMetadataBuilder
