"""DDP lab training: 2 CPU processes (gloo) give the run of 1 process with the same global batch."""

from __future__ import annotations

import json

import pytest

from sinklab.errors import SinklabError
from sinklab.lab.distributed import train_distributed
from sinklab.lab.ranks import Ranks, check_nproc
from sinklab.lab.train import TrainConfig, train

TINY = dict(
    task="backcopy",
    steps=4,
    layers=1,
    heads=2,
    d_model=16,
    seq_len=16,
    batch_size=8,
    lr=3e-3,
    warmup=1,
    n_checkpoints=2,
    eval_windows=8,
)


def test_two_processes_equal_one_with_the_same_global_batch(tmp_path):
    config = TrainConfig(**TINY)
    one = train(config, tmp_path / "one")
    two = train_distributed(config, tmp_path / "two", nproc=2)
    # tolerance: DDP sums the two halves' gradients in another order than one process does
    assert [s for s, _ in two.loss] == [s for s, _ in one.loss]
    for (_, a), (_, b) in zip(one.loss, two.loss, strict=True):
        assert abs(a - b) < 1e-5 * max(1.0, abs(a)), (a, b)
    assert len(two.checkpoints) == len(one.checkpoints)
    for ca, cb in zip(one.checkpoints, two.checkpoints, strict=True):
        assert ca["step"] == cb["step"] and ca.get("path") == cb.get("path")
        for key in ("first_token_mass_nontrigger", "prev_token_mass_trigger", "backcopy_loss"):
            assert abs(ca["backcopy"][key] - cb["backcopy"][key]) < 1e-4, key
    for key, value in one.val.items():
        assert abs(value - two.val[key]) < 1e-4 * max(1.0, abs(value)), key
    saved = json.loads((tmp_path / "two" / "train.json").read_text())
    assert saved["config"] == json.loads((tmp_path / "one" / "train.json").read_text())["config"]
    assert (tmp_path / "two" / "checkpoints" / "step-4" / "config.json").is_file()


def test_ranks_split_the_batch_and_bad_nproc_is_one_error():
    assert [Ranks(r, 4).rows(8) for r in range(4)] == [
        slice(0, 2),
        slice(2, 4),
        slice(4, 6),
        slice(6, 8),
    ]
    assert Ranks().rows(8) == slice(0, 8)
    with pytest.raises(SinklabError, match="multiple of --nproc"):
        check_nproc(3, 8)
    with pytest.raises(SinklabError, match=">= 1"):
        check_nproc(0, 8)
