"""The plugin's key mover against vLLM's own RoPE, run inside .venv-vllm (docs/vllm.md#rope).

Reads a JSON list on stdin: ``[{"name": ..., "config": FOLDER/config.json contents or a
synthetic dict, "seed": N}, ...]``. For each it builds vLLM's rotary embedding for that config
(``get_rope``, as vLLM's Llama and Qwen2 layers do), and measures, on seeded random keys:

* ``direct_vs_moved``: vLLM's rotation at ``p2`` against the mover applied to vLLM's rotation at
  ``p1`` by ``p2 - p1`` (largest absolute difference, and the largest |key|);
* ``compose``: moving by ``a`` then ``b`` against moving by ``a + b`` once;
* and writes a small sample (keys, deltas, the mover's output) for sinklab's own ``Rope.shift``
  to be compared with in sinklab's venv.

Writes ``SINKLAB-RESULT [...]`` as one line of stdout."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def vllm_rotate(rope, keys, positions):
    """``keys`` (S, heads, D) rotated by vLLM's own RoPE (its PyTorch path) at ``positions``."""
    import torch

    query = torch.zeros(keys.shape[0], keys.shape[1] * keys.shape[2])
    _, rotated = rope.forward_native(positions, query, keys.reshape(keys.shape[0], -1).clone())
    return rotated.reshape(keys.shape)


def main() -> None:
    import torch
    from sinklab_vllm.rotary import mover_of
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    out = []
    for case in json.loads(sys.stdin.read()):
        cfg = case["config"]
        head = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        heads = int(cfg["num_key_value_heads"])
        max_pos = int(cfg["max_position_embeddings"])
        with set_current_vllm_config(VllmConfig()):  # vLLM's layers are built inside one
            rope = get_rope(
                head,
                max_pos,
                is_neox_style=True,
                rope_parameters=cfg["rope_parameters"],
                dtype=torch.float32,
            )
        mover = mover_of(rope)
        g = torch.Generator().manual_seed(int(case["seed"]))
        n = 64
        keys = torch.randn(n, heads, head, generator=g)
        # the first half near the start (angles exact in float32), the rest anywhere
        near = torch.arange(n) < n // 2
        p1 = torch.where(near, 0, 1) * torch.randint(0, max_pos, (n,), generator=g)
        p1 = torch.where(near, torch.randint(0, 256, (n,), generator=g), p1)
        p2 = torch.where(near, torch.randint(0, 256, (n,), generator=g), 0)
        p2 = torch.where(near, p2, torch.randint(0, max_pos, (n,), generator=g))

        direct = vllm_rotate(rope, keys, p2)
        moved = mover.move(vllm_rotate(rope, keys, p1), p2 - p1)
        a = torch.randint(-max_pos, max_pos, (n,), generator=g)
        b = torch.randint(-max_pos, max_pos, (n,), generator=g)
        twice = mover.move(mover.move(keys, a), b)
        once = mover.move(keys, a + b)
        small = slice(0, 8)
        out.append(
            {
                "name": case["name"],
                "rotary": type(rope).__name__,
                "rotary_dim": mover.rotary_dim,
                "inv_freq": mover.inv_freq.tolist(),
                "max_pos": max_pos,
                "max_key": keys.abs().max().item(),
                "far_positions": (p1 + p2)[~near].max().item(),
                "direct_vs_moved_near": (direct - moved)[near].abs().max().item(),
                "direct_vs_moved_far": (direct - moved)[~near].abs().max().item(),
                "compose": (twice - once).abs().max().item(),
                "sample": {
                    "keys": keys[small].tolist(),
                    "delta": (p2 - p1)[small].tolist(),
                    "moved": mover.move(keys[small], (p2 - p1)[small]).tolist(),
                },
            }
        )
    print("SINKLAB-RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
