"""DDP lab training: 2 CPU processes (gloo) give the run of 1 process with the same global batch,
spawned by ``sinklab train --nproc 2`` or started by ``torchrun -m sinklab train``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sinklab.cli import main as cli_main
from sinklab.errors import SinklabError
from sinklab.lab.config import TrainConfig
from sinklab.lab.distributed import train_distributed
from sinklab.lab.presets import config_from_options
from sinklab.lab.ranks import Ranks, check_nproc
from sinklab.lab.train import TrainResult, load_result, train
from sinklab.outputs import MARKER

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


def assert_same_run(one: TrainResult, two: TrainResult) -> None:
    """Two runs of one config, on 1 and on 2 processes, agree within summation-order error."""
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
    assert one.run["processes"] == 1 and two.run["processes"] == 2
    same = ("corpus", "n_train_tokens", "n_sequences", "triggers", "probe")
    assert {k: one.run[k] for k in same} == {k: two.run[k] for k in same}


def test_two_processes_equal_one_with_the_same_global_batch(tmp_path):
    config = TrainConfig(**TINY)
    one = train(config, tmp_path / "one")
    two = train_distributed(config, tmp_path / "two", nproc=2)
    assert_same_run(one, two)
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
    with pytest.raises(SinklabError, match=r"--nproc must be in 1\.\.64"):
        check_nproc(0, 8)


# the options of `sinklab train` (what torchrun passes on) for a run as small as TINY
OPTIONS = dict(task="backcopy", steps=4, layers=1, heads=2, d_model=16, seq_len=16, batch_size=8)


def main(argv: list[str]) -> int:
    """``sinklab train ARGV`` in this process (the command torchrun starts in each rank)."""
    return cli_main(["train", *argv])


def test_torchrun_module_entry_equals_one_process(tmp_path):
    """``torchrun --nproc-per-node 2 -m sinklab train ...``: each process takes its rank from
    the environment; rank 0 writes a train.json equal to the one-process run's. A subprocess:
    the launcher and its environment are what is tested (~10-20 s, torch imported 3 times)."""
    config = config_from_options("cpu", **OPTIONS)
    one = train(config, tmp_path / "one")
    args = [f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS.items()]
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    proc = subprocess.run(
        [*torchrun, "2", "-m", "sinklab", "train", *args, "--out", str(tmp_path / "two")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = load_result(tmp_path / "two")
    assert two is not None and two.config == config
    assert_same_run(one, two)
    assert proc.stdout.count("first-token mass at non-trigger queries") == 1  # rank 0's, once
    assert proc.stdout.count("wrote ") == 1 and (tmp_path / "two" / MARKER).is_file()


def test_module_entry_bad_option_or_environment_is_one_line(tmp_path, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    assert main(["--variant", "relu2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sinklab: error: unknown variant") and "\n" not in err
    assert main(["--steps", "x"]) == 2  # a parse error: one line too
    err = capsys.readouterr().err.strip()
    assert err.startswith("sinklab: error: Invalid value for '--steps'") and "\n" not in err
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert main(["--task", "backcopy", "--out", str(tmp_path / "x")]) == 2  # no MASTER_ADDR
    assert "torchrun" in capsys.readouterr().err
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert main(["--task", "backcopy", "--out", str(tmp_path / "x")]) == 2  # 32 rows over 3
    assert "multiple of --nproc (3)" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "3")
    assert main(["--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
    monkeypatch.setenv("RANK", "1")  # a helper rank meets rank 0's mistake and says nothing
    assert main(["--task", "backcopy", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["--task", "backcopy", "--sweep", "data", "--out", str(tmp_path / "x")]) == 2
    assert "one rank of one run" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(SinklabError, match="integers"):
        Ranks.from_env()
