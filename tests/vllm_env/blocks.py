"""Drive sinklab-vllm's ``SinkWindowManager`` on vLLM's own ``BlockPool`` the way vLLM's
scheduler does for each step (free what fell out, then allocate the new slots), for several
concurrent requests of different lengths; no engine, no model. Run inside .venv-vllm
(docs/vllm.md#blocks).

Reads a list of runs ``[{"n_sink", "window", "block_size", "pool_blocks", "requests":
[{"prompt": L, "steps": S}, ...], "chunk": C, "long": N}, ...]`` on stdin. Each request reads
its prompt in one step, then decodes one token a step; all run in lockstep until each has done
its steps. Then a request of ``N`` tokens is admitted as vLLM's full-sequence gate admits one
(``apply_admission_cap``) and reads its tokens in chunks of ``C`` (chunked prefill, or a
preempted stream coming back). Writes ``SINKLAB-RESULT [{...}, ...]``, one per run: for each
request and step, the query position ``t`` and the logical block indices it holds (not null);
the pool's blocks in use after each step, and after every request is freed; the long request's
reservation and the most blocks it held."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def run(req: dict) -> dict:
    """One run: the blocks each request holds at each step, and the pool's use."""
    import torch
    from sinklab_vllm.blocks import SinkWindowManager, SinkWindowSpec
    from vllm.v1.core.block_pool import BlockPool

    bs = int(req["block_size"])
    spec = SinkWindowSpec(
        block_size=bs,
        num_kv_heads=3,
        head_size=64,
        dtype=torch.float32,
        n_sink=int(req["n_sink"]),
        window=int(req["window"]),
        max_in_flight_tokens=int(req.get("chunk", 0)),
    )
    pool = BlockPool(
        num_gpu_blocks=int(req["pool_blocks"]), enable_caching=False, hash_block_size=bs
    )
    manager = SinkWindowManager(
        kv_cache_spec=spec,
        block_pool=pool,
        enable_caching=False,
        kv_cache_group_id=0,
        scheduler_block_size=bs,
    )
    total = pool.get_num_free_blocks()
    computed = {f"r{i}": 0 for i in range(len(req["requests"]))}
    todo = {f"r{i}": r["prompt"] + r["steps"] for i, r in enumerate(req["requests"])}
    first = {f"r{i}": r["prompt"] for i, r in enumerate(req["requests"])}
    held: dict[str, list] = {rid: [] for rid in computed}
    in_use = []
    while any(computed[rid] < todo[rid] for rid in computed):
        for rid in computed:
            t = computed[rid]
            if t >= todo[rid]:
                continue
            new = first[rid] if t == 0 else 1  # the prompt in one step, then one token a step
            manager.remove_skipped_blocks(rid, t)
            need = manager.get_num_blocks_to_allocate(
                request_id=rid,
                num_tokens=t + new,
                new_computed_blocks=[],
                total_computed_tokens=t,
                num_local_computed_tokens=0,
                num_tokens_main_model=t + new,
            )
            assert need <= pool.get_num_free_blocks(), (rid, t, need)
            manager.allocate_new_blocks(rid, t + new, t + new)
            blocks = manager.req_to_blocks[rid]
            real = [i for i, b in enumerate(blocks) if b is not pool.null_block]
            held[rid].append({"t": t + new - 1, "blocks": real, "table": len(blocks)})
            computed[rid] = t + new
        in_use.append(total - pool.get_num_free_blocks())
    for rid in computed:
        manager.free(rid)
    after_free = total - pool.get_num_free_blocks()
    admission = None
    if req.get("long"):
        long, chunk = int(req["long"]), int(req["chunk"])
        # a pool of exactly the admission bound, and a manager of its own
        own = BlockPool(
            num_gpu_blocks=spec.admission_blocks() + 1, enable_caching=False, hash_block_size=bs
        )  # one more than the bound: vLLM keeps a null block
        long_manager = SinkWindowManager(kv_cache_spec=spec, block_pool=own, enable_caching=False,
                                    kv_cache_group_id=0, scheduler_block_size=bs)  # fmt: skip
        reserved = long_manager.get_num_blocks_to_allocate(
            request_id="long",
            num_tokens=long,
            new_computed_blocks=[],
            total_computed_tokens=0,
            num_local_computed_tokens=0,
            num_tokens_main_model=long,
            apply_admission_cap=True,
        )
        assert reserved <= own.get_num_free_blocks(), (reserved, own.get_num_free_blocks())
        t, most = 0, 0
        while t < long:  # one chunk a step: free what fell out, then the chunk's slots
            new = min(chunk, long - t)
            long_manager.remove_skipped_blocks("long", t)
            need = long_manager.get_num_blocks_to_allocate(
                request_id="long",
                num_tokens=t + new,
                new_computed_blocks=[],
                total_computed_tokens=t,
                num_local_computed_tokens=0,
                num_tokens_main_model=t + new,
            )
            assert need <= own.get_num_free_blocks(), ("long", t, need)  # the pool suffices
            long_manager.allocate_new_blocks("long", t + new, t + new)
            real = sum(b is not own.null_block for b in long_manager.req_to_blocks["long"])
            most, t = max(most, real), t + new
        long_manager.free("long")
        bound = spec.admission_blocks()
        admission = {"reserved": reserved, "most_held": most, "bound": bound,
                     "free_after": own.get_num_free_blocks(), "pool": bound}  # fmt: skip
    return {
        "max_blocks": spec.max_blocks(),
        "held": held,
        "in_use": in_use,
        "in_use_after_free": after_free,
        "admission": admission,
        "in_use_at_end": total - pool.get_num_free_blocks(),
    }


def main() -> None:
    runs = [run(req) for req in json.loads(sys.stdin.read())]
    print("SINKLAB-RESULT " + json.dumps(runs), flush=True)


if __name__ == "__main__":
    main()
