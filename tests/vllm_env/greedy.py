"""Greedy generation with plain vLLM (CPU build), run inside .venv-vllm, never in sinklab's venv.

Reads a JSON request on stdin: ``{"model": FOLDER, "prompts": [[ids...], ...], "max_tokens": N,
"max_model_len": L, "dtype": "float32"}``; writes ``SINKLAB-RESULT {"tokens": [[ids...], ...]}``
as one line of stdout. Everything offline (docs/vllm.md#baseline)."""

from __future__ import annotations

import json
import os
import sys

for key, value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: a few requests of a few thousand tokens
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(key, value)


def main() -> None:
    req = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=req["model"],
        dtype=req.get("dtype", "float32"),
        max_model_len=int(req.get("max_model_len", 2048)),
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=int(req["max_tokens"]), ignore_eos=True, detokenize=False
    )
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    print("SINKLAB-RESULT " + json.dumps({"tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
