"""Worker side: read a request's cached keys and values back out of vLLM's CPU KV cache by
stream position (docs/vllm.md#layout).

``CPU_ATTN`` (vllm/v1/attention/backends/cpu_attn.py) keeps one tensor per layer,
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, and views it as
``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` split in two along dim 2: the keys, then
the values, of each block. Token ``p`` of a request lives in block ``block_table[p // B]`` at
offset ``p % B`` (vLLM's slot mapping). Inside a block the ``vec`` ISA's writer
(``ops.cpu_attn_reshape_and_cache``, C++, undocumented) stores the **values** as rows
``[block_size, head_size]`` but the **keys transposed**, ``[head_size, block_size]`` (element
``(offset, d)`` of a head at ``d * block_size + offset``), found by probing a running engine and
pinned by ``tests/test_vllm.py::test_the_kv_cache_reads_back_what_vllm_wrote``.
:data:`READABLE_ISAS` lists only what that test checked."""

from __future__ import annotations

from torch import Tensor

READABLE_ISAS = ("vec",)  # checked by test_the_kv_cache_reads_back_what_vllm_wrote (float32)


def key_value_caches(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """The key cache ``[num_blocks, num_kv_heads, head_size, block_size]`` (transposed, as the
    ``vec`` writer lays it) and the value cache ``[num_blocks, num_kv_heads, block_size,
    head_size]``: views of ``CPU_ATTN``'s per-layer tensor, no copy."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    kv = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1)
    keys, values = kv.chunk(2, dim=2)
    head_size = keys.shape[-1]
    return keys.reshape(num_blocks, num_kv_heads, head_size, block_size), values


def gather(kv_cache: Tensor, block_row: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values ``(S, num_kv_heads, head_size)`` of one request at stream ``positions``
    (S,), through its block-table row ``block_row``."""
    keys, values = key_value_caches(kv_cache)
    block_size = values.shape[2]
    positions = positions.to(block_row.device, dtype=block_row.dtype)
    blocks = block_row[positions // block_size]
    offsets = positions % block_size
    return keys[blocks, :, :, offsets], values[blocks, :, offsets]
