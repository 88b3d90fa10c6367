"""Lab training on several processes: PyTorch DDP (gloo on CPU, nccl on CUDA).

:func:`train_distributed` spawns ``nproc`` processes on this machine; each runs
:func:`sinklab.lab.train.train` with its rank. Every step's global batch (``batch_size`` rows,
the same rows one process would draw) is split into ``nproc`` equal contiguous slices, one per
rank; DDP averages the gradients, so each step equals one process's step on the whole batch up to
floating-point summation order. Rank 0 probes the checkpoints, evaluates and writes ``out``; the
logged loss is the mean of the ranks' losses (the whole batch's loss). The same run under
``torchrun --nproc-per-node N -m sinklab train`` (:mod:`sinklab.commands.train`) shares the
process group (:func:`sinklab.lab.ranks.process_group`) and this split.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from sinklab.errors import SinklabError
from sinklab.lab.config import TrainConfig
from sinklab.lab.ranks import Ranks, check_nproc, process_group
from sinklab.lab.train import TrainResult, load_result, train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int, world: int, config: TrainConfig, out: str | None, port: int, threads: int
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    ranks = Ranks(rank, world)
    with process_group(ranks, config.device):
        train(config, Path(out) if (out and rank == 0) else None, ranks=ranks)


def train_distributed(config: TrainConfig, out: Path, nproc: int, threads: int = 1) -> TrainResult:
    """Train ``config`` on ``nproc`` local processes (``threads`` each); returns rank 0's
    :class:`~sinklab.lab.train.TrainResult`, read back from ``out/train.json``."""
    import torch.multiprocessing as mp

    check_nproc(nproc, config.batch_size)
    port = _free_port()
    mp.spawn(_worker, args=(nproc, config, str(out), port, threads), nprocs=nproc, join=True)
    result = load_result(out)
    if result is None:
        raise SinklabError(f"the {nproc}-process run wrote no train.json in {out}")
    return result
