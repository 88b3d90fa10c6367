"""The one declaration of the probe metrics: results, JSON and docs/metrics.md follow from it."""

from dataclasses import fields
from pathlib import Path

import torch

from conftest import make_tiny_model
from sinklab.probe import ProbeResult, probe, spec

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def test_docs_table_is_the_declaration(tmp_path):
    page = DOCS.read_text(encoding="utf-8")
    start, end = page.index(spec.TABLE_START), page.index(spec.TABLE_END)
    assert page[start + len(spec.TABLE_START) : end].strip() == spec.metrics_table().strip()
    # every declared metric has a row, and the table has no other row
    rows = [r for r in spec.metrics_table().splitlines()[2:]]
    assert [r.split("`")[1] for r in rows] == list(spec.names())
    copy = tmp_path / "metrics.md"
    copy.write_text(page.replace("| `entropy` |", "| `entropie` |"), encoding="utf-8")
    spec.write_docs(str(copy))
    assert copy.read_text(encoding="utf-8") == page


def test_result_fields_and_json_keys_follow_the_declaration():
    declared = [f.name for f in fields(ProbeResult)]
    # geometry: the per-site numbers of sinklab.probe.geometry (docs/experiments.md), not a metric;
    # attention_path: each layer's route (sinklab.seam.observe.route), not a metric either
    assert declared == ["config", "n_tokens", *spec.names(), "meta", "geometry", "attention_path"]
    res = probe(make_tiny_model("llama"), torch.randint(3, 500, (24,)))
    assert list(res.to_json()) == [
        "meta", *spec.names(in_json=True), "geometry", "attention_path"
    ]  # fmt: skip
    assert "received" not in res.to_json() and res.received.shape == (2, 4, 24)


def test_each_metric_is_computed_one_way():
    for m in spec.METRICS:
        ways = [m.partial is not None, m.hidden is not None, m.derive is not None]
        assert sum(ways) == 1, m.name
        assert (m.partial is not None) == (m.reduce is not None) == (m.source == "attention")
        assert m.per in {"head", "layer", "key", "model"} and m.site and m.definition
    assert len(spec.BY_NAME) == len(spec.METRICS)  # names are unique
