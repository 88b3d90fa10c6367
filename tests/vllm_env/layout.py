"""Does sinklab_vllm.cache.gather read back what vLLM's CPU attention wrote? Run inside
.venv-vllm (docs/vllm.md#layout).

Plain vLLM (the plugin off) with the engine and its worker in this process, so a wrapper around
``CPUAttentionBackendImpl.forward`` (test-only, installed by this script, not by the plugin) sees
every layer's KV cache right after vLLM wrote this step's keys and values. For each forward of
layer 0 it gathers, per request, (a) the positions just written and compares them with the keys
and values vLLM was given, and (b) every position written so far and compares them with what was
recorded when each was written. Reads ``{"model": FOLDER, "prompts": [[ids], ...], "max_tokens":
N}``; writes ``SINKLAB-RESULT {"isa", "forwards", "new_max_diff", "old_max_diff", "checked"}``."""

from __future__ import annotations

import json
import os
import sys

for key, value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(key, value)


def main() -> None:
    req = json.loads(sys.stdin.read())
    import torch
    from sinklab_vllm.cache import gather
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.attention.backends import cpu_attn

    seen: dict[int, list] = {}  # batch row -> keys/values per position (layer 0)
    stats = {"isa": None, "forwards": 0, "new": 0.0, "old": 0.0, "checked": 0}
    original = cpu_attn.CPUAttentionBackendImpl.forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k):
        if attn_metadata is not None and layer.layer_name.endswith("layers.0.self_attn.attn"):
            stats["isa"] = layer.isa
            stats["forwards"] += 1
            qsl = attn_metadata.query_start_loc.tolist()
            for r, seq_len in enumerate(attn_metadata.seq_lens.tolist()):
                n_new = qsl[r + 1] - qsl[r]
                pos = torch.arange(seq_len - n_new, seq_len)
                row = attn_metadata.block_table[r]
                k_new, v_new = gather(kv_cache, row, pos)
                stats["new"] = max(
                    stats["new"],
                    (k_new - key[qsl[r] : qsl[r + 1]]).abs().max().item(),
                    (v_new - value[qsl[r] : qsl[r + 1]]).abs().max().item(),
                )
                rows = seen.setdefault(r, [])
                rows.extend(
                    zip(
                        key[qsl[r] : qsl[r + 1]].clone(),
                        value[qsl[r] : qsl[r + 1]].clone(),
                        strict=True,
                    )
                )
                assert len(rows) == seq_len, (r, len(rows), seq_len)
                k_all, v_all = gather(kv_cache, row, torch.arange(seq_len))
                stats["old"] = max(
                    stats["old"],
                    (k_all - torch.stack([kv[0] for kv in rows])).abs().max().item(),
                    (v_all - torch.stack([kv[1] for kv in rows])).abs().max().item(),
                )
                stats["checked"] += seq_len
        return original(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k)

    cpu_attn.CPUAttentionBackendImpl.forward = forward
    llm = LLM(
        model=req["model"],
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=int(req["max_tokens"]), ignore_eos=True, detokenize=False
    )
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]]
    llm.generate(prompts, params, use_tqdm=False)
    print("SINKLAB-RESULT " + json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
