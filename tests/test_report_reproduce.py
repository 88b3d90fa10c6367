"""Each report section's "reproduce" command, run as printed, gives the section's numbers: the page
and the CLI cannot drift apart (thresholds, q0, sizes the report chose)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from helpers import run_main
from sinklab.ablate import get_experiment

STAGES = "claims,probe,first-token,mask-sink,geometry"
# the report's own sizes for a 2-layer random model, and a threshold that is not the default
SIZES = ("probe_tokens=64", "probe_lengths=32,64", "q0=4", "ablate_tokens=40", "eps=0.45",
         "lab_steps=10")  # fmt: skip


@pytest.fixture(scope="module")
def report(tmp_path_factory, tiny_model_dir) -> dict:
    from sinklab.cli import main

    out = tmp_path_factory.mktemp("repro") / "report"
    args = ["report", "--quick", "--model", str(tiny_model_dir("llama")), "--out", str(out)]
    args += ["--stages", STAGES, *(a for kv in SIZES for a in ("--set", kv))]
    assert main(args) == 0
    return json.loads((out / "results.json").read_text())["stages"]


def _close(a, b, path=""):
    """Equal JSON numbers within 1e-5 (threads may reorder sums), everything else equal."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-5 * max(1, abs(a)), path
    else:
        assert a == b, path


def _rerun(capsys, stage: dict, out: Path) -> dict:
    cmd = stage["command"]
    assert cmd[0] == "sinklab"
    args = cmd[1:]
    args[args.index("--out") + 1] = str(out)
    run = run_main(capsys, *args)
    assert run.returncode == 0, run.stderr
    return json.loads((out / f"{cmd[1]}.json").read_text())


@pytest.mark.parametrize("name", ["first-token", "mask-sink", "geometry"])
def test_an_ablation_section_reproduces(report, name, capsys, tmp_path):
    stage = report[name]
    assert stage["status"] == "ok", stage["error"]
    got = _rerun(capsys, stage, tmp_path / name)
    _close(stage["json"]["conditions"], got["conditions"])
    assert got["finding"] == stage["json"]["finding"]
    if "eps" in get_experiment(name).options:  # the page's eps, then the stricter 0.8
        assert got["meta"]["params"]["eps"] == [0.45, 0.8]
    else:  # geometry reads no threshold, and its command passes none
        assert "--eps" not in stage["command"]


def test_the_probe_section_reproduces(report, capsys, tmp_path):
    stage = report["probe"]
    got = _rerun(capsys, stage, tmp_path / "probe")
    for key in ("sink_mass", "sink_rate", "entropy"):
        _close(stage["json"][key], got[key], key)
    assert set(got["sink_rate"]) == {"0.45", "0.8"}


def test_the_claims_section_reproduces(report, capsys, tmp_path):
    stage = report["claims"]
    got = _rerun(capsys, stage, tmp_path / "claims")
    want = {r["id"]: r for r in stage["json"]["claims"]}
    for row in got["claims"]:
        ref = want[row["id"]]
        for key in ("effect", "interval", "verdict", "n_valid", "effect_definition"):
            _close(ref[key], row[key], f"{row['id']}.{key}")
    sinks = next(r for r in got["claims"] if r["id"] == "first-token-sinks")
    assert "sink mass > 0.45 (q0 = 4)" in sinks["effect_definition"]


def test_the_loading_options_are_on_every_command(tiny_model_dir, capsys, tmp_path):
    """A report made in bfloat16 prints commands that load bfloat16, and they reproduce it."""
    model = str(tiny_model_dir("llama"))
    args = ["report", "--quick", "--model", model, "--out", str(tmp_path / "r"), "--dtype"]
    args += ["bfloat16", "--stages", "probe,mask-sink", *(a for kv in SIZES for a in ("--set", kv))]
    run = run_main(capsys, *args)
    assert run.returncode == 0, run.stderr
    stages = json.loads((tmp_path / "r" / "results.json").read_text())["stages"]
    for name, stage in stages.items():
        cmd = stage["command"]
        assert cmd[cmd.index("--model") : cmd.index("--model") + 4] == [
            "--model", model, "--dtype", "bfloat16"
        ], name  # fmt: skip
    got = _rerun(capsys, stages["probe"], tmp_path / "probe")
    assert got["meta"]["model"]["dtype"] == "bfloat16"
    _close(stages["probe"]["json"]["sink_mass"], got["sink_mass"])
