"""``ClaimsRun.argv`` writes every option once, and ``sinklab claims`` reads it back into the
same config (the real reproduce path, run end to end, is tests/test_report_reproduce.py)."""

from __future__ import annotations

from dataclasses import fields

from sinklab.claims.core import ClaimsConfig
from sinklab.claims.run import OPTIONS, ClaimsRun

NOT_OPTIONS = {"density_lam"}  # fixed by the claim's definition (docs/claims.md), no flag


def test_every_config_field_is_an_option_or_fixed():
    assert set(OPTIONS) | NOT_OPTIONS == {f.name for f in fields(ClaimsConfig)}


def test_the_command_line_reads_back_into_the_same_config(monkeypatch, tmp_path, capsys):
    from sinklab.cli import main

    lab = tmp_path / "lab"
    lab.mkdir()
    config = ClaimsConfig(
        texts=("shakespeare:lear", "shakespeare:tempest"),
        windows=2,
        claims=("first-token-sinks", "sink-cheaper"),
        q0=5,
        eps=0.45,
        probe_tokens=96,
        stream_tokens=300,
        n_sink=2,
        window=40,
        sensitivity_tokens=64,
        grid=3,
        probes=4,
        cost_lengths=(16, 48),
        cost_seeds=2,
        cost_steps=30,
        lab=str(lab),
        lab_size="quick",
        lab_steps=40,
        seed=7,
        prepend="bos",
    )
    seen: list[ClaimsConfig] = []

    def record(self, loaded, progress=None, texts=None):
        seen.append(self.config)
        raise SystemExit(0)  # the config is what is checked here; nothing runs

    monkeypatch.setattr(ClaimsRun, "run", record)
    argv = ClaimsRun(config).argv([], str(tmp_path / "out"))
    assert argv[:2] == ["sinklab", "claims"] and len(set(argv[2::2])) == len(argv[2::2])
    main(argv[1:])  # exits at the recorded run (its return code is not what is checked)
    assert seen == [config]
    # a loading option given with the model is not written twice
    with_model = ClaimsRun(config).argv(["--model", "m", "--prepend", "bos"], "out")
    assert with_model.count("--prepend") == 1
