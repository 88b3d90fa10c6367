"""lm-evaluation-harness against ``sinklab serve`` (issue 29, item 3): ``lm_eval --model
local-completions`` scores a small multiple-choice task (JSONL and a task YAML this test writes)
through ``POST /v1/completions`` on the real SmolLM2, and its accuracy and every per-choice
loglikelihood equal the same task scored here by a plain transformers forward.

``lm-eval`` lives in its own venv (it pins packages the project's venv must not take):
``make lmeval-venv`` builds ``.venv-lmeval`` (``SINKLAB_LMEVAL_VENV`` names another). Without it
this test fails saying so; ``SINKLAB_SKIP_LMEVAL=1`` skips it explicitly.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import await_side_venvs
from serving import Served

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
N_SINK, WINDOW = 4, 252  # every prompt here fits: nothing is evicted, a plain forward is exact

# (question, choices, answer): simple continuations the model partly knows
ITEMS = [
    *[(f"{a}, {a + 1}, {a + 2}, {a + 3},", [f" {a + 4}", f" {a + 7}", f" {a - 2}"], 0)
      for a in range(1, 11)],
    *[(f"{c}, {chr(ord(c) + 1)}, {chr(ord(c) + 2)},", [f" {chr(ord(c) + 5)}",
       f" {chr(ord(c) + 3)}"], 1) for c in "abcdefghij"],
    ("The capital of France is", [" Paris", " London", " Madrid"], 0),
    ("The capital of Italy is", [" Berlin", " Rome", " Paris"], 1),
    ("The opposite of hot is", [" cold", " warm", " blue"], 0),
    ("The opposite of up is", [" left", " down", " green"], 1),
    ("Monday, Tuesday, Wednesday,", [" Thursday", " Sunday", " March"], 0),
    ("January, February, March,", [" June", " April", " Friday"], 1),
    ("One, two, three,", [" four", " nine", " seven"], 0),
    ("Red, orange, yellow,", [" purple", " green", " black"], 1),
    ("The sun rises in the", [" east", " west", " sea"], 0),
    ("Water freezes at zero degrees", [" Fahrenheit", " Celsius", " Kelvin"], 1),
]  # fmt: skip


def _venv() -> Path:
    return Path(os.environ.get("SINKLAB_LMEVAL_VENV", ROOT / ".venv-lmeval"))


@pytest.fixture(scope="module")
def lm_eval_bin() -> Path:
    if os.environ.get("SINKLAB_SKIP_LMEVAL") == "1":
        pytest.skip("SINKLAB_SKIP_LMEVAL=1: the lm-evaluation-harness test is skipped on request")
    await_side_venvs()  # make test builds the venv while the suite runs
    exe = _venv() / "bin" / "lm_eval"
    if not exe.exists():
        pytest.fail(
            f"lm-eval is not installed at {exe}: build its venv with `make lmeval-venv` (or set "
            "SINKLAB_LMEVAL_VENV to one, or SINKLAB_SKIP_LMEVAL=1 to skip this test on purpose)"
        )
    return exe


@pytest.fixture(scope="module")
def server():
    served = Served("--n-sink", str(N_SINK), "--window", str(WINDOW), "--max-tokens", "16")
    yield served
    served.stop()


def _task(folder: Path) -> None:
    data = folder / "items.jsonl"
    data.write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS)
    )
    (folder / "sinklab_mc.yaml").write_text(
        "task: sinklab_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n"
    )


def _direct(smollm2) -> tuple[float, list[list[float]]]:
    """The task scored by a plain forward: each choice's loglikelihood given its question (the
    continuation's tokens as lm-eval splits them: the whole, less the context's), argmax. All
    choices in one right-padded batch (a causal model's real rows do not see the padding)."""
    tok, model = smollm2.tokenizer, smollm2.model
    pairs = [(len(tok(q, add_special_tokens=False).input_ids),
              tok(q + c, add_special_tokens=False).input_ids)
             for q, choices, _ in ITEMS for c in choices]  # fmt: skip
    width = max(len(w) for _, w in pairs)
    x = torch.zeros(len(pairs), width, dtype=torch.long)
    mask = torch.zeros(len(pairs), width, dtype=torch.long)
    for b, (_, whole) in enumerate(pairs):
        x[b, : len(whole)], mask[b, : len(whole)] = torch.tensor(whole), 1
    with torch.inference_mode():
        logp = torch.log_softmax(model(x, attention_mask=mask).logits.double(), -1)
    flat = [sum(float(logp[b, i - 1, whole[i]]) for i in range(ctx, len(whole)))
            for b, (ctx, whole) in enumerate(pairs)]  # fmt: skip
    lls, right, at = [], 0, 0
    for _, choices, answer in ITEMS:
        row, at = flat[at : at + len(choices)], at + len(choices)
        lls.append(row)
        right += int(max(range(len(row)), key=row.__getitem__) == answer)
    return right / len(ITEMS), lls


def test_lm_eval_local_completions_scores_as_a_plain_forward(
    lm_eval_bin, server, smollm2, tmp_path
):
    _task(tmp_path)
    tok_dir = tmp_path / "tokenizer"
    smollm2.tokenizer.save_pretrained(tok_dir)
    args = ",".join(
        [
            "model=smollm2-135m",
            f"base_url={server.base}/completions",
            f"tokenizer={tok_dir}",
            "tokenizer_backend=huggingface",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}  # fmt: skip
    run = subprocess.run(
        [str(lm_eval_bin), "--model", "local-completions", "--model_args", args,
         "--tasks", "sinklab_mc", "--include_path", str(tmp_path), "--output_path", str(out),
         "--log_samples", "--batch_size", "4"],  # 4 token-id prompts a request
        capture_output=True, text=True, timeout=900, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = next(out.rglob("results_*.json"))
    acc = json.loads(results.read_text())["results"]["sinklab_mc"]["acc,none"]
    want_acc, want_lls = _direct(smollm2)
    samples = [json.loads(line) for f in out.rglob("samples_sinklab_mc_*.jsonl")
               for line in f.read_text().splitlines()]  # fmt: skip
    assert len(samples) == len(ITEMS)
    for s in samples:
        got = [float(r[0][0]) for r in s["resps"]]  # the samples file holds them as text
        assert got == pytest.approx(want_lls[s["doc_id"]], abs=1e-3), s["doc_id"]
    assert acc == pytest.approx(want_acc, abs=1e-9)
    assert acc > 0.3  # the model knows some of it (chance is about 0.4)
    assert "Traceback" not in server.log
