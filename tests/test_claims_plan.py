"""The lab plan the claims judge (docs/claims.md, "Sizes and time"): the documented `sinklab
train` flags train exactly the plan's runs; the schedule reaches 0.1 x lr at `decay_end` and
holds; the new options refuse bad values with one line; each tail checkpoint records the
validation numbers the comparison rule and the copy-loss floor read."""

from __future__ import annotations

import itertools
import json
import re
import shlex
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from helpers import assert_one_line_error, run_main
from sinklab.claims.lab_runs import LAB_SIZES
from sinklab.lab.presets import config_from_options

DOCS = Path(__file__).resolve().parents[1] / "docs" / "claims.md"


def test_the_documented_commands_train_the_plans_runs():
    text = DOCS.read_text()
    flags = re.search(r'^P="([^"]+)"$', text, re.M)
    assert flags, "docs/claims.md lost its P= line"
    common = shlex.split(flags.group(1))
    lines = [ln for ln in text.splitlines() if ln.startswith("sinklab train $P ")]
    assert len(lines) == 5
    plan = LAB_SIZES["full"]
    want = {asdict(replace(c, keep_checkpoints=True)).__repr__() for c in plan.configs()}
    for line in lines:
        words = common + shlex.split(line.split("$P ", 1)[1].split("#")[0])
        opts: dict = {}
        i = 0
        while i < len(words):
            key = words[i].removeprefix("--").replace("-", "_")
            opts[key] = words[i + 1]
            i += 2
        opts.pop("out")
        for seed in range(plan.seeds):
            typed = {
                "task": opts["task"],
                "variant": opts["variant"],
                "data": opts["data"],
                "steps": int(opts["steps"]),
                "d_model": int(opts["d_model"]),
                "lr": float(opts["lr"]),
                "warmup": int(opts["warmup"]),
                "decay_end": float(opts["decay_end"]),
                "weight_decay": float(opts["weight_decay"]),
                "n_checkpoints": int(opts["n_checkpoints"]),
                "seq_len": int(opts["seq_len"]),
                "batch_size": int(opts["batch_size"]),
                "seed": seed,
            }
            got = config_from_options("cpu", **typed)
            assert asdict(got).__repr__() in want, line


def test_the_schedule_reaches_its_floor_at_decay_end_and_holds():
    from sinklab.lab.train import _lr_at

    cfg = LAB_SIZES["quick"].configs()[0]
    assert cfg.decay_end == 0.6 and cfg.d_model == 16 and cfg.batch_size * cfg.seq_len == 4096
    lrs = [_lr_at(s, cfg) for s in range(cfg.steps)]
    assert lrs[0] == pytest.approx(cfg.lr / cfg.warmup) and max(lrs) == pytest.approx(cfg.lr)
    assert lrs[600] == pytest.approx(0.1 * cfg.lr) and lrs[999] == pytest.approx(0.1 * cfg.lr)
    assert lrs[300] > 0.4 * cfg.lr and all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    whole = replace(cfg, decay_end=1.0)
    assert _lr_at(600, whole) > 0.3 * cfg.lr  # the old schedule: still decaying at 60 %


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--decay-end", "0", "--decay-end must be in (0, 1]"),
        ("--lr", "2", "--lr must be in (0, 1)"),
        ("--warmup", "-1", "--warmup must be >= 0"),
        ("--weight-decay", "1.5", "--weight-decay must be in [0, 1)"),
        ("--n-checkpoints", "0", "--n-checkpoints must be >= 1"),
    ],
)
def test_the_schedule_options_refuse_bad_values(capsys, flag, value, needle):
    assert_one_line_error(run_main(capsys, "train", "--task", "backcopy", flag, value), needle)


def test_train_cli_honours_the_options_and_records_the_tail(capsys, tmp_path):
    sizes = ("--steps", "10", "--d-model", "16", "--seq-len", "16", "--batch-size", "4")
    opts = ("--lr", "0.02", "--warmup", "2", "--decay-end", "0.5", "--weight-decay", "0.01")
    args = ("train", "--task", "backcopy", *sizes, *opts, "--n-checkpoints", "3")
    proc = run_main(capsys, *args, "-o", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "train.json").read_text())
    c = data["config"]
    assert (c["lr"], c["warmup"], c["decay_end"], c["weight_decay"]) == (0.02, 2, 0.5, 0.01)
    assert c["n_checkpoints"] == 3
    tail = [cp for cp in data["checkpoints"] if cp["step"] >= 8]
    assert [cp["step"] for cp in tail] == [8, 9, 10]
    for cp in tail:  # the damage and the median copy loss over the validation sequences
        assert {"damage", "backcopy_loss_median", "n_sequences"} <= set(cp["val"])
        assert cp["val"]["n_sequences"] >= 1 and cp["backcopy"]["sink_rate"]["0.3"] in (0.0, 1.0)
    assert all("val" not in cp for cp in data["checkpoints"] if cp["step"] < 8)
