"""The report's stream stage: the dense-collapse rule, the sizes of its two presets, that it
streams hybrid models, and that its own "reproduce" command gives its numbers."""

from __future__ import annotations

import json
import math

import pytest

from archs import save_arch_model
from helpers import run_main
from sinklab.report.config import ReportConfig
from sinklab.stream.summary import COLLAPSE, block_size, dense_collapse

TINY = ("stream_tokens=96", "window=16", "recompute_every=8")


def _data(dense: list[float], sink: list[float], segment: int = 500) -> dict:
    return {
        "meta": {"params": {"segment": segment}},
        "policies": {"dense": {"segment_ppl": dense}, "sink": {"segment_ppl": sink}},
    }


def test_dense_collapse_is_the_first_block_past_the_rule():
    got = dense_collapse(_data([20.0, 21.0, 45.0, 300.0], [20.0, 20.5, 21.0, 21.0]))
    assert COLLAPSE * 21.0 < 45.0 and COLLAPSE * 20.5 > 21.0
    assert (got["at_token"], got["dense_ppl"], got["sink_ppl"]) == (1000, 45.0, 21.0)
    assert (
        got["block"] == 500 and dense_collapse(_data([9.0, 50.0], [9.0, 9.0], 7))["at_token"] == 7
    )
    assert dense_collapse(_data([20.0, 30.0], [20.0, 20.0]))["at_token"] is None
    no_dense = {"meta": {"params": {"segment": 500}}, "policies": {"sink": {"segment_ppl": [1.0]}}}
    assert dense_collapse(no_dense) is None


def test_report_streams_for_real():
    quick, full = ReportConfig.preset(True), ReportConfig.preset(False)
    assert (quick.stream_tokens, quick.n_sink, quick.window) == (4000, 4, 252)
    assert (full.stream_tokens, full.n_sink, full.window) == (20000, 4, 508)


def test_block_is_an_integer_number_of_tokens():
    """The quick (4,000) and full (20,000) sizes: a float block broke segment_ppl's range()."""
    for tokens, block in ((4000, 100), (20000, 500), (480, 50), (64, 50)):
        assert block_size(tokens) == block and isinstance(block_size(tokens), int)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_reproduce_command_gives_the_sections_numbers(
    capsys, tmp_path, tiny_model_dir, tiny_tokenizer, family
):
    """The stream section's command line, run through the CLI, writes the section's numbers:
    segment_ppl (its --segment) and ppl of every policy, the method and where dense collapses.
    gemma2 (sliding + global layers) streams too, by chunked, which auto now picks for it. (A
    model auto streams by step, Falcon, cannot run the report's stream section: sink-auto's probe
    needs transformers' AttentionInterface.)"""
    model = (
        tiny_model_dir(family)
        if family == "llama"
        else save_arch_model(family, tmp_path / family, tiny_tokenizer)
    )
    out = tmp_path / "report"
    sets = [a for kv in TINY for a in ("--set", kv)]
    code, _, err = run_main(
        capsys, "report", "--quick", "--model", str(model), "--out", str(out), "--stages",
        "stream", *sets,
    )  # fmt: skip
    assert code == 0, err
    stage = json.loads((out / "results.json").read_text())["stages"]["stream"]
    assert stage["status"] == "ok", (stage["error"], stage["traceback"])
    section = stage["json"]  # the stage's data
    assert section["method"] == "chunked"
    command = stage["command"]
    assert command[:2] == ["sinklab", "stream"] and "--segment" in command
    code, _, err = run_main(capsys, *command[1:])
    assert code == 0, err
    again = json.loads((tmp_path / "report-reproduce" / "stream" / "stream.json").read_text())
    assert again["meta"]["params"] == section["meta"]["params"]
    assert (again["method"], again["method_reason"]) == (
        section["method"],
        section["method_reason"],
    )
    assert set(again["policies"]) == set(section["policies"])
    for name, r in section["policies"].items():
        got = again["policies"][name]
        assert len(r["segment_ppl"]) == math.ceil((96 - 1) / block_size(96)) == 2
        assert got["segment_ppl"] == pytest.approx(r["segment_ppl"], rel=1e-9, nan_ok=True), name
        assert got["ppl"] == pytest.approx(r["ppl"], rel=1e-9), name
    figures = {f["path"].split("/")[-1] for f in stage["figures"]}
    assert figures == {"running_ppl.png", "block_ppl.png"}
    assert {p.name for p in (tmp_path / "report-reproduce" / "stream").glob("*.png")} == figures
