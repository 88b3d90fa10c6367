"""One record per experiment: the CLI, the report, plots and docs all read the same records."""

from pathlib import Path

from sinklab.ablate import EXPERIMENTS, RECORDS, experiments_for_claim, get_experiment, plots
from sinklab.report.catalog_ablate import ablation_stages
from sinklab.report.summary import headline

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_records_are_complete_and_unique():
    assert tuple(r.name for r in RECORDS) == EXPERIMENTS and len(set(EXPERIMENTS)) == len(RECORDS)
    for rec in RECORDS:
        assert callable(rec.run) and callable(getattr(plots, rec.plot))
        assert rec.claims and all(isinstance(c, str) and c for c in rec.claims)
        assert rec.title and rec.caption and rec.help and rec.tests
        assert "seed" not in rec.tests.lower()  # users read the paper, not our seed numbers
        assert get_experiment(rec.name) is rec
    assert {r.name for r in experiments_for_claim("first-token-cosine")} == {"geometry"}
    assert {r.name for r in experiments_for_claim("density-oversmooths")} == {"density"}


def test_report_stages_follow_the_records():
    stages = ablation_stages()
    assert [s.name for s in stages] == list(EXPERIMENTS)
    assert [s.title for s in stages] == [r.title for r in RECORDS]


def test_docs_list_every_experiment_and_claim():
    text = (DOCS / "experiments.md").read_text()
    for rec in RECORDS:
        assert f"`{rec.name}`" in text
        assert all(f"`{c}`" in text for c in rec.claims)


def test_summary_sentence_comes_from_the_record():
    class Result:
        status = "ok"

        def __init__(self, name, data):
            self.name = name
            self.output = type("Out", (), {"json": data})()

    rec = get_experiment("density")
    out = headline([Result("density", {"finding": "x rises"})], config=None)
    assert out == [f"{rec.title}: x rises."] == [rec.summary({"finding": "x rises"})]
