"""What the vLLM test files share: the side venv's interpreter (a fixture that fails, saying how
to build it, or skips only under SINKLAB_SKIP_VLLM=1) and running one script of
``tests/vllm_env/`` in it (docs/vllm.md#venv)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor

from helpers import await_side_venvs

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_ENV = Path(__file__).resolve().parent / "vllm_env"


@pytest.fixture
def vllm_py() -> Path:
    """The venv's interpreter, or a skip only when SINKLAB_SKIP_VLLM=1 asks for one. Requested
    first by each test, so a skip or a failure comes before any model is loaded."""
    if os.environ.get("SINKLAB_SKIP_VLLM") == "1":
        pytest.skip("SINKLAB_SKIP_VLLM=1: the vLLM tests were asked to be skipped")
    await_side_venvs()  # make test builds the venv while the suite runs
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"no {VLLM_PYTHON}: run `make vllm-venv` (or SINKLAB_SKIP_VLLM=1 to skip)")
    return VLLM_PYTHON


def vllm_env() -> dict[str, str]:
    """The environment a vLLM process of the tests starts with: this one without its Python
    settings and, under xdist, this worker's share of the cores: ``OMP_NUM_THREADS`` = cores //
    workers (at least 1; tests/conftest.py gives each worker's torch about as many threads),
    bound to this worker's own cores. Left alone, vLLM's engine (in-process here) runs a team of
    as many OpenMP threads as cores; two workers' engines then put four spinning threads on two
    cores, and a run that takes 3 minutes alone passed 15 (measured 2026-12-05: both long
    exactness runs timed out at 900 s)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if worker.startswith("gw") and workers > 1:
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // workers)
        start = (int(worker[2:]) * share) % len(cores)
        mine = [cores[(start + i) % len(cores)] for i in range(share)]
        env["OMP_NUM_THREADS"] = str(share)
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in mine)
    return env


def run_json(python: Path, script: Path, request: object) -> object:
    """Run ``script`` in vLLM's venv on ``request`` (JSON on stdin); its ``SINKLAB-RESULT`` line."""
    env = vllm_env()
    proc = subprocess.run(
        [str(python), str(script)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SINKLAB-RESULT ")]
    assert len(lines) == 1, proc.stdout[-2000:]
    return json.loads(lines[0].removeprefix("SINKLAB-RESULT "))


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where two token lists differ, or the shorter length."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


STREAM = VLLM_ENV / "stream.py"


def stream_run(
    python: Path,
    loaded,
    prompts: list[list[int]],
    max_tokens: int,
    n_sink: int | None,
    window: int | None,
    *,
    block_size: int = 32,
    max_model_len: int = 1024,
    **extra: object,
) -> dict:
    """``tests/vllm_env/stream.py`` on ``loaded``'s cached float32 folder: the plugin with
    ``n_sink`` + ``window`` (``None``: off), greedy, ``max_tokens`` new tokens for each prompt
    in one batch; ``extra`` are the script's other fields (``engine``, ``env``, ``score``...)."""
    from sinklab.models.zoo import ZOO, dequantized_dir

    folder = dequantized_dir(ZOO[loaded.info.name], loaded.info.weights_sha256)
    request = {"model": str(folder), "prompts": prompts, "max_tokens": max_tokens,
               "n_sink": n_sink, "window": window, "block_size": block_size,
               "max_model_len": max_model_len, **extra}  # fmt: skip
    return run_json(python, STREAM, request)


def logprob_gaps(logprobs: list[float], steps: list[Tensor], tokens: list[int]) -> list[float]:
    """Per step, |vLLM's log-probability of the chosen token - sinklab's|."""
    return [abs(lp - float(st[tok])) for lp, st, tok in zip(logprobs, steps, tokens, strict=True)]


@dataclass(frozen=True)
class Along:
    """sinklab's StreamingLLM reading of another engine's stream (:func:`sinklab_along`): per new
    token k, sinklab's greedy choice given the prompt and the engine's tokens before k, and
    sinklab's log-probability of the engine's token k."""

    choices: list[int]
    logprobs: list[float]
    margins: list[float]  # per step, sinklab's top-two log-probability gap

    def check(self, tokens: list[int], logprobs: list[float]) -> tuple[int, list[float]]:
        """(how many leading steps sinklab chooses as the engine did, per step |the engine's
        log-probability - sinklab's|)."""
        gaps = [abs(a - b) for a, b in zip(logprobs, self.logprobs, strict=True)]
        return first_difference(tokens, self.choices), gaps


def sinklab_along(loaded, prompt: list[int], tokens: list[int], n_sink: int, window: int) -> Along:
    """sinklab's sink cache (``n_sink`` + ``window``) read teacher-forced along ``prompt +
    tokens`` by the band evaluator (``chunked_nll``'s ``on_logits``; pinned equal to the
    ``SinkCache`` step loop ``generate`` decodes with, tests/test_chunked.py), every token a
    streaming query. Where every choice equals the engine's token, ``generate(prefill_chunk=1)``
    from ``prompt`` produces exactly ``tokens``: by induction, each of its steps sees the prefix
    the engine saw (for a prompt that fits the cache, ``generate``'s default reading is the same
    attention). One forward per 256 tokens instead of one per token: what keeps the vLLM tests'
    references cheap (docs/vllm.md#wiring-tests)."""
    from sinklab.stream.band import chunked_nll
    from sinklab.stream.cache import CacheConfig

    ids = torch.tensor(list(prompt) + list(tokens))
    start = len(prompt) - 1  # the query whose next token is new token 0
    choices = [-1] * len(tokens)
    chosen = [0.0] * len(tokens)
    margins = [0.0] * len(tokens)

    def record(t0: int, logits: Tensor) -> None:
        for i, row in enumerate(logits):
            k = t0 + i - start
            if 0 <= k < len(tokens):
                lp = row.double().log_softmax(-1)
                top = lp.topk(2).values
                choices[k], chosen[k] = int(lp.argmax()), float(lp[tokens[k]])
                margins[k] = float(top[0] - top[1])

    chunked_nll(loaded.model, ids, CacheConfig("sink", n_sink, window), on_logits=record)
    assert -1 not in choices, "a step was not read"
    return Along(choices, chosen, margins)


PAST_EVICTION = 1000  # greedy tokens compared after the first eviction (issue 32)
CONTROL_STEPS = 256  # tokens past the first eviction that plain vLLM scores (the control)
LOGPROB_TOL = 1e-3  # per step, the chosen token's log-probability, vLLM vs SinkCache (float32)


def stream_check(
    python: Path, loaded, n_sink: int, window: int, block_size: int, together: bool
) -> None:
    """vLLM with the plugin on equals sinklab's sink cache (the same ``n_sink`` and ``window``),
    greedy, token for token, for at least ``PAST_EVICTION`` tokens past the first eviction
    (``together``: two requests of different lengths in one batch, else one alone): at every
    step sinklab, read along vLLM's stream (:func:`sinklab_along`), chooses vLLM's token and
    gives it a log-probability within ``LOGPROB_TOL`` of vLLM's; each request's real KV blocks
    reach the plugin's bound and never pass it; and plain vLLM (full attention), scoring the
    same tokens, equals sinklab's log-probabilities before the first eviction and leaves them
    after, so the check tells the eviction apart from full attention even where the greedy text
    repeats a phrase (docs/vllm.md#wiring-tests)."""
    from sinklab.corpus import load_text, token_stream
    from sinklab.models.zoo import ZOO, dequantized_dir

    folder = dequantized_dir(ZOO[loaded.info.name], loaded.info.weights_sha256)
    ids = token_stream(load_text(), loaded.tokenizer, 400).tolist()
    # both prompts fit before any eviction: sinklab's generate reads a prompt at once, vLLM's
    # queries see everything before them, the same attention (docs/vllm.md#wiring says what
    # longer ones do)
    prompts = [ids[:37], ids[: n_sink + window - 8]] if together else [ids[:37]]
    capacity = n_sink + window
    new = capacity + 2 - len(prompts[0]) + PAST_EVICTION  # see first_evicted below
    request = {
        "model": str(folder),
        "prompts": prompts,
        "max_tokens": new,
        "n_sink": n_sink,
        "window": window,
        "block_size": block_size,
        "max_model_len": 2048,
    }
    ours = run_json(python, STREAM, request)
    assert ours["spec"] == "SinkWindowSpec", ours["spec"]
    # the control: plain vLLM (full attention) scores the stream's own tokens, teacher-forced,
    # up to just past the first eviction of the shortest prompt
    end = capacity + 2 + CONTROL_STEPS
    scored = [p + v[: end - len(p)] for p, v in zip(prompts, ours["tokens"], strict=True)]
    plain = run_json(python, STREAM, request | {"n_sink": None, "window": None, "score": scored})
    rows = zip(prompts, ours["tokens"], ours["logprobs"], plain["scores"], strict=True)
    for prompt, v, v_logprobs, full_scores in rows:
        # new token k is the query at position len(prompt) + k - 1: past the window from here
        first_evicted = capacity + 2 - len(prompt)
        assert len(v) == new and new - first_evicted >= PAST_EVICTION
        ref = sinklab_along(loaded, prompt, v, n_sink, window)
        where, gaps = ref.check(v, v_logprobs)
        worst = max(range(new), key=gaps.__getitem__)
        # new token k sits at position len(prompt) + k of the scored sequence
        full = [
            abs(lp - ref_lp)
            for lp, ref_lp in zip(full_scores[len(prompt) :], ref.logprobs, strict=False)
        ]
        before, after = max(full[:first_evicted]), max(full[first_evicted:])
        print(
            f"{loaded.info.name} {n_sink}+{window} B={block_size}, prompt {len(prompt)}: sinklab "
            f"chooses the plugin's token on {where}/{new} steps ({new - first_evicted} past "
            f"eviction), log-probabilities within {gaps[worst]:.1e} (token {worst}), smallest "
            f"top-two margin {min(ref.margins):.1e}; plain vLLM on the same tokens: within "
            f"{before:.1e} before eviction, {after:.1e} after"
        )
        assert where == new, (
            f"sinklab chooses {ref.choices[where]} where the plugin chose {v[where]} (step {where})"
        )
        # every step's numbers, not only its argmax (a repeating phrase would hide small errors)
        assert gaps[worst] < LOGPROB_TOL, (worst, gaps[worst])
        assert before < LOGPROB_TOL, before  # full attention is the stream until it evicts
        # and is not once it has: LOGPROB_TOL would have caught full attention in place of the
        # eviction (measured 3.6e-2 on SmolLM2, 2.3e-3 on Qwen2.5 over the first 64 steps)
        assert after > LOGPROB_TOL, after
    bound = ours["bound"]
    assert bound == -(-n_sink // block_size) + -(-(window + 1) // block_size) + 1
    # admitted on what it can hold with the engine's in-flight tokens, not on its whole length
    flight = ours["in_flight"]
    assert flight == ours["engine_in_flight"] and flight, (flight, ours["engine_in_flight"])
    reading = -(-n_sink // block_size) + -(-(window + flight) // block_size) + 1
    assert ours["admission"] == max(bound, reading), (ours["admission"], flight)
    assert ours["max_blocks"] == [bound] * len(prompts), (ours["max_blocks"], bound)
    # the evicted queries' slots and rotations are planned once a forward, not once a layer
    assert ours["evicted_builds"] > 0 and ours["plans"] == ours["pieces"], ours
