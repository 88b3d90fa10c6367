"""``sinklab claims`` end to end on a tiny model, in-process through ``sinklab.cli.main``: JSON
with one row per claim, files written through sinklab.outputs, one-line errors for bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import one_line_error, run_main
from sinklab.claims import CLAIM_IDS
from sinklab.meta import META_KEYS
from sinklab.outputs import MARKER

FAST = ["--tokens", "32", "--stream-tokens", "40", "--window", "14", "--n-sink", "2",
        "--cost-lengths", "4,8", "--cost-steps", "10"]  # fmt: skip
SOME = "first-token-sinks,evict-sinks-collapse,sink-cheaper,hard-switch-sink"


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads; on a busy machine two spin-wait (3x the time)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_claims_json_and_files(capsys, tmp_path, tiny_model_dir, one_thread, monkeypatch):
    monkeypatch.setenv("SINKLAB_LAB_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "claims-out"
    args = ["claims", "--model", str(tiny_model_dir("llama")), "--claims", SOME, *FAST,
            "--lab-size", "quick", "--lab-steps", "10"]  # fmt: skip
    code, stdout, err = run_main(capsys, *args, "--format", "json", "--out", str(out))
    assert code == 0, err
    data = json.loads(stdout)
    rows = data["claims"]
    assert [r["id"] for r in rows] == [c for c in CLAIM_IDS if c in SOME.split(",")]
    for r in rows:
        for key in ("effect", "interval", "verdict", "reason", "protocol", "site", "samples"):
            assert key in r, key
    assert rows[0]["n_valid"] == 3 and rows[0]["interval"][0] <= rows[0]["effect"]
    switch = next(r for r in rows if r["id"] == "hard-switch-sink")  # trained, not converged
    assert switch["verdict"] == "inconclusive" and switch["reason"].startswith("not converged")
    assert data["run"]["lab"]["trained"] == 12 and switch["fidelity"].startswith("same protocol")
    saved = json.loads((out / "claims.json").read_text())
    assert saved["claims"] == json.loads(json.dumps(rows))
    meta = saved["meta"]
    assert meta["model"]["n_layers"] == 2 and len(meta["text"]) == 3
    assert set(meta) == set(META_KEYS) and meta["params"]["probe_tokens"] == 32
    assert (out / "claims_effects.png").stat().st_size > 1000
    points = json.loads((out / "claims_effects.json").read_text())["points"]
    assert [p["id"] for p in points] == [r["id"] for r in rows]
    assert json.loads((out / MARKER).read_text())["command"] == "claims"
    # a second run replaces its own output; text mode prints the table
    code, stdout, err = run_main(capsys, *args, "--out", str(out))
    assert code == 0 and "first-token-sinks" in stdout, err
    assert "lab runs: 0 trained, 12 reused from" in stdout  # the cache, shown
    first = rows[0]
    lo, hi = first["interval"]
    line = next(ln for ln in stdout.splitlines() if first["id"] in ln)
    for cell in (f"{first['effect']:.3g}", f"[{lo:.3g}, {hi:.3g}]", f"> {first['threshold']:.3g}"):
        assert cell in line, (cell, line)


def test_the_claims_table_in_words():
    from sinklab.claims.table import claimed, reasons, text_rows

    row = {
        "id": "x",
        "site": "attention weights",
        "effect": 0.61234,
        "interval": [0.5, 0.70001],
        "direction": "below",
        "threshold": 0.25,
        "n_valid": 2,
        "n_samples": 3,
        "verdict": "inconclusive",
        "reason": "only 2 of 3 samples",
    }
    none = {**row, "id": "y", "effect": None, "interval": None, "verdict": "supported"}
    assert claimed(row) == "< 0.25"
    assert text_rows({"claims": [row, none]}) == [
        ("x", "attention weights", "0.612", "[0.5, 0.7]", "< 0.25", "2/3", "inconclusive"),
        ("y", "attention weights", "-", "-", "< 0.25", "2/3", "supported"),
    ]
    assert reasons({"claims": [row, none]}) == ["x: only 2 of 3 samples"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--claims", "no-such-claim"], "unknown claim"),
        (["--texts", "shakespeare:nope"], "no embedded play"),
        (["--texts", ","], "--texts is empty"),
        (["--windows", "0"], "windows must be >= 1"),
        (["--lab", "/no/such/lab"], "is not a folder"),
        (["--cost-lengths", "16"], "cost_lengths"),
        (["--cost-lengths", "a,b"], "comma-separated integers"),
        (["--lab-size", "huge"], "--lab-size must be one of"),
        (["--lab-steps", "2"], "--lab-steps must be >= 10"),
    ],
)
def test_bad_inputs_are_one_line(capsys, extra, needle, monkeypatch):
    import sinklab.models.loading

    def refuse(*a, **k):
        raise AssertionError("the model loaded before the inputs were checked")

    monkeypatch.setattr(sinklab.models.loading, "load_model", refuse)
    code, _, err = run_main(capsys, "claims", "--model", "/never/loaded", *extra)
    one_line_error(code, err, needle)


def test_the_lab_cache_is_shown_and_cleared(capsys, tmp_path, monkeypatch):
    from sinklab.lab.cache import cached_train, run_key
    from sinklab.lab.presets import preset

    monkeypatch.setenv("SINKLAB_LAB_CACHE", str(tmp_path / "c" / "lab"))
    cfg = preset("cpu", task="backcopy", steps=3, d_model=16, seq_len=16, batch_size=2,
                 n_checkpoints=2)  # fmt: skip
    cached_train(cfg)
    code, stdout, err = run_main(capsys, "claims", "--lab-cache")
    assert code == 0, err
    assert str(tmp_path / "c" / "lab") in stdout and run_key(cfg) in stdout
    assert "1 run(s)" in stdout and "not converged" in stdout
    code, stdout, err = run_main(capsys, "claims", "--lab-cache", "--format", "json")
    assert json.loads(stdout)["runs"][0]["key"] == run_key(cfg)
    code, stdout, err = run_main(capsys, "claims", "--clear-lab-cache")
    assert code == 0 and "removed 1 cached lab run(s)" in stdout
    assert not any((tmp_path / "c" / "lab").iterdir())


def test_a_users_folder_is_refused_before_work(capsys, tmp_path: Path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, _, err = run_main(capsys, "claims", "--claims", "sink-cheaper", "--out", str(mine))
    one_line_error(code, err, "sinklab did not write")
    assert (mine / "notes.txt").read_text() == "mine"


def test_the_claims_table_on_a_narrow_pipe_cuts_no_verdict():
    """On a pipe at 80 columns every verdict and number is printed whole (no "inconclusi…")."""
    import io

    from rich.console import Console

    from sinklab.commands.claims import _print_table

    row = {
        "id": "a-rather-long-claim-identifier",
        "site": "attention weights of every head in every layer",
        "effect": 0.61234,
        "interval": [0.5, 0.70001],
        "direction": "below",
        "threshold": 0.25,
        "n_valid": 2,
        "n_samples": 3,
        "verdict": "inconclusive",
        "reason": "only 2 of 3 samples",
    }
    rows = [row, {**row, "id": "another-long-claim-identifier", "verdict": "not supported"}]
    buf = io.StringIO()
    _print_table({"claims": rows}, Console(file=buf, width=80, force_terminal=False))
    out = buf.getvalue()
    assert "…" not in out
    for r in rows:
        line = next(ln for ln in out.splitlines() if r["id"] in ln)
        assert r["verdict"] in line and "[0.5, 0.7]" in line and "< 0.25" in line


def test_the_commands_defaults_are_the_configs():
    """Every ``sinklab claims`` option that sets a :class:`ClaimsConfig` size defaults to the
    config's own default, so the command and the library run the same claims (a default spelled
    twice drifted once: ``--stream-tokens`` stayed 320 when the config moved to 1280)."""
    import dataclasses
    import inspect

    from sinklab.claims.core import ClaimsConfig
    from sinklab.commands.claims import claims

    fields = {f.name: f.default for f in dataclasses.fields(ClaimsConfig)}
    renamed = {"tokens": "probe_tokens"}
    checked = []
    for name, param in inspect.signature(claims).parameters.items():
        key = renamed.get(name, name)
        if key not in fields or fields[key] is dataclasses.MISSING or param.default is None:
            continue
        want = fields[key]
        got = param.default
        if isinstance(want, tuple):  # e.g. cost_lengths, spelled as a comma list
            got = tuple(int(x) for x in str(got).split(","))
        assert got == want, f"--{name.replace('_', '-')} defaults to {got!r}, the config {want!r}"
        checked.append(key)
    assert {"probe_tokens", "stream_tokens", "window", "n_sink", "grid", "probes"} <= set(checked)
