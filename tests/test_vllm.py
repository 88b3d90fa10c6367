"""Plain vLLM (CPU build, its own venv ``.venv-vllm``) on sinklab's cached zoo checkpoints:
greedy tokens equal transformers' on the same prompts (docs/vllm.md#baseline).

vLLM pins transformers<5.20 and sinklab >=5.22, so vLLM never runs in this process: a script
(``tests/vllm_env/greedy.py``) runs in ``.venv-vllm`` on the same folder the loader reads. The
venv is made by ``make vllm-venv`` (``make test`` makes it when missing). Without it the test
fails, saying how to make it; only ``SINKLAB_SKIP_VLLM=1`` skips it, and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
GREEDY = Path(__file__).resolve().parent / "vllm_env" / "greedy.py"
NEW_TOKENS = 64  # the floor is 48
pytestmark = pytest.mark.vllm


@pytest.fixture
def vllm_py() -> Path:
    """The venv's interpreter, or a skip only when SINKLAB_SKIP_VLLM=1 asks for one. Requested
    first by each test, so a skip or a failure comes before any model is loaded."""
    if os.environ.get("SINKLAB_SKIP_VLLM") == "1":
        pytest.skip("SINKLAB_SKIP_VLLM=1: the vLLM tests were asked to be skipped")
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"no {VLLM_PYTHON}: run `make vllm-venv` (or SINKLAB_SKIP_VLLM=1 to skip)")
    return VLLM_PYTHON


def vllm_greedy(
    python: Path, folder: Path, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy tokens from plain vLLM in its own process and venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    request = {"model": str(folder), "prompts": prompts, "max_tokens": max_tokens}
    proc = subprocess.run(
        [str(python), str(GREEDY)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SINKLAB-RESULT ")]
    assert len(lines) == 1, proc.stdout[-2000:]
    return json.loads(lines[0].removeprefix("SINKLAB-RESULT "))["tokens"]


def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens from transformers, one prompt at a time, in sinklab's venv."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(
                ids,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
            )
        out.append(gen[0, len(prompt) :].tolist())
    return out


def _prompts(tokenizer) -> list[list[int]]:
    from sinklab.corpus import load_text, token_stream

    ids = token_stream(load_text(), tokenizer, 200).tolist()
    return [ids[:37], ids[:200]]  # two lengths in one vLLM batch


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _check(python: Path, loaded) -> None:
    from sinklab.models.zoo import ZOO, dequantized_dir

    folder = dequantized_dir(ZOO[loaded.info.name], loaded.info.weights_sha256)  # the cache
    prompts = _prompts(loaded.tokenizer)
    ours = vllm_greedy(python, folder, prompts, NEW_TOKENS)
    theirs = hf_greedy(loaded.model, prompts, NEW_TOKENS)
    for v, h in zip(ours, theirs, strict=True):
        assert len(v) == len(h) == NEW_TOKENS, (len(v), len(h))
        where = _first_difference(v, h)
        print(f"{loaded.info.name}: vLLM equals transformers on {where}/{NEW_TOKENS} tokens")
        assert v == h, f"greedy tokens differ from token {where}: {v[where:]} vs {h[where:]}"
    assert len(set(ours[1])) > 8, ours  # text, not one token over and over


@pytest.mark.integration
def test_plain_vllm_equals_transformers_on_smollm2(vllm_py, smollm2):
    _check(vllm_py, smollm2)


@pytest.mark.integration
def test_plain_vllm_equals_transformers_on_qwen25(vllm_py):
    from sinklab.models.loading import load_model

    _check(vllm_py, load_model("qwen2.5-0.5b"))


def test_the_venv_is_vllm_beside_its_own_transformers(vllm_py):
    """The separate venv is what docs/vllm.md says: vLLM's CPU build on the local torch wheel."""
    code = "import vllm, torch, transformers; print(vllm.__version__, torch.__version__)"
    proc = subprocess.run([str(vllm_py), "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["0.32.0", "2.13.0+cpu"], proc.stdout
    assert sys.executable != str(VLLM_PYTHON)
