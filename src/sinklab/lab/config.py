"""The configuration of one lab training run (:class:`TrainConfig`), validated on creation.

Kept apart from :mod:`sinklab.lab.train` so that :mod:`sinklab.lab.presets` and ``sinklab
train`` build configurations without importing the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

from sinklab.errors import SinklabError
from sinklab.lab.backcopy import BACKCOPY_DATA, BackcopyConfig
from sinklab.lab.data import DATA_STRATEGIES, DataConfig
from sinklab.lab.limits import MAX_BATCH, MAX_SEQ_LEN, MAX_STEP_TOKENS, MAX_TRAIN_STEPS
from sinklab.lab.model import LAB_VARIANTS

MAX_VOCAB = 65536  # far above what the corpus's BPE can fill
MAX_PARAMS = 500_000_000  # a lab model is tiny; this already needs ~8 GB with Adam's state
TASKS = ("text", "backcopy")
TASK_DATA = {"text": DATA_STRATEGIES, "backcopy": BACKCOPY_DATA}


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Defaults: the ``cpu`` preset of the ``text`` task (each task's presets:
    :mod:`sinklab.lab.presets`); a few minutes on 2 CPU cores."""

    task: str = "text"  # "text" (the plays) or "backcopy" (Guo et al. 2024)
    variant: str = "softmax"
    data: str = "bos"
    steps: int = 1200
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    seq_len: int = 128
    batch_size: int = 16
    lr: float = 2e-3
    warmup: int = 100
    decay_end: float = 1.0  # the cosine reaches 0.1 x lr at this fraction of steps, then holds
    weight_decay: float = 0.1
    seed: int = 0
    device: str = "cpu"
    vocab_size: int = 2048
    n_checkpoints: int = 8  # probed checkpoints, log-spaced in steps, the last one at `steps`
    eval_windows: int = 64  # held-out windows for the final perplexities
    max_docs: int | None = None  # tests: keep the first N documents
    keep_checkpoints: bool = True  # save weights of every checkpoint (the final one always)
    n_triggers: int = 3  # backcopy: the most frequent characters are the triggers

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise SinklabError(f"unknown task {self.task!r}; use one of: {', '.join(TASKS)}")
        if self.variant not in LAB_VARIANTS:
            raise SinklabError(
                f"unknown variant {self.variant!r}; use one of: {', '.join(LAB_VARIANTS)}"
            )
        if self.data not in TASK_DATA[self.task]:
            raise SinklabError(
                f"unknown data {self.data!r} for task {self.task}; use one of: "
                f"{', '.join(TASK_DATA[self.task])}"
            )
        for name, lo in (
            ("steps", 1),
            ("layers", 1),
            ("heads", 1),
            ("d_model", 2),
            ("seq_len", 2),
            ("batch_size", 1),
        ):
            if getattr(self, name) < lo:
                raise SinklabError(
                    f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(self, name)}"
                )
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise SinklabError(
                f"--d-model ({self.d_model}) must be a multiple of --heads ({self.heads}) with an "
                "even head size; e.g. --d-model 128 --heads 4"
            )
        if self.device not in ("cpu", "cuda"):
            raise SinklabError(
                f"--device must be cpu or cuda, got {self.device!r} (a lab model fits one device; "
                "--nproc N spreads the batch over N processes)"
            )
        for name, hi in (
            ("steps", MAX_TRAIN_STEPS),
            ("seq_len", MAX_SEQ_LEN),
            ("batch_size", MAX_BATCH),
        ):
            if getattr(self, name) > hi:
                raise SinklabError(
                    f"--{name.replace('_', '-')} must be at most {hi}, got {getattr(self, name)}"
                )
        if self.batch_size * self.seq_len > MAX_STEP_TOKENS:
            raise SinklabError(
                f"--batch-size {self.batch_size} x --seq-len {self.seq_len} is "
                f"{self.batch_size * self.seq_len} tokens a step, over {MAX_STEP_TOKENS}; "
                "lower either"
            )
        if not 0 < self.lr < 1:
            raise SinklabError(f"--lr must be in (0, 1), got {self.lr}")
        if self.warmup < 0:
            raise SinklabError(f"--warmup must be >= 0, got {self.warmup}")
        if not 0 <= self.weight_decay < 1:
            raise SinklabError(f"--weight-decay must be in [0, 1), got {self.weight_decay}")
        if not 0 < self.decay_end <= 1:
            raise SinklabError(f"--decay-end must be in (0, 1], got {self.decay_end}")
        if self.n_checkpoints < 1:
            raise SinklabError(f"--n-checkpoints must be >= 1, got {self.n_checkpoints}")
        if self.eval_windows < 1:
            raise SinklabError(f"eval_windows must be >= 1, got {self.eval_windows}")
        if self.n_triggers < 1:
            raise SinklabError(f"--n-triggers must be >= 1, got {self.n_triggers}")
        if not 1 <= self.vocab_size <= MAX_VOCAB:
            raise SinklabError(
                f"--vocab-size must be in 1..{MAX_VOCAB} (the BPE of the corpus has no more "
                f"tokens to fill), got {self.vocab_size}"
            )
        n_params = 2 * self.vocab_size * self.d_model + 12 * self.layers * self.d_model**2
        if n_params > MAX_PARAMS:
            raise SinklabError(
                f"a {self.layers}-layer, d_model {self.d_model}, vocab {self.vocab_size} model has "
                f"~{n_params:.2g} parameters; lab models are tiny (at most {MAX_PARAMS:.0e}): "
                "use smaller --layers / --d-model"
            )

    def data_config(self) -> DataConfig:
        return DataConfig(
            strategy=self.data,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            max_docs=self.max_docs,
        )

    def backcopy_config(self) -> BackcopyConfig:
        return BackcopyConfig(
            seq_len=self.seq_len, bos=self.data == "bos", n_triggers=self.n_triggers
        )
