"""Scheduler side: free the KV blocks a sink + window request no longer attends to
(docs/vllm.md#blocks).

A request's token ``p`` stays in logical slot ``p`` of its block table (vLLM's slot mapping is
untouched). Before the token at position ``t`` is computed, it attends to the sinks
``0 .. n_sink-1`` and the window ``t-window .. t-1`` (StreamingLLM's step, as
``sinklab.stream.policy.kept_positions(t, ...)`` plus ``t`` itself), so every whole block inside the
gap ``[ceil(n_sink / B) * B, t - window)`` is freed and replaced by vLLM's ``null_block``, exactly
as vLLM's own ``RSWAManager`` frees its gap. Slots evicted inside a block that is still held (the
sink block's tail, the oldest window block's head) stay allocated; the attention side never reads
them (:mod:`sinklab_vllm.backend` gathers exactly the kept slots).

A decoding request holds at most :meth:`SinkWindowSpec.max_blocks` blocks, however long it runs.
A prompt chunk allocates its own blocks before the next step frees the ones that fell out, so a
request reading its prompt (or re-reading it after a preemption) holds at most
:meth:`SinkWindowSpec.admission_blocks`: that is what vLLM reserves to admit it (the manager's
``max_admission_blocks_per_request``, which vLLM sets only for its own recycling specs) and what
vLLM's start-up check and concurrency estimate count per request, so a 20,000-token request is
admitted, and resumed, on the blocks it can ever hold, not on 20,000 tokens' worth.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Self

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec


@dataclass(frozen=True, kw_only=True)
class SinkWindowSpec(FullAttentionSpec):
    """A full-attention layer's KV spec whose requests keep ``n_sink`` sinks and a ``window``."""

    n_sink: int
    window: int
    # tokens scheduled but not yet settled (vLLM's ``VllmConfig.max_in_flight_tokens``, read
    # where the spec is made): the most a prompt chunk adds before its step frees what fell out
    max_in_flight_tokens: int = 0

    def max_blocks(self) -> int:
        """Blocks one request holds at most: the sinks' blocks, plus the ``window + 1`` positions
        a decode step reads (the window and the new token), which straddle at most one more
        block than they fill."""
        return cdiv(self.n_sink, self.block_size) + cdiv(self.window + 1, self.block_size) + 1

    def admission_blocks(self, max_in_flight_tokens: int | None = None) -> int:
        """Blocks one request holds at most while a prompt chunk of up to
        ``max_in_flight_tokens`` (default: the spec's) is in flight: the sinks' blocks, plus the
        window, the chunk and the straddle. At least :meth:`max_blocks`."""
        chunk = self.max_in_flight_tokens if max_in_flight_tokens is None else max_in_flight_tokens
        reading = (
            cdiv(self.n_sink, self.block_size) + cdiv(self.window + chunk, self.block_size) + 1
        )
        return max(self.max_blocks(), reading)

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """What one request can hold (vLLM's start-up minimum and its concurrency estimate):
        :meth:`admission_blocks`, and never more than ``max_model_len`` tokens' blocks (as
        vLLM's own sliding-window spec caps it), so the plugin never asks more than full
        attention would."""
        blocks = self.admission_blocks(vllm_config.max_in_flight_tokens)
        longest = cdiv(vllm_config.model_config.max_model_len, self.block_size)
        return min(blocks, longest) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        """One spec for a group of layers: :class:`FullAttentionSpec`'s merge, with the one
        ``(n_sink, window)`` every layer of the group must share."""
        sizes = {(s.n_sink, s.window, s.max_in_flight_tokens) for s in specs}
        if len(sizes) != 1:
            raise ValueError(
                "sinklab: the layers of one KV cache group differ in (n_sink, window, "
                f"max_in_flight_tokens): {sorted(sizes)}"
            )
        merged = FullAttentionSpec.merge(specs)
        values = {f.name: getattr(merged, f.name) for f in fields(merged) if f.init}
        ((n_sink, window, in_flight),) = sizes
        return cls(**values, n_sink=n_sink, window=window, max_in_flight_tokens=in_flight)


class SinkWindowManager(FullAttentionManager):
    """Frees, one step at a time, the whole blocks that fell out between the sinks and the
    window, and admits a request on the blocks it can hold (:meth:`SinkWindowSpec.
    admission_blocks`); everything else is :class:`FullAttentionManager`'s."""

    def __init__(self, kv_cache_spec: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        if self.max_admission_blocks_per_request is None:  # vLLM sets it for its own specs only
            assert isinstance(kv_cache_spec, SinkWindowSpec)
            self.max_admission_blocks_per_request = kv_cache_spec.admission_blocks()

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Free the blocks entirely inside ``[ceil(n_sink / B) * B, t - window)``, ``t`` the
        tokens processed so far (the next token to compute sits at ``t``)."""
        del num_prompt_tokens
        spec = self.kv_cache_spec
        assert isinstance(spec, SinkWindowSpec)
        first_gap_block = cdiv(spec.n_sink, self.block_size)
        last_gap_block = max(0, processed_computed_tokens - spec.window) // self.block_size
        self._remove_blocks_in_range(request_id, first_gap_block, last_gap_block)
