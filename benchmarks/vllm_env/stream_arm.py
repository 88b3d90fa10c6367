"""One arm of benchmarks/vllm_stream.py, run inside .venv-vllm (never sinklab's venv).

Reads ``{"model": FOLDER, "prompts": [[ids], ...], "max_tokens": N, "sinklab": {"n_sink",
"window"} | null, "block_size": B, "max_model_len": L}``; starts one engine
(engine and worker in this process), warms it with one short request, then generates greedily
for all prompts at once, timing the whole ``generate``. Records the most real (not null) KV
blocks any request held after an allocation, by wrapping ``FullAttentionManager``'s
``allocate_new_blocks`` (the plugin's manager is its subclass; a read, not a change). Prints
``SINKLAB-RESULT {...}``."""

from __future__ import annotations

import json
import os
import sys
import time

for key, value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}.items():
    os.environ.setdefault(key, value)


def main() -> None:
    req = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    most = {"blocks": 0, "page_bytes": 0}
    original = FullAttentionManager.allocate_new_blocks

    def allocate_new_blocks(self, request_id, *args, **kwargs):
        out = original(self, request_id, *args, **kwargs)
        real = sum(not b.is_null for b in self.req_to_blocks[request_id])
        most["blocks"] = max(most["blocks"], real)
        most["page_bytes"] = self.kv_cache_spec.page_size_bytes
        most["spec"] = type(self.kv_cache_spec).__name__
        return out

    FullAttentionManager.allocate_new_blocks = allocate_new_blocks
    extra = {} if req["sinklab"] is None else {"additional_config": {"sinklab": req["sinklab"]}}
    t0 = time.perf_counter()
    llm = LLM(
        model=req["model"],
        dtype="float32",
        max_model_len=int(req["max_model_len"]),
        block_size=int(req["block_size"]),
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
        **extra,
    )
    start_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]]
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:1], warm, use_tqdm=False)
    most["blocks"] = 0
    params = SamplingParams(
        temperature=0.0, max_tokens=int(req["max_tokens"]), ignore_eos=True, detokenize=False
    )
    w0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "engine_start_s": round(start_s, 2),
        "generate_wall_s": round(wall, 3),
        "generate_cpu_s": round(cpu, 3),
        "new_tokens": n_tokens,
        "max_blocks_per_request": most["blocks"],
        "kv_bytes_per_request": most["blocks"] * most["page_bytes"],  # one layer's pages
        "spec": most.get("spec"),
        "tokens_first": list(outs[0].outputs[0].token_ids),
    }
    print("SINKLAB-RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
