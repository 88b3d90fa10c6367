"""What the vLLM test files share: the side venv's interpreter (a fixture that fails, saying how
to build it, or skips only under SINKLAB_SKIP_VLLM=1) and running one script of
``tests/vllm_env/`` in it (docs/vllm.md#venv)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

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
