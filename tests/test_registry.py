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
    out = headline([Result("density", {"finding": "x rises"})])
    assert out == [f"{rec.title}: x rises."] == [rec.summary({"finding": "x rises"})]


def _sims(residual: float, attention_input: float) -> dict[str, float]:
    return {"residual": residual, "attention_input": attention_input}


def test_site_tables_point_at_the_numbers():
    from sinklab.report.catalog_ablate import site_tables
    from sinklab.report.cells import lookup

    sites = ["residual", "attention_input", "key"]
    geo = {
        "sites": sites,
        "layers": [
            {"layer": i, "first_token_cosine": dict.fromkeys(sites, 0.1 * i),
             "token_similarity": {"residual": 0.5, "attention_input": 0.4, "key": None}}
            for i in range(3)
        ],
    }  # fmt: skip
    (table,) = site_tables(geo)
    assert len(table.rows) == 3 and len(table.columns) == 7
    assert lookup(geo, table.rows[2][1].path) == 0.2 and lookup(geo, table.rows[0][6].path) is None
    dens = {
        "protocol": "mix",
        "parameter": "lam",
        "sites": ["residual", "attention_input"],
        "modified_layers": [1, 2],
        "conditions": {
            "unmodified": {"lam": None, "ppl": 9.0, "after_group_similarity": _sims(0.3, 0.2)},
            "lam=1": {"lam": 1.0, "ppl": 12.0, "after_group_similarity": _sims(0.6, 0.7)},
        },
    }
    (table,) = site_tables(dens)
    assert [lookup(dens, c.path) for c in table.rows[1][1:]] == [1.0, 12.0, 0.6, 0.7]
    assert "after layer 2" in table.columns[3]
