"""vLLM with the sinklab-vllm plugin on (or off: ``n_sink`` null, the test's control): greedy
tokens, their log-probabilities and the KV blocks each request holds. Run inside .venv-vllm,
never in sinklab's venv (docs/vllm.md#wiring-tests).

Engine and worker in this process. Reads ``{"model": FOLDER, "prompts": [[ids], ...],
"max_tokens": N, "n_sink": n | null, "window": W | null, "block_size": B, "max_model_len": L,
"hf_overrides": {...} (optional), "env": {VAR: value} (optional, set before vLLM starts),
"engine": {more LLM(...) arguments} (optional), "score": [[ids], ...] (optional: instead of
generating, each sequence's own log-probabilities,
``SINKLAB-RESULT {"scores": [[null, lp, ...], ...]}``)}``;
generates greedily (``temperature=0``, ``ignore_eos``) all prompts in one batch; records, after
every block allocation of every request, how many real (not null) blocks it holds, by wrapping
``FullAttentionManager.allocate_new_blocks`` (the plugin's manager inherits it; a read, not a
change). Writes ``SINKLAB-RESULT {"tokens": [[...], ...], "logprobs": [[each chosen token's
log-probability], ...], "max_blocks": [per request], "bound": the spec's bound or null,
"admission": the manager's admission cap in blocks or null, "in_flight": the spec's in-flight
tokens or null, "engine_in_flight": the engine configuration's, "spec": class name,
"seconds": generate's wall time, "mixed_steps": builds (one per layer group and forward) where a
decode past the window sat beside a prompt chunk, "evicted_builds": builds with a query past the
window, "pieces": the ``QUERIES_AT_ONCE`` pieces their evicted queries make, "plans": the
plugin's ``plan_evicted`` calls (one a piece, not one a layer), "preempted": per request, how
many times the scheduler preempted it, "preempted_at": the most tokens it had then (0: never)}``."""

from __future__ import annotations

import json
import os
import sys
import time

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


def _chosen(output) -> list[float]:
    """The log-probability vLLM gave each token it chose (from the raw logits)."""
    return [step[tok].logprob for tok, step in zip(output.token_ids, output.logprobs, strict=True)]


def _scored(output) -> list[float | None]:
    """Per position of a scored sequence, the log-probability of its token given the ones
    before (``None`` for the first)."""
    ids = output.prompt_token_ids
    return [
        None if lp is None else lp[tok].logprob
        for tok, lp in zip(ids, output.prompt_logprobs, strict=True)
    ]


def _is(scheduler_id: str, request_id: str) -> bool:
    """Whether a scheduler's request id is the front end's ``request_id`` (the engine core may
    suffix it)."""
    return scheduler_id == request_id or scheduler_id.startswith(request_id + "-")


def _held_by(held: dict[str, int], request_id: str) -> int:
    """The most blocks the scheduler's request behind an output held (the engine core may suffix
    the front end's id)."""
    found = [n for rid, n in held.items() if _is(rid, request_id)]
    if len(found) != 1:
        raise SystemExit(f"no single scheduler request for {request_id!r} in {sorted(held)}")
    return found[0]


def main() -> None:
    req = json.loads(sys.stdin.read())
    os.environ.update(req.get("env") or {})  # before vLLM reads its variables
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    held: dict[str, int] = {}
    seen: dict[str, object] = {}
    original = FullAttentionManager.allocate_new_blocks  # the plugin's manager is a subclass

    def allocate_new_blocks(self, request_id, *args, **kwargs):
        out = original(self, request_id, *args, **kwargs)
        real = sum(not b.is_null for b in self.req_to_blocks[request_id])
        held[request_id] = max(held.get(request_id, 0), real)
        seen["spec"], seen["manager"] = self.kv_cache_spec, self
        return out

    FullAttentionManager.allocate_new_blocks = allocate_new_blocks
    from vllm.v1.core.sched.scheduler import Scheduler

    # each preemption: the request and its tokens then (all read again, as a prompt, to resume)
    preempted: list[tuple[str, int]] = []
    preempt = Scheduler._preempt_request

    def counting_preempt(self, request, *args, **kwargs):
        preempted.append((request.request_id, int(request.num_tokens)))
        return preempt(self, request, *args, **kwargs)

    Scheduler._preempt_request = counting_preempt
    # forwards with a cut decode beside a prompt chunk, with a query past the window, and the
    # plans of evicted queries those need and get (reads, no change)
    mixed = {"steps": 0, "evicted_builds": 0, "pieces": 0, "plans": 0}
    if req["n_sink"] is not None:
        from sinklab_vllm.backend import SinkCPUAttentionMetadataBuilder

        build = SinkCPUAttentionMetadataBuilder.build
        capacity = int(req["n_sink"]) + int(req["window"])

        def counting_build(self, common_prefix_len, common, fast_build=False):
            q_lens = common.query_start_loc[1:] - common.query_start_loc[:-1]
            cut = (q_lens == 1) & (common.seq_lens > capacity + 1)
            mixed["steps"] += int(bool(cut.any()) and bool((q_lens > 1).any()))
            # queries at positions capacity + 1 .. seq_len - 1 are past the window
            evicted = int((common.seq_lens - capacity - 1).clamp(min=0).minimum(q_lens).sum())
            mixed["evicted_builds"] += int(evicted > 0)
            mixed["pieces"] += -(-evicted // backend.QUERIES_AT_ONCE)
            return build(self, common_prefix_len, common, fast_build)

        SinkCPUAttentionMetadataBuilder.build = counting_build
        import sinklab_vllm.backend as backend

        plan = backend.plan_evicted

        def counting_plan(*args, **kwargs):
            mixed["plans"] += 1
            return plan(*args, **kwargs)

        backend.plan_evicted = counting_plan
    plain = req["n_sink"] is None  # the plugin off: vLLM as it is, the test's control
    sink = None if plain else {"n_sink": int(req["n_sink"]), "window": int(req["window"])}
    llm = LLM(
        model=req["model"],
        dtype="float32",
        max_model_len=int(req.get("max_model_len", 2048)),
        block_size=int(req.get("block_size", 128)),
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
        hf_overrides=req.get("hf_overrides"),
        **(req.get("engine") or {}),
        additional_config={} if plain else {"sinklab": sink},
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=int(req["max_tokens"]),
        ignore_eos=True,
        detokenize=False,
        logprobs=0,
    )
    if req.get("score"):  # teacher-forced: each given sequence's own log-probabilities
        scored = [TokensPrompt(prompt_token_ids=list(p)) for p in req["score"]]
        one = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = llm.generate(scored, one, use_tqdm=False)
        print("SINKLAB-RESULT " + json.dumps({"scores": [_scored(o) for o in outs]}), flush=True)
        return
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    spec = seen.get("spec")
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [_chosen(o.outputs[0]) for o in outs],
        "max_blocks": [_held_by(held, o.request_id) for o in outs],
        "spec": type(spec).__name__,
        "bound": spec.max_blocks() if hasattr(spec, "max_blocks") else None,
        # what the scheduler reserves to admit a request, and the in-flight tokens it allows for
        "admission": getattr(seen.get("manager"), "max_admission_blocks_per_request", None),
        "in_flight": getattr(spec, "max_in_flight_tokens", None),
        "engine_in_flight": llm.llm_engine.vllm_config.max_in_flight_tokens,
        "seconds": seconds,
        "mixed_steps": mixed["steps"],
        "evicted_builds": mixed["evicted_builds"],
        "pieces": mixed["pieces"],
        "plans": mixed["plans"],
        "preempted": [sum(_is(rid, o.request_id) for rid, _ in preempted) for o in outs],
        "preempted_at": [
            max([n for rid, n in preempted if _is(rid, o.request_id)], default=0) for o in outs
        ],
    }
    print("SINKLAB-RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
