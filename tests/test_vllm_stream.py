"""The sinklab-vllm plugin wired into a running vLLM engine, against sinklab's own
``SinkCache`` (docs/vllm.md#wiring-tests): greedy tokens and every step's log-probability over
1,000 tokens past the first eviction (SmolLM2, two requests in one batch; Qwen2.5 in
tests/test_vllm_stream_qwen.py), the KV blocks each request holds, plain vLLM as the control, a
prompt longer than the cache, the rebase, and vLLM's OpenAI server with the ``openai`` client.
Apart from tests/test_vllm.py so that xdist (one file a worker) spreads them. vLLM runs in its
own venv (``tests/vllm_env/stream.py``); the shared check is tests/vllm_helpers.py."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from vllm_helpers import (
    LOGPROB_TOL,
    first_difference,
    logprob_gaps,
    sinklab_along,
    stream_check,
    stream_run,
    vllm_env,
)

pytestmark = pytest.mark.vllm


@pytest.mark.integration
def test_the_plugin_streams_exactly_as_sinklab_on_smollm2(vllm_py, smollm2):
    stream_check(vllm_py, smollm2, n_sink=4, window=252, block_size=128, together=True)


@pytest.mark.integration
def test_the_plugin_reads_a_long_prompt_as_sinklab_reads_it_token_by_token(vllm_py, smollm2):
    """A prompt three times the cache: the plugin attends each prompt token past the window as a
    decode query (sinks + the ``window`` before it, all of a chunk's such queries batched), which
    is ``generate`` reading the prompt one token a forward (``prefill_chunk=1``): sinklab's
    token-by-token reading chooses every greedy token and gives every step's log-probability
    within ``LOGPROB_TOL``; with sinklab's default prompt
    reading (pieces fitted into the cache, docs/vllm.md#wiring) the numbers differ, which the
    test shows too, so it can tell the two apart."""
    from sinklab.corpus import load_text, token_stream
    from sinklab.stream.generation import GenerateConfig, generate

    n_sink, window, new = 4, 124, 48
    prompt = token_stream(load_text(), smollm2.tokenizer, 400).tolist()[:384]
    ours = stream_run(vllm_py, smollm2, [prompt], new, n_sink, window)

    tokens, logprobs = ours["tokens"][0], ours["logprobs"][0]
    where, gaps = sinklab_along(smollm2, prompt, tokens, n_sink, window).check(tokens, logprobs)
    first: list[Tensor] = []  # sinklab's default prompt reading, for the first token
    cfg = GenerateConfig(max_new_tokens=1, n_sink=n_sink, window=window, stop_at_eos=False)
    generate(
        smollm2.model, smollm2.tokenizer, torch.tensor(prompt), cfg,
        on_logits=lambda x: first.append(x.double().log_softmax(-1)),
    )  # fmt: skip
    chunked_gap = max(logprob_gaps(logprobs[:1], first, tokens[:1]))
    print(
        f"long prompt {len(prompt)} ({n_sink}+{window}): token-by-token sinklab chooses the "
        f"plugin's token on {where}/{new} steps, log-probabilities within {max(gaps):.1e}; "
        f"sinklab's default prompt reading differs by {chunked_gap:.1e} at the first token"
    )
    assert where == new, f"sinklab chooses differently from step {where}"
    assert max(gaps) < LOGPROB_TOL, max(gaps)
    assert chunked_gap > 10 * LOGPROB_TOL, chunked_gap


@pytest.mark.integration
def test_the_plugin_rebases_positions_past_the_models_table_exactly(vllm_py, smollm2):
    """The rebase: SmolLM2 told it has 192 positions (``hf_overrides``; its RoPE table then ends
    there) streams 600 tokens with 4 + 60 kept, so RoPE positions wrap back to 64 four times
    (docs/vllm.md#positions). Tokens and every step's log-probability are still sinklab's
    (whose cache positions never pass n_sink + window). Without the rebase a position past 192
    would index past vLLM's table."""
    from sinklab.corpus import load_text, token_stream

    n_sink, window, new, table = 4, 60, 600, 192
    prompt = token_stream(load_text(), smollm2.tokenizer, 100).tolist()[:37]
    ours = stream_run(
        vllm_py,
        smollm2,
        [prompt],
        new,
        n_sink,
        window,
        max_model_len=2048,
        hf_overrides={"max_position_embeddings": table},
        env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
    )
    tokens = ours["tokens"][0]
    wraps = (len(prompt) + new - table) // (table - n_sink - window) + 1
    ref = sinklab_along(smollm2, prompt, tokens, n_sink, window)
    where, gaps = ref.check(tokens, ours["logprobs"][0])
    print(
        f"rebase ({table} positions, {wraps} wraps): sinklab chooses the plugin's token on "
        f"{where}/{new} steps, log-probabilities within {max(gaps):.1e}"
    )
    assert wraps >= 4
    assert where == new, f"sinklab chooses differently from step {where}"
    assert max(gaps) < LOGPROB_TOL, max(gaps)


@pytest.mark.integration
def test_a_preempted_stream_resumes_exactly(vllm_py, smollm2):
    """Preemption: two streams (4 + 60 kept, blocks of 32: 4 blocks each once decoding) in a pool
    of 8 blocks (7 usable) cannot both grow, so vLLM preempts one, frees its blocks and, when
    blocks free up, recomputes its prompt and tokens so far as a prompt, in chunks of at most 64
    tokens; those past position 64 take the plugin's path, which attends each over its sinks and
    window, as its decode step had, so the resumed stream goes on as sinklab's: every token and
    every step's log-probability, for both requests (docs/vllm.md#wiring)."""
    from sinklab.corpus import load_text, token_stream

    n_sink, window, new = 4, 60, 200
    ids = token_stream(load_text(), smollm2.tokenizer, 300).tolist()
    prompts = [ids[:37], ids[100:140]]  # both fit the cache: read at once, as generate does
    ours = stream_run(
        vllm_py,
        smollm2,
        prompts,
        new,
        n_sink,
        window,
        engine={"num_gpu_blocks_override": 8, "max_num_batched_tokens": 64, "max_num_seqs": 2},
    )
    assert sum(ours["preempted"]) > 0, f"no request was preempted: {ours['preempted']}"
    # a resume re-read tokens past the window: the plugin's path, not only vLLM's kernel
    assert max(ours["preempted_at"]) > n_sink + window + 1, ours["preempted_at"]
    rows = zip(prompts, ours["tokens"], ours["logprobs"], ours["preempted"], ours["preempted_at"],
               strict=True)  # fmt: skip
    for prompt, tokens, logprobs, times, at in rows:
        where, gaps = sinklab_along(smollm2, prompt, tokens, n_sink, window).check(tokens, logprobs)
        print(
            f"preempted {times}x (at most at {at} tokens), prompt {len(prompt)}: sinklab chooses "
            f"the plugin's token on "
            f"{where}/{new} steps, log-probabilities within {max(gaps):.1e}"
        )
        assert where == new, f"sinklab chooses differently from step {where}"
        assert max(gaps) < LOGPROB_TOL, max(gaps)


@pytest.mark.integration
def test_the_plugin_reads_prompt_chunks_past_the_window_beside_decodes(vllm_py, smollm2):
    """Chunked prefill at its hardest for the plugin (the reviewer's case): 4 + 28 kept, blocks of
    32, at most 32 tokens a step, so a 900-token prompt is read in chunks that start past the
    window (their blocks partly freed) while an 8-token request decodes past the window in the
    same batch (its kernel length cut to 1). Both are what sinklab's token-by-token reading
    chooses, in tokens and log-probabilities; the short one also equals ``generate`` itself
    (72 forwards: the direct check beside the teacher-forced ones, docs/vllm.md#wiring-tests)."""
    from sinklab.corpus import load_text, token_stream
    from sinklab.stream.generation import GenerateConfig, generate

    n_sink, window, new = 4, 28, 64
    ids = token_stream(load_text(), smollm2.tokenizer, 1100).tolist()
    # 31 prompt tokens a step beside the short request's decode: the long prompt is still being
    # read (about 29 steps) when the short request passes the window (after 25 decode steps)
    prompts = [ids[:8], ids[100:1000]]
    ours = stream_run(
        vllm_py,
        smollm2,
        prompts,
        new,
        n_sink,
        window,
        engine={"max_num_batched_tokens": 32, "max_num_seqs": 2},
    )
    assert ours["mixed_steps"] > 0, "no forward had a decode past the window beside a chunk"
    assert ours["evicted_builds"] > 0 and ours["plans"] == ours["pieces"], ours  # once a forward
    print(f"forwards with a cut decode beside a prompt chunk: {ours['mixed_steps']}")
    for prompt, tokens, logprobs in zip(prompts, ours["tokens"], ours["logprobs"], strict=True):
        where, gaps = sinklab_along(smollm2, prompt, tokens, n_sink, window).check(tokens, logprobs)
        print(
            f"chunks past the window, prompt {len(prompt)} ({n_sink}+{window}, 32 tokens a step): "
            f"token-by-token sinklab chooses the plugin's token on {where}/{new} steps, "
            f"log-probabilities within {max(gaps):.1e}"
        )
        assert where == new, f"sinklab chooses differently from step {where}"
        assert max(gaps) < LOGPROB_TOL, max(gaps)
    steps: list[Tensor] = []
    cfg = GenerateConfig(
        max_new_tokens=new, n_sink=n_sink, window=window, stop_at_eos=False, prefill_chunk=1
    )
    ref = generate(
        smollm2.model, smollm2.tokenizer, torch.tensor(prompts[0]), cfg,
        on_logits=lambda x: steps.append(x.double().log_softmax(-1)),
    ).new_tokens  # fmt: skip
    where = first_difference(ours["tokens"][0], ref)
    gaps = logprob_gaps(ours["logprobs"][0], steps, ours["tokens"][0])
    print(f"prompt 8, generate itself: equal on {where}/{new} tokens, within {max(gaps):.1e}")
    assert ours["tokens"][0] == ref, f"tokens differ from {where}"
    assert max(gaps) < LOGPROB_TOL, max(gaps)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
def test_vllm_serve_with_the_plugin_answers_the_openai_client_as_sinklab_streams(
    vllm_py, smollm2, tmp_path
):
    """vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs;
    its API server, engine core and worker in separate processes, each loading the plugin) with
    ``--additional-config '{"sinklab": ...}'``: the official ``openai`` client's greedy
    completion of a token-id prompt, 300 tokens, is sinklab's choice with the same sinks and
    window at every step (vLLM's ``return_tokens_as_token_ids``), log-probabilities within
    ``LOGPROB_TOL``, well past the first eviction (4 + 60: from the 30th new token on)."""
    import subprocess
    import time

    import openai

    from sinklab.corpus import load_text, token_stream
    from sinklab.models.zoo import ZOO, dequantized_dir

    n_sink, window, new = 4, 60, 300
    folder = dequantized_dir(ZOO[smollm2.info.name], smollm2.info.weights_sha256)
    prompt = token_stream(load_text(), smollm2.tokenizer, 100).tolist()[:37]
    port = _free_port()
    env = vllm_env() | {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    options = f'{{"sinklab": {{"n_sink": {n_sink}, "window": {window}}}}}'
    cmd = [
        # vllm-cpu 0.32's `vllm` script looks up the metadata of a package named "vllm" and
        # fails; the server's module is the same server
        str(vllm_py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--port", str(port),
        "--host", "127.0.0.1", "--served-model-name", "smollm2", "--dtype", "float32",
        "--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "1024",
        "--additional-config", options,
    ]  # fmt: skip
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "vllm serve did not start in 600 s"
                time.sleep(2)
        reply = client.completions.create(
            model="smollm2",
            prompt=prompt,
            max_tokens=new,
            temperature=0.0,
            logprobs=1,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    lp = reply.choices[0].logprobs
    tokens = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert len(tokens) == new
    along = sinklab_along(smollm2, prompt, tokens, n_sink, window)
    where, gaps = along.check(tokens, list(lp.token_logprobs))
    print(
        f"vllm serve + plugin ({n_sink}+{window}), openai client: sinklab chooses its token on "
        f"{where}/{new} steps, log-probabilities within {max(gaps):.1e}"
    )
    assert where == new, f"sinklab chooses differently from step {where}"
    assert max(gaps) < LOGPROB_TOL, max(gaps)
