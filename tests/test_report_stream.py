"""The report's stream stage: the dense-collapse rule and the sizes of its two presets."""

from __future__ import annotations

from sinklab.report.catalog_stream import COLLAPSE, dense_collapse
from sinklab.report.stages import ReportConfig


def _data(dense: list[float], sink: list[float]) -> dict:
    return {"policies": {"dense": {"segment_ppl": dense}, "sink": {"segment_ppl": sink}}}


def test_dense_collapse_is_the_first_block_past_the_rule():
    got = dense_collapse(_data([20.0, 21.0, 45.0, 300.0], [20.0, 20.5, 21.0, 21.0]), 500)
    assert COLLAPSE * 21.0 < 45.0 and COLLAPSE * 20.5 > 21.0
    assert (got["at_token"], got["dense_ppl"], got["sink_ppl"]) == (1000, 45.0, 21.0)
    assert dense_collapse(_data([20.0, 30.0], [20.0, 20.0]), 500)["at_token"] is None
    assert dense_collapse({"policies": {"sink": {"segment_ppl": [1.0]}}}, 500) is None


def test_report_streams_for_real():
    quick, full = ReportConfig.preset(True), ReportConfig.preset(False)
    assert (quick.stream_tokens, quick.n_sink, quick.window) == (4000, 4, 252)
    assert (full.stream_tokens, full.n_sink, full.window) == (20000, 4, 508)


def test_block_is_an_integer_number_of_tokens():
    """The quick (4,000) and full (20,000) sizes: a float block broke segment_ppl's range()."""
    from sinklab.report.catalog_stream import _block

    for tokens, block in ((4000, 100), (20000, 500), (480, 50), (64, 50)):
        assert _block(tokens) == block and isinstance(_block(tokens), int)
