"""What the vLLM test files share: the side venv's interpreter (a fixture that fails, saying how
to build it, or skips only under SINKLAB_SKIP_VLLM=1) and running one script of
``tests/vllm_env/`` in it (docs/vllm.md#venv)."""

from __future__ import annotations

import json
import os
import subprocess
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


def run_json(python: Path, script: Path, request: object) -> object:
    """Run ``script`` in vLLM's venv on ``request`` (JSON on stdin); its ``SINKLAB-RESULT`` line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
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


def logprob_gaps(logprobs: list[float], steps: list[Tensor], tokens: list[int]) -> list[float]:
    """Per step, |vLLM's log-probability of the chosen token - sinklab's|."""
    return [abs(lp - float(st[tok])) for lp, st, tok in zip(logprobs, steps, tokens, strict=True)]


PAST_EVICTION = 1000  # greedy tokens compared after the first eviction (issue 32)
CONTROL_STEPS = 256  # tokens past the first eviction that plain vLLM scores (the control)
LOGPROB_TOL = 1e-3  # per step, the chosen token's log-probability, vLLM vs SinkCache (float32)


def stream_check(
    python: Path, loaded, n_sink: int, window: int, block_size: int, together: bool
) -> None:
    """vLLM with the plugin on equals ``sinklab.stream.generation.generate`` (a ``SinkCache``,
    the same ``n_sink`` and ``window``), greedy, token for token, for at least
    ``PAST_EVICTION`` tokens past the first eviction (``together``: two requests of different
    lengths in one batch, else one alone), and every step's log-probability of the chosen token
    within ``LOGPROB_TOL``; each request's real KV blocks reach the plugin's bound and never pass
    it; and plain vLLM (full attention), scoring the stream's own tokens, equals its
    log-probabilities before the first eviction and leaves them after, so the check tells the
    eviction apart from full attention even where the greedy text repeats a phrase
    (docs/vllm.md#wiring-tests)."""
    from sinklab.corpus import load_text, token_stream
    from sinklab.models.zoo import ZOO, dequantized_dir
    from sinklab.stream.generation import GenerateConfig, generate

    folder = dequantized_dir(ZOO[loaded.info.name], loaded.info.weights_sha256)
    ids = token_stream(load_text(), loaded.tokenizer, 400).tolist()
    # both prompts fit before any eviction: sinklab reads a prompt at once, vLLM's queries see
    # everything before them, the same attention (docs/vllm.md#wiring says what longer ones do)
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
    cfg = GenerateConfig(max_new_tokens=new, n_sink=n_sink, window=window, stop_at_eos=False)
    refs, ref_logprobs = [], []
    for p in prompts:
        steps: list[Tensor] = []
        refs.append(
            generate(
                loaded.model,
                loaded.tokenizer,
                torch.tensor(p),
                cfg,
                on_logits=lambda x, steps=steps: steps.append(x.double().log_softmax(-1)),
            ).new_tokens
        )
        ref_logprobs.append(steps)
    # the control: plain vLLM (full attention) scores the stream's own tokens, teacher-forced,
    # up to just past the first eviction of the shortest prompt
    ends = [capacity + 2 + CONTROL_STEPS for _ in prompts]
    scored = [p + r[: end - len(p)] for p, r, end in zip(prompts, refs, ends, strict=True)]
    plain = run_json(python, STREAM, request | {"n_sink": None, "window": None, "score": scored})
    rows = zip(
        prompts, ours["tokens"], ours["logprobs"], refs, ref_logprobs, plain["scores"], strict=True
    )
    for prompt, v, v_logprobs, ref, steps, full_scores in rows:
        # new token k is the query at position len(prompt) + k - 1: past the window from here
        first_evicted = capacity + 2 - len(prompt)
        assert len(v) == len(ref) == new and new - first_evicted >= PAST_EVICTION
        where = first_difference(v, ref)
        gaps = logprob_gaps(v_logprobs, steps, v)
        worst = max(range(new), key=gaps.__getitem__)
        # new token k sits at position len(prompt) + k of the scored sequence
        full = [
            abs(lp - float(st[tok]))
            for lp, st, tok in zip(full_scores[len(prompt) :], steps, ref, strict=False)
        ]
        before, after = max(full[:first_evicted]), max(full[first_evicted:])
        print(
            f"{loaded.info.name} {n_sink}+{window} B={block_size}, prompt {len(prompt)}: plugin "
            f"equals sinklab on {where}/{new} tokens ({new - first_evicted} past eviction), "
            f"log-probabilities within {gaps[worst]:.1e} (token {worst}); plain vLLM on the "
            f"same tokens: within {before:.1e} before eviction, {after:.1e} after"
        )
        assert v == ref, (
            f"tokens differ from {where}: {v[where : where + 8]} vs {ref[where : where + 8]}"
        )
        # every step's numbers, not only its argmax (a repeating phrase would hide small errors)
        assert gaps[worst] < LOGPROB_TOL, (worst, gaps[worst])
        assert before < LOGPROB_TOL, before  # full attention is the stream until it evicts
        # and is not once it has: LOGPROB_TOL would have caught full attention in place of the
        # eviction (measured 3.6e-2 on SmolLM2, 2.3e-3 on Qwen2.5 over the first 64 steps)
        assert after > LOGPROB_TOL, after
    bound = ours["bound"]
    assert bound == -(-n_sink // block_size) + -(-(window + 1) // block_size) + 1
    assert ours["max_blocks"] == [bound] * len(prompts), (ours["max_blocks"], bound)
