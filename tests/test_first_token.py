"""The first token is the model's own: every path that builds ids starts a sequence the way the
model's tokenizer does (``add_special_tokens=True``) unless ``--prepend`` says otherwise, and every
result's ``meta.first_token`` says what it was. On a tiny tokenizer that adds nothing and a copy
of it that puts ``<s>`` first (as Gemma's puts ``<bos>``)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import assert_one_line_error, run_main
from sinklab.corpus import first_token, load_text, token_stream, token_windows, tokenizer_prefix
from sinklab.errors import SinklabError


def test_the_default_is_what_the_tokenizer_adds(tiny_tokenizer, bos_tokenizer):
    bos, eos = bos_tokenizer.bos_token_id, bos_tokenizer.eos_token_id
    assert tokenizer_prefix(tiny_tokenizer) == () and tokenizer_prefix(bos_tokenizer) == (bos,)
    cases = {  # prepend -> (added, tokenizer_default) on the <s> tokenizer
        None: ((bos,), True),
        "default": ((bos,), True),
        "none": ((), False),
        "bos": ((bos,), True),  # asked for explicitly, and what the tokenizer does anyway
        "eos": ((eos,), False),
        "7": ((7,), False),
        "the": ((bos_tokenizer.convert_tokens_to_ids("the"),), False),
    }
    for prepend, (added, default) in cases.items():
        got = first_token(bos_tokenizer, prepend)
        assert (got.added, got.tokenizer_default) == (added, default), prepend
    plain = first_token(tiny_tokenizer)
    assert (plain.added, plain.tokenizer_default) == ((), True)
    assert first_token(tiny_tokenizer, "bos").tokenizer_default is False
    with pytest.raises(SinklabError, match="not one"):
        first_token(bos_tokenizer, "two words")


def test_every_window_starts_the_way_the_tokenizer_starts_one(bos_tokenizer):
    text = load_text("shakespeare:hamlet")
    body = bos_tokenizer(text.text[:20_000], add_special_tokens=False).input_ids
    bos = bos_tokenizer.bos_token_id
    rows = token_windows(text, bos_tokenizer, 50, 3)
    assert rows.shape == (3, 50) and rows[:, 0].tolist() == [bos] * 3
    for w in range(3):  # then the next stretch of the text, 49 tokens each
        assert rows[w, 1:].tolist() == body[w * 49 : (w + 1) * 49]
    none = token_windows(text, bos_tokenizer, 50, 3, "none")
    assert none.reshape(-1).tolist() == body[:150]
    stream = token_stream(text, bos_tokenizer, 50)
    assert stream.tolist() == rows[0].tolist()  # the one-window case is the stream
    record = first_token(bos_tokenizer).record(bos_tokenizer, rows)
    assert record == {
        "id": bos,
        "text": "<s>",
        "prepend": "default",
        "added": [bos],
        "tokenizer_default": True,
    }
    record = first_token(bos_tokenizer, "none").record(bos_tokenizer, none)
    assert record["id"] == body[0] and record["added"] == [] and not record["tokenizer_default"]


@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory, tiny_model_factory, bos_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-bos")
    tiny_model_factory("llama").save_pretrained(folder)
    bos_tokenizer.save_pretrained(folder)
    return folder


def _meta(path) -> dict:
    return json.loads(path.read_text())["meta"]["first_token"]


@pytest.mark.parametrize(
    "prepend, first, default",
    [(None, "bos", True), ("none", "text", False), ("eos", "eos", False), ("3", 3, False)],
)
def test_probe_prepend_variants_and_meta(
    capsys, tmp_path, bos_model_dir, bos_tokenizer, prepend, first, default
):
    text = load_text("shakespeare:hamlet").text[:2000]
    want = {  # the id each variant must put first
        "bos": bos_tokenizer.bos_token_id,
        "eos": bos_tokenizer.eos_token_id,
        "text": bos_tokenizer(text, add_special_tokens=False).input_ids[0],
    }.get(first, first)
    out = tmp_path / "p"
    args = ["--model", str(bos_model_dir), "--tokens", "24", "--no-figures", "--out", str(out)]
    args += ["--text", "shakespeare:hamlet", "--format", "json"]
    run = run_main(capsys, "probe", *args, *(("--prepend", prepend) if prepend else ()))
    assert run.returncode == 0, run.stderr
    meta = _meta(out / "probe.json")
    assert (meta["id"], meta["tokenizer_default"]) == (want, default)
    assert meta["text"] == bos_tokenizer.decode([want])
    assert meta["prepend"] == (prepend or "default")


def test_every_command_records_the_first_token(capsys, tmp_path, bos_model_dir, bos_tokenizer):
    bos = bos_tokenizer.bos_token_id
    model = ["--model", str(bos_model_dir)]
    hamlet = ["--text", "shakespeare:hamlet"]
    sizes = [
        "--tokens",
        "16",
        "--q0",
        "2",
        "--stream-tokens",
        "16",
        "--sensitivity-tokens",
        "16",
        "--windows",
        "3",
    ]
    runs = {
        "stream": ["stream", *model, *hamlet, *["--tokens", "24", "--policy", "window"]],
        "ablate": ["ablate", *model, *hamlet, *["-e", "first-token", "--tokens", "16"]],
        "claims": ["claims", *model, "--texts", "shakespeare:hamlet", *sizes],
    }
    runs["stream"] += ["--n-sink", "2", "--window", "8"]
    runs["claims"] += ["--claims", "first-token-sinks"]
    files = {"stream": "stream.json", "ablate": "ablate.json", "claims": "claims.json"}
    for name, args in runs.items():
        run = run_main(capsys, *args, "--out", str(tmp_path / name))
        assert run.returncode == 0, (name, run.stderr)
        meta = _meta(tmp_path / name / files[name])
        assert (meta["id"], meta["added"], meta["tokenizer_default"]) == (bos, [bos], True), name
    prompt = ["--prompt", "the king", "--max-new-tokens", "2", "--window", "8"]
    run = run_main(capsys, "generate", *prompt, "--model", str(bos_model_dir), "--prepend", "eos",
                   "--out", str(tmp_path / "g"))  # fmt: skip
    assert run.returncode == 0, run.stderr
    meta = _meta(tmp_path / "g" / "generate.json")
    assert (meta["text"], meta["prepend"], meta["tokenizer_default"]) == ("</s>", "eos", False)


def test_a_bad_prepend_is_one_line_and_nothing_is_written(capsys, tmp_path, bos_model_dir):
    run = run_main(capsys, "stream", "--prepend", "", "--model", "/nowhere")
    assert_one_line_error(run, "--prepend is empty")
    args = ["--prepend", "two words", "--tokens", "24", "--model", str(bos_model_dir)]
    run = run_main(capsys, "probe", *args, "--out", str(tmp_path / "x"))
    assert_one_line_error(run, "is 2 tokens, not one")
    assert not (tmp_path / "x").exists()


def test_the_report_samples_start_with_the_tokenizers_first_token(bos_model_dir, bos_tokenizer):
    """The report's shared ids (every probe/stream stage) and a claims window come from the
    same function with the same start."""
    from sinklab.claims.core import ClaimsConfig, text_samples

    config = ClaimsConfig(texts=("shakespeare:hamlet",), windows=2, probe_tokens=16, q0=2,
                          stream_tokens=16, sensitivity_tokens=16, grid=2)  # fmt: skip
    samples = text_samples(bos_tokenizer, config, None)
    assert [int(ids[0]) for _, ids in samples] == [bos_tokenizer.bos_token_id] * 2
    assert torch.equal(samples[0][1], token_stream(load_text("shakespeare:hamlet"),
                                                   bos_tokenizer, 16))  # fmt: skip
