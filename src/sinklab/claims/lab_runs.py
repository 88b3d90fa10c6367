"""The lab runs ``sinklab claims`` trains for its lab claims (docs/claims.md#lab-validity).

A :class:`LabPlan` names the sizes; :meth:`LabPlan.configs` the runs, ``seeds`` of each:
``softmax`` with BOS at the short T (the switch, the softmax twin, the BOS twin, the short end of
the length comparison), each null variant (``softmax1``, ``sink``) with BOS, ``softmax`` without
BOS, and ``softmax`` at the long T with the batch cut so that tokens per step stay equal.
:func:`train_lab_runs` trains them through the user cache (:mod:`sinklab.lab.cache`): a second
claims run with the same sizes and sinklab version trains nothing.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from sinklab.claims.measure_lab import LabRun
from sinklab.errors import SinklabError
from sinklab.progress import Tick


@dataclass(frozen=True)
class LabPlan:
    """Sizes of the lab runs the claims train (backcopy, 1 layer, 1 head)."""

    steps: int = 1000
    d_model: int = 16
    short_len: int = 32
    long_len: int = 128
    tokens_per_step: int = 4096  # seq_len x batch_size of every run
    lr: float = 1e-2
    warmup: int = 10
    decay_end: float = 0.6  # cosine to 0.1 x lr at 60 % of the steps, then held (settles)
    weight_decay: float = 0.0
    seeds: int = 6
    variants: tuple[str, ...] = ("softmax1", "sink")  # compared with softmax
    n_checkpoints: int = 8  # log-spaced, plus step 0 and the tail (sinklab.lab.train)

    def __post_init__(self) -> None:
        if self.seeds < 1 or self.steps < 10:
            raise SinklabError(f"lab seeds must be >= 1 and steps >= 10, got {self}")
        if not 8 <= self.short_len < self.long_len:
            raise SinklabError(
                f"lab lengths must satisfy 8 <= short < long, got {self.short_len}, {self.long_len}"
            )
        for t in (self.short_len, self.long_len):
            if self.tokens_per_step % t:
                raise SinklabError(
                    f"lab tokens per step ({self.tokens_per_step}) must be a multiple of each "
                    f"length ({t}), so that both lengths see the same tokens per step"
                )

    def configs(self) -> list[Any]:
        """Every run's :class:`~sinklab.lab.config.TrainConfig`, seed by seed."""
        from sinklab.lab.presets import preset

        def one(seed: int, **kw: Any) -> Any:
            t = kw.pop("seq_len", self.short_len)
            return preset(
                "cpu",
                task="backcopy",
                steps=self.steps,
                d_model=self.d_model,
                lr=self.lr,
                warmup=self.warmup,
                decay_end=self.decay_end,
                weight_decay=self.weight_decay,
                seq_len=t,
                batch_size=self.tokens_per_step // t,
                n_checkpoints=self.n_checkpoints,
                keep_checkpoints=False,
                seed=seed,
                **kw,
            )

        out = []
        for seed in range(self.seeds):
            out.append(one(seed))
            out += [one(seed, variant=v) for v in self.variants]
            out.append(one(seed, data="no-bos"))
            out.append(one(seed, seq_len=self.long_len))
        return out

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


LAB_SIZES: dict[str, LabPlan] = {
    # the report's --quick: 12 runs (3 seeds; softmax1 only), the same sizes as full
    "quick": LabPlan(seeds=3, variants=("softmax1",)),
    "full": LabPlan(),
}


LAB_WORKERS = 2  # runs trained side by side, one process and one thread each (2 cores)


def train_lab_runs(
    plan: LabPlan, tick: Tick | None = None, workers: int = LAB_WORKERS
) -> tuple[list[LabRun], dict[str, Any]]:
    """Train (or reuse from the cache) every run of ``plan``; the runs and what was done:
    ``trained`` / ``reused`` counts, ``seconds``, ``workers``, the ``cache`` folder and the
    ``plan``. Runs not in the cache train on up to ``workers`` worker processes, each taking the
    next run as it finishes one (:func:`sinklab.lab.cache.train_in_processes`, one thread each)."""
    from sinklab.lab.cache import cached_result, lab_cache_dir, train_in_processes

    t0 = time.perf_counter()
    configs = plan.configs()
    found: dict[int, LabRun] = {}

    def take(i: int) -> bool:
        prior = cached_result(configs[i])
        if prior is None:
            return False
        found[i] = LabRun.from_json(prior.to_json(), prior.out)
        if tick is not None:  # one per run done (trained or reused)
            tick(found[i].label)
        return True

    missing = [i for i in range(len(configs)) if not take(i)]
    n_workers = max(1, min(workers, len(missing), os.cpu_count() or 1))
    train_in_processes([configs[i] for i in missing], n_workers, lambda k: take(missing[k]))
    if lost := [configs[i] for i in missing if i not in found]:
        raise SinklabError(f"a lab run finished but its cache folder is unreadable: {lost[0]}")
    facts = {
        "cache": str(lab_cache_dir()),
        "trained": len(missing),
        "reused": len(configs) - len(missing),
        "seconds": round(time.perf_counter() - t0, 2),
        "workers": n_workers if missing else 0,
        "plan": plan.to_json(),
    }
    return [found[i] for i in range(len(configs))], facts
