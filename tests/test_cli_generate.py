"""``sinklab generate`` reads an instruct model's prompt through its chat template (a reply, as
``sinklab chat`` reads a turn); ``--raw`` and base models continue the text as it is. Tiny models
in process, pinned against greedy decoding by full forwards over independently built ids; the
real SmolLM2-Instruct (integration) for the reported bug ("ROMEO:" answered with "A: The answer
is:" over and over)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import assert_one_line_error, run_main

PROMPT = "the king is"
N = 6


@pytest.fixture(scope="module")
def instruct_dir(tmp_path_factory, tiny_model_factory, chat_tokenizer) -> Path:
    """A tiny random llama whose tokenizer has the tests' tiny chat template."""
    folder = tmp_path_factory.mktemp("tiny-instruct")
    tiny_model_factory("llama", seed=3).save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return folder


def _generate(capsys, tmp_path: Path, model: Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "out"
    args = ["generate", "--model", str(model), "--prompt", PROMPT, "--max-new-tokens", str(N)]
    run = run_main(capsys, *args, "--ignore-eos", "--window", "64", "--out", str(out), *extra)
    assert run.returncode == 0, run.stderr
    return json.loads((out / "generate.json").read_text()), run.stdout


@torch.no_grad()
def _greedy(folder: Path, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by full forwards over the whole sequence (no cache)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    out: list[int] = []
    for _ in range(n):
        out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def test_instruct_model_reads_the_prompt_through_its_template(
    capsys, tmp_path, instruct_dir, chat_tokenizer
):
    data, stdout = _generate(capsys, tmp_path, instruct_dir)
    rendered = chat_tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    ids = chat_tokenizer(rendered, add_special_tokens=False).input_ids
    assert rendered.endswith("<s> assistant ") and len(ids) > len(PROMPT.split())
    assert data["chat_template"] is True and data["prompt_tokens"] == len(ids)
    assert data["new_tokens"] == _greedy(instruct_dir, ids, N)
    assert stdout.strip() == data["text"].strip()


def test_raw_continues_the_text(capsys, tmp_path, instruct_dir, chat_tokenizer):
    data, _ = _generate(capsys, tmp_path, instruct_dir, "--raw")
    ids = chat_tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert data["chat_template"] is False and data["prompt_tokens"] == len(ids)
    assert data["new_tokens"] == _greedy(instruct_dir, ids, N)


def test_base_model_without_template_continues_the_text(
    capsys, tmp_path, tiny_model_dir, tiny_tokenizer
):
    """No chat template: plain text with or without --raw, the tokenizer's own first token."""
    folder = tiny_model_dir("llama")
    data, _ = _generate(capsys, tmp_path, folder)
    ids = tiny_tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert data["chat_template"] is False and data["prompt_tokens"] == len(ids)
    assert data["new_tokens"] == _greedy(folder, ids, N)
    raw, _ = _generate(capsys, tmp_path, folder, "--raw")
    assert raw["new_tokens"] == data["new_tokens"]


def test_prepend_goes_before_the_template(capsys, tmp_path, instruct_dir, chat_tokenizer):
    data, _ = _generate(capsys, tmp_path, instruct_dir, "--prepend", "eos")
    rendered = chat_tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    ids = chat_tokenizer(rendered, add_special_tokens=False).input_ids
    assert data["prompt_tokens"] == len(ids) + 1
    assert data["meta"]["first_token"]["id"] == chat_tokenizer.eos_token_id


def test_prepend_none_with_a_template_is_one_line(capsys, tmp_path, instruct_dir):
    run = run_main(
        capsys, "generate", "--model", str(instruct_dir), "--prompt", "hi", "--prepend", "none"
    )
    assert_one_line_error(run, "--raw")


@pytest.mark.integration
def test_smollm2_instruct_replies_instead_of_looping(capsys):
    """The default model is SmolLM2-135M-Instruct: "ROMEO:" continued as plain text loops on
    "A: The answer is:"; through the template it replies and stops by itself."""
    args = ("generate", "--prompt", "ROMEO:", "--max-new-tokens", "60", "--format", "json")
    chat = json.loads(run_main(capsys, *args).stdout)
    raw = json.loads(run_main(capsys, *args, "--raw").stdout)
    assert chat["chat_template"] is True and raw["chat_template"] is False
    assert raw["text"].count("A: The answer is:") >= 3  # the reported loop, without the template
    assert chat["text"].count("A: The answer is:") == 0
    assert chat["n_new_tokens"] < 60  # the reply ended at the template's end token
    question = "Name three plays by Shakespeare."
    reply = json.loads(
        run_main(capsys, "generate", "--prompt", question, "--format", "json").stdout
    )
    assert "Hamlet" in reply["text"]
