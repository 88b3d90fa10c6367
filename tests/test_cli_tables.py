"""Every table the CLI prints fits 80 columns with nothing cut short: at ``COLUMNS=80`` (a pipe,
as scripts and CI read it) ``models``, ``info`` and ``claims`` (one model, and the claim x model
table) print every name, verdict and number whole and no line longer than 80."""

from __future__ import annotations

import io
import re

import pytest

from helpers import run_main

WIDTH = 80


@pytest.fixture
def columns_80(monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))


def _fits(text: str) -> None:
    assert "…" not in text, text
    too_long = [ln for ln in text.splitlines() if len(ln) > WIDTH]
    assert not too_long, too_long


def test_models_table_names_whole_at_80(capsys, columns_80):
    from sinklab.models.zoo import ZOO

    run = run_main(capsys, "models")
    assert run.returncode == 0, run.stderr
    _fits(run.stdout)
    for name, model in ZOO.items():
        row = next(ln for ln in run.stdout.splitlines() if ln.startswith(name + " "))
        assert model.family in row or model.family[:8] in row, row  # the row is the model's


def _folded(text: str) -> dict[str, str]:
    """info's key / value rows, each value's folded lines joined back."""
    rows: dict[str, str] = {}
    key = ""
    for line in text.splitlines()[1:]:  # the title first
        if not line.strip():
            continue
        if line[0] != " ":
            key, _, value = line.partition(" ")
            rows[key] = value.strip()
        else:
            rows[key] += line.strip()
    return rows


def test_info_table_fits_80_and_folds_long_values_whole(capsys, columns_80, tiny_model_dir):
    import json

    model = str(tiny_model_dir("llama"))
    run = run_main(capsys, "info", "--model", model)
    assert run.returncode == 0, run.stderr
    _fits(run.stdout)
    data = json.loads(run_main(capsys, "info", "--model", model, "--format", "json").stdout)
    rows = _folded(run.stdout)
    expected = {**data["model"], **{f"text.{k}": v for k, v in data["text"].items()}}
    assert rows == {k: str(v) for k, v in expected.items()}  # every key and value, whole


def _claim_rows() -> list[dict]:
    """Every real claim, with numbers as wide as the table prints them (3 significant digits,
    negative) and the longest verdicts."""
    from sinklab.claims.registry import CLAIMS

    verdicts = ("not supported", "inconclusive", "supported")
    return [
        {
            "id": c.id,
            "site": c.site,
            "effect": -0.0123,
            "interval": [-0.0456, -0.0789],
            "direction": c.direction,
            "threshold": c.threshold,
            "n_valid": 3,
            "n_samples": 3,
            "verdict": verdicts[i % 3],
            "reason": "only 2 of 3 samples",
        }
        for i, c in enumerate(CLAIMS)
    ]


def test_claims_table_of_every_claim_fits_80():
    from rich.console import Console

    from sinklab.commands.claims import _print_table

    rows = _claim_rows()
    buf = io.StringIO()
    _print_table({"claims": rows}, Console(file=buf, width=WIDTH, force_terminal=False))
    out = buf.getvalue()
    _fits(out)
    lines = out.splitlines()
    for r in rows:
        i = next(i for i, ln in enumerate(lines) if ln.startswith(r["id"] + " "))
        assert r["verdict"] in lines[i] and "[-0.0456, -0.0789]" in lines[i]
        assert f"({r['site']})" in lines[i + 1]  # the site under the id


def test_claims_across_models_fits_80():
    from rich.console import Console

    from sinklab.claims.across import across_table
    from sinklab.commands.claims import _print_across
    from sinklab.models.zoo import ZOO

    names = list(ZOO)
    runs = [(n, {"claims": [{**r, "statement": "s"} for r in _claim_rows()]}) for n in names]
    buf = io.StringIO()
    table = across_table(runs)
    _print_across(table, names, [1.0] * len(names), Console(file=buf, width=WIDTH))
    out = buf.getvalue()
    _fits(out)
    for name in names:
        assert re.search(rf"\b{re.escape(name)}\b", out), name
    for r in table:
        assert any(ln.startswith(r["id"] + " ") for ln in out.splitlines()), r["id"]


@pytest.mark.parametrize("claim", ["first-token-sinks"])
def test_claims_command_at_80(capsys, columns_80, tiny_model_dir, claim):
    """The real command on a tiny model, through stdout."""
    args = ("claims", "--model", str(tiny_model_dir("llama")), "--claims", claim)
    run = run_main(capsys, *args, "--tokens", "24")
    assert run.returncode == 0, run.stderr
    _fits(run.stdout)
    assert any(ln.startswith(claim + " ") for ln in run.stdout.splitlines()), run.stdout
