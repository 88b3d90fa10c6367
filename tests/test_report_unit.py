"""The report's pure parts: headline sentences from hand-made numbers, formatting, config checks,
the page without any model."""

from __future__ import annotations

import math

import pytest

from sinklab.errors import SinklabError
from sinklab.probe.summary import (
    length_sentence,
    ranges,
    sink_depth_sentence,
    sink_positions_sentence,
    sink_rate_sentence,
)
from sinklab.report.cells import aggregate
from sinklab.report.config import ReportConfig
from sinklab.report.html import fmt, render_page
from sinklab.report.stages import StageOutput, StageResult, describe_error
from sinklab.report.summary import headline
from sinklab.stream.summary import stream_sentence

PROBE = {
    "meta": {"params": {"q0": 16, "tokens": 512, "eps": [0.3, 0.8]}},
    "sink_mass": [[0.0, 0.1], [0.2, 0.5], [0.9, 0.95]],
    "sink_rate": {"0.3": 0.5, "0.8": 1 / 3},
    "sink_positions": [{"position": 0, "mass": 0.61}, {"position": 7, "mass": 0.05}],
}


def ok(name: str, data: dict) -> StageResult:
    return StageResult(name, name, "", "ok", 1.0, {}, [], output=StageOutput(data))


def test_probe_sentences_are_computed_from_numbers():
    assert sink_rate_sentence(PROBE).startswith("Sink rate: 50% of the 6 heads (3 layers x 2)")
    assert "(33% put more than 0.8), over 512 tokens with q0 = 16" in sink_rate_sentence(PROBE)
    depth = sink_depth_sentence(PROBE)
    assert "from layer 1" in depth and "layers 0 have no sink head" in depth
    assert "densest is layer 2 (100%" in depth
    pos = sink_positions_sentence(PROBE)
    assert pos == (
        "Sink positions: the strongest sink is key position 0 (mean received attention 0.61); "
        "other sink positions: 7."
    )


def test_thresholds_come_from_the_results_own_parameters():
    probe = {**PROBE, "meta": {"params": {"q0": 0, "tokens": 64, "eps": [0.6]}}}
    probe["sink_rate"] = {"0.6": 1 / 3}
    rate, depth = (
        sink_rate_sentence(probe),
        sink_depth_sentence(probe),
    )
    assert "33% of the 6 heads" in rate and "more than 0.6 of their attention" in rate
    assert "0.3" not in rate + depth and "0.8" not in rate and "sink mass > 0.6" in depth
    assert "over 64 tokens with q0 = 0" in rate


def test_length_and_stream_sentences():
    trend = {
        "meta": {"params": {"eps": [0.3]}},
        "by_length": [
            {"tokens": 512, "sink_rate": {"0.3": 0.6}},
            {"tokens": 128, "sink_rate": {"0.3": 0.4}},
        ],
    }
    assert length_sentence(trend) == (
        "Context length: the sink rate rises from 40% at 128 tokens to 60% at 512 tokens."
    )
    stream = {
        "meta": {"params": {"n_sink": 4, "window": 60, "n_tokens": 600}},
        "policies": {
            "sink": {"ppl": 30.0},
            "window": {"ppl": 90.0},
            "recompute": {"ppl": 29.5},
            "dense": {"ppl": 25.0},
        },
        "on_recompute_targets": {"n_scored": 30, "ppl": {"sink": 31.0, "recompute": 30.5}},
    }
    assert stream_sentence(stream) == (
        "Streaming: 600 tokens with 4 sinks + a 60-token window give perplexity 30.0; the same "
        "memory without sinks (window only) gives 90.0 (3.00x, worse), and the full dense cache "
        "25.0. On the 30 targets the recompute oracle scored: sink 31.0 vs recompute 30.5."
    )


def test_headline_skips_what_it_cannot_compute_and_names_failures():
    broken = ok("probe", {"sink_mass": "not a matrix"})
    failed = StageResult("stream", "s", "", "failed", 0.1, {}, [], error="RuntimeError: x")
    finding = ok("mask-sink", {"finding": "masking the sink raises perplexity from 12.1 to 410.3"})
    lines = headline([broken, failed, finding])
    assert lines == [
        "Ablation: masking the sink: masking the sink raises perplexity from 12.1 to 410.3.",
        "Failed: 1 stage(s) did not run and show their error: stream.",
    ]


def test_fmt_aggregateranges():
    assert [fmt(x) for x in (None, True, 3, 0.12345, 12.345, 12345.6, math.nan)] == [
        "–",
        "yes",
        "3",
        "0.123",
        "12.3",
        "12,346",
        "nan",
    ]
    assert aggregate([[1.0, math.nan], [3.0]], "mean") == 2.0
    assert aggregate(["sink", "mixed", "sink"], "count:sink") == 2
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_describe_error_for_a_missing_library():
    exc = ModuleNotFoundError("No module named 'sinklab.ablate'", name="sinklab.ablate")
    assert "sinklab.ablate is not available" in describe_error(exc)
    assert describe_error(ValueError("bad\nsecond line")) == "ValueError: bad"


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"window": 0}, "window must be at least 1"),
        ({"eps": 1.5}, "eps must be in (0, 1)"),
        ({"probe_lengths": ()}, "probe_lengths"),
        ({"q0": 600}, "q0 must be in"),
    ],
)
def test_config_validation(overrides, needle):
    with pytest.raises(SinklabError, match=None) as info:
        ReportConfig.preset(True, **overrides)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_page_escapes_text_and_has_no_external_reference():
    bad = StageResult(
        "x", "<b>x</b>", "a & b", "failed", 0.0, {"k": "<v>"}, ["sinklab", "x"], error="E: <oops>"
    )
    page = render_page(
        title="t", subtitle="s", summary=["1 < 2"], results=[bad], footer={"m": "<m>"}
    )
    assert "<oops>" not in page and "&lt;oops&gt;" in page and "1 &lt; 2" in page
    assert "http" not in page and "<script" not in page


def test_generic_view_tables_and_curves_point_into_the_json(tmp_path):
    from sinklab.report.catalog_ablate import generic_view
    from sinklab.report.cells import lookup

    data = {
        "meta": {},
        "finding": "x",
        "conditions": {
            "keep": {"ppl": 12.1, "token_similarity": [0.1, 0.2, 0.3]},
            "drop": {"ppl": 410.3, "token_similarity": [0.5, 0.6, 0.7]},
        },
    }
    figs, tables = generic_view(data, tmp_path, "first-token")
    assert [t.columns for t in tables] == [("condition", "ppl")]
    cells = [row[1] for row in tables[0].rows]
    assert [lookup(data, c.path) for c in cells] == [12.1, 410.3]
    assert len(figs) == 1 and figs[0].path.read_bytes()[:4] == b"\x89PNG"


def test_remove_stale_builds_only_touches_dead_runs(tmp_path):
    import os

    from sinklab.outputs import remove_stale_builds

    out = tmp_path / "report"
    dead = tmp_path / ".report.tmp-999999999-abc"
    mine = tmp_path / f".report.tmp-{os.getpid()}-xyz"
    other = tmp_path / ".other.tmp-999999999-abc"
    for d in (dead, mine, other):
        d.mkdir()
    assert remove_stale_builds(out) == [dead]
    assert mine.is_dir() and other.is_dir() and not dead.exists()


def test_first_screen_and_model_table_state_a_proxys_verdict_with_its_proxy():
    """A proxy's verdict is printed as stated ("not supported on backcopy") on the report's
    first screen and in the claim x model table; the badge keeps the verdict's class."""
    from sinklab.claims.across import _cell, cell_text
    from sinklab.report.html import verdict_rows

    row = {
        "id": "depth",
        "verdict": "not supported",
        "verdict_stated": "not supported on backcopy",
        "effect": -0.1,
        "interval": [-0.2, 0.0],
        "n_valid": 3,
        "n_samples": 3,
        "reason": "the interval lies below 0. More text.",
        "direction": ">",
        "threshold": 0.0,
    }
    ((cid, verdict, stated, _, _, reason),) = verdict_rows([row])
    assert (cid, verdict, stated) == ("depth", "not supported", "not supported on backcopy")
    assert reason == "the interval lies below 0"
    assert cell_text(_cell(row)).endswith("not supported on backcopy")
    plain = {**row, "verdict_stated": None, "verdict": "supported"}
    assert verdict_rows([plain])[0][2] == "supported"
