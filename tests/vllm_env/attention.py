"""sinklab_vllm.attention.sink_attention against vLLM's own CPU attention kernel, inside a running
engine, on the keys both attend to. Run inside .venv-vllm (docs/vllm.md#attention).

Plain vLLM (the plugin off), engine and worker in this process, a test-only wrapper around
``CPUAttentionBackendImpl.forward``: after vLLM's kernel has written its output, for every decode
query of every layer it computes ``sink_attention`` for each ``(n_sink, window)`` variant and
records the largest difference from the kernel's output. A variant whose kept set is what the
kernel attends to must match: everything before the query (nothing evicted), or, with the model's
own sliding window forced on (``hf_overrides``) and ``n_sink = 0``, the window (which exercises
gathering a window out of partially evicted blocks). Reads ``{"model": FOLDER, "prompts": [[ids],
...], "max_tokens": N, "hf_overrides": {...} | null, "variants": [{"n_sink", "window"}, ...]}``;
writes ``SINKLAB-RESULT [{"queries", "evicted", "max_diff", "max_out", "kept"}, ...]``, one per
variant."""

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
    from sinklab_vllm.attention import kept_slots, sink_attention
    from sinklab_vllm.rotary import KeyMover
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.attention.backends import cpu_attn

    variants = [(int(v["n_sink"]), int(v["window"])) for v in req["variants"]]
    stats = [
        {"queries": 0, "evicted": 0, "max_diff": 0.0, "max_out": 0.0, "kept": 0} for _ in variants
    ]
    original = cpu_attn.CPUAttentionBackendImpl.forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k):
        out = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k)
        if attn_metadata is None:
            return out
        import torch

        # never used: the variants compared have no sinks past a gap (n_sink + window >= t, or
        # n_sink = 0)
        mover = KeyMover(torch.ones(1, dtype=torch.float64), 2, query.shape[-1])
        qsl = attn_metadata.query_start_loc.tolist()
        theirs_all = output.view(query.shape[0], self.num_heads, -1)
        for r, seq_len in enumerate(attn_metadata.seq_lens.tolist()):
            if qsl[r + 1] - qsl[r] != 1:
                continue  # decode queries only
            t = seq_len - 1
            theirs = theirs_all[qsl[r]]
            for (n_sink, window), st in zip(variants, stats, strict=True):
                ours = sink_attention(
                    query[qsl[r]],
                    kv_cache,
                    attn_metadata.block_table[r],
                    t,
                    n_sink,
                    window,
                    mover,
                    self.scale,
                )
                st["queries"] += 1
                st["evicted"] += int(t > n_sink + window)
                st["kept"] = max(st["kept"], len(kept_slots(t, n_sink, window)))
                st["max_diff"] = max(st["max_diff"], (ours - theirs).abs().max().item())
                st["max_out"] = max(st["max_out"], theirs.abs().max().item())
        return out

    cpu_attn.CPUAttentionBackendImpl.forward = forward
    llm = LLM(
        model=req["model"],
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
        hf_overrides=req.get("hf_overrides"),
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=int(req["max_tokens"]), ignore_eos=True, detokenize=False
    )
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]]
    llm.generate(prompts, params, use_tqdm=False)
    print("SINKLAB-RESULT " + json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
