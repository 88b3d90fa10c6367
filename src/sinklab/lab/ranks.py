"""Where a process sits in a multi-process (DDP) lab run, and its process group.

Two launchers use it: ``sinklab train --nproc N`` (:mod:`sinklab.lab.distributed` spawns the
processes) and ``torchrun --nproc-per-node N -m sinklab train`` (each process reads its place
from the environment, :meth:`Ranks.from_env`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sinklab.errors import SinklabError
from sinklab.lab.limits import MAX_NPROC


@dataclass(frozen=True)
class Ranks:
    """This process's place in a run: ``rank`` of ``world``; ``local`` its rank on this machine
    (which GPU it takes)."""

    rank: int = 0
    world: int = 1
    local: int | None = None  # None: the same as rank (one machine)

    def rows(self, batch_size: int) -> slice:
        per = batch_size // self.world
        return slice(self.rank * per, (self.rank + 1) * per)

    @staticmethod
    def launched() -> bool:
        """Whether a launcher (torchrun, or any ``env://`` one) placed this process: ``RANK`` or
        ``WORLD_SIZE`` is set."""
        return "RANK" in os.environ or "WORLD_SIZE" in os.environ

    @classmethod
    def from_env(cls) -> Ranks:
        """The place torchrun (or any ``env://`` launcher) gives: ``RANK``, ``WORLD_SIZE``,
        ``LOCAL_RANK``; one process when they are unset."""
        try:
            rank = int(os.environ.get("RANK", "0"))
            world = int(os.environ.get("WORLD_SIZE", "1"))
            local = int(os.environ.get("LOCAL_RANK", str(rank)))
        except ValueError:
            raise SinklabError(
                "RANK / WORLD_SIZE / LOCAL_RANK must be integers (as torchrun sets them)"
            ) from None
        if world < 1 or not 0 <= rank < world:
            raise SinklabError(f"RANK {rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE {world})")
        if world > 1 and not os.environ.get("MASTER_ADDR"):
            raise SinklabError(
                f"WORLD_SIZE {world} but no MASTER_ADDR: start the ranks with torchrun, e.g. "
                "torchrun --nproc-per-node 2 -m sinklab train ..."
            )
        return cls(rank, world, local)


def check_nproc(nproc: int, batch_size: int) -> None:
    if not 1 <= nproc <= MAX_NPROC:
        raise SinklabError(f"--nproc must be in 1..{MAX_NPROC}, got {nproc}")
    if batch_size % nproc:
        raise SinklabError(
            f"--batch-size ({batch_size}) must be a multiple of --nproc ({nproc}); each process "
            "takes an equal share of the global batch"
        )


@contextmanager
def process_group(ranks: Ranks, device: str) -> Iterator[None]:
    """This rank's DDP process group (gloo on CPU, nccl on CUDA; rendezvous at ``MASTER_ADDR``
    / ``MASTER_PORT``), destroyed on exit. One process: nothing to set up."""
    if ranks.world == 1:
        yield
        return
    import torch
    import torch.distributed as dist

    if device == "cuda":
        local = ranks.rank if ranks.local is None else ranks.local
        torch.cuda.set_device(local % torch.cuda.device_count())
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world)
    try:
        yield
    finally:
        dist.destroy_process_group()
