"""Where a process sits in a multi-process (DDP) lab run; see :mod:`sinklab.lab.distributed`."""

from __future__ import annotations

from dataclasses import dataclass

from sinklab.errors import SinklabError


@dataclass(frozen=True)
class Ranks:
    """This process's place in a run: ``rank`` of ``world``."""

    rank: int = 0
    world: int = 1

    def rows(self, batch_size: int) -> slice:
        per = batch_size // self.world
        return slice(self.rank * per, (self.rank + 1) * per)


def check_nproc(nproc: int, batch_size: int) -> None:
    if nproc < 1:
        raise SinklabError(f"--nproc must be >= 1, got {nproc}")
    if batch_size % nproc:
        raise SinklabError(
            f"--batch-size ({batch_size}) must be a multiple of --nproc ({nproc}); each process "
            "takes an equal share of the global batch"
        )
