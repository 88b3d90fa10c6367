"""Train one lab decoder, deterministically for a seed, probing sinks at every checkpoint.

Two tasks: ``text`` (the plays, BPE tokens, a data strategy of :mod:`sinklab.lab.data`) and
``backcopy`` (:mod:`sinklab.lab.backcopy`, online bigram-backcopy sequences; every checkpoint also
records ``backcopy``, :func:`sinklab.lab.backcopy_metrics.backcopy_summary`).
:func:`train` returns a :class:`TrainResult` (config, loss curve, one probe summary per
checkpoint, validation perplexity with and without the first token, ``meta``) and writes
``train.json``, ``loss.png`` and ``sinks.png`` (each beside the JSON of its numbers) and the
checkpoints (``checkpoints/step-N``: weights, config, tokenizer; loadable by
:func:`sinklab.models.load_model`) under ``out``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sinklab.errors import SinklabError
from sinklab.lab.backcopy import BACKCOPY_DATA, BackcopyConfig, BackcopyData, backcopy_validation
from sinklab.lab.backcopy_metrics import backcopy_summary
from sinklab.lab.data import DATA_STRATEGIES, DataConfig, LabData
from sinklab.lab.model import LAB_VARIANTS, LabConfig, LabForCausalLM
from sinklab.lab.ranks import Ranks, check_nproc
from sinklab.meta import build_meta, write_json_atomic
from sinklab.probe import ProbeConfig, probe

log = logging.getLogger(__name__)

MAX_VOCAB = 65536  # far above what the corpus's BPE can fill
MAX_PARAMS = 500_000_000  # a lab model is tiny; this already needs ~8 GB with Adam's state
EPS = (0.3, 0.8)  # sink-head thresholds (Gu et al., Barbero et al.), docs/metrics.md#q0-eps
TASKS = ("text", "backcopy")
TASK_DATA = {"text": DATA_STRATEGIES, "backcopy": BACKCOPY_DATA}
BACKCOPY_PROBE_SEQUENCES = 16  # held-out sequences each checkpoint's backcopy metrics read


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
        for name, lo in (("steps", 1), ("layers", 1), ("heads", 1), ("batch_size", 1)):
            if getattr(self, name) < lo:
                raise SinklabError(f"--{name.replace('_', '-')} must be >= {lo}")
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise SinklabError(
                f"--d-model ({self.d_model}) must be a multiple of --heads ({self.heads}) with an "
                "even head size; e.g. --d-model 128 --heads 4"
            )
        if self.device not in ("cpu", "cuda"):
            raise SinklabError(f"--device must be cpu or cuda, got {self.device!r}")
        if not 0 < self.lr < 1:
            raise SinklabError(f"--lr must be in (0, 1), got {self.lr}")
        if self.n_checkpoints < 1 or self.eval_windows < 1:
            raise SinklabError("n_checkpoints and eval_windows must be >= 1")
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


def checkpoint_steps(steps: int, n: int) -> list[int]:
    """``n`` log-spaced steps in ``1..steps`` (distinct, ending at ``steps``), plus step 0."""
    raw = {round(steps ** (i / max(1, n - 1))) if n > 1 else steps for i in range(n)}
    return sorted({0, *(min(steps, max(1, s)) for s in raw), steps})


@dataclass
class TrainResult:
    """Everything ``train.json`` holds; ``checkpoints`` rows: step, sink_rate, sink_mass."""

    config: TrainConfig
    loss: list[tuple[int, float]]
    checkpoints: list[dict[str, Any]]
    val: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict)
    out: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "loss": [[s, v] for s, v in self.loss],
            "checkpoints": self.checkpoints,
            "val": self.val,
            "meta": self.meta,
        }


def load_result(out: Path) -> TrainResult | None:
    """The finished run saved in ``out/train.json``, or None when there is none (or unreadable)."""
    try:
        raw = json.loads((out / "train.json").read_text(encoding="utf-8"))
        config = TrainConfig(**raw["config"])
        loss = [(int(s), float(v)) for s, v in raw["loss"]]
        return TrainResult(config, loss, raw["checkpoints"], raw["val"], raw.get("meta", {}), out)
    except (OSError, ValueError, KeyError, TypeError, SinklabError):
        return None


def _lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10 % of ``lr``."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    frac = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]  # norms, sink logits, biases
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))


def probe_summary(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """Sink mass ``(L, H)`` at key 0 (q0 = 0), sink rate at eps 0.3/0.8, via ``sinklab.probe``."""
    result = probe(model, ids, config=ProbeConfig(q0=0, eps=EPS))
    mass = torch.as_tensor(result.sink_mass).to(torch.float64)  # (L, H)
    return {
        "sink_rate": {str(e): float((mass > e).double().mean()) for e in EPS},
        "first_token_sink_mass": float(mass.mean()),
        "sink_mass": mass.tolist(),
    }


@torch.no_grad()
def validation(model: torch.nn.Module, data: LabData, n: int, device: str) -> dict[str, float]:
    """Perplexity on held-out text with and without the first token (BOS, or the token before).

    ``damage`` = ``ppl_without_first / ppl_with_first - 1`` (0 = removing it costs nothing).
    """
    prefix, text = data.eval_windows(n)  # (N,), (N, T - 1)
    prefix, text = prefix.to(device), text.to(device)
    with_first = torch.cat([prefix[:, None], text], dim=1)  # (N, T)
    nll = {}
    for name, ids, skip in (("with_first", with_first, 1), ("without_first", text, 0)):
        total, count = 0.0, 0
        for i in range(0, ids.shape[0], 16):
            batch = ids[i : i + 16]
            logits = model(batch).logits[:, skip:-1]  # predicts text[1:]: (b, T - 2, V)
            target = text[i : i + 16, 1:]  # (b, T - 2)
            total += float(F.cross_entropy(logits.transpose(1, 2), target, reduction="sum"))
            count += target.numel()
        nll[name] = total / count
    ppl_w, ppl_wo = math.exp(nll["with_first"]), math.exp(nll["without_first"])
    return {"ppl_with_first": ppl_w, "ppl_without_first": ppl_wo, "damage": ppl_wo / ppl_w - 1}


def build_model(config: TrainConfig, vocab_size: int | None = None) -> LabForCausalLM:
    """A fresh lab decoder for ``config`` (``vocab_size``: the data's, else the config's)."""
    torch.manual_seed(config.seed)
    model_config = LabConfig(
        vocab_size=vocab_size or config.vocab_size,
        hidden_size=config.d_model,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        max_position_embeddings=config.seq_len,
        attention_variant=config.variant,
    )
    return LabForCausalLM(model_config)


def _prepare(config: TrainConfig, data: Any) -> tuple[Any, int, Callable[[int], dict], dict]:
    """The task's data, vocabulary size, ``batch(step)`` and the held-out probe inputs."""
    if config.task == "backcopy":
        if not isinstance(data, BackcopyData) or data.config != config.backcopy_config():
            data = BackcopyData(config.backcopy_config())
        ids, copied = data.held_out(BACKCOPY_PROBE_SEQUENCES, config.seed)

        def batch(step: int) -> dict:
            return data.batch(step, config.batch_size, config.seed)

        probe_in = {"ids": ids, "copied": copied, "first": ids[0]}
        return data, data.table.vocab_size, batch, probe_in
    if not isinstance(data, LabData) or data.config != config.data_config():
        tokenizer = data.tokenizer if isinstance(data, LabData) else None
        data = LabData(config.data_config(), tokenizer=tokenizer)
    if len(data.tokenizer) > config.vocab_size:
        raise SinklabError(
            f"tokenizer has {len(data.tokenizer)} tokens > vocab {config.vocab_size}"
        )
    order = data.batch_order(config.steps, config.batch_size, config.seed)
    prefix, text = data.eval_windows(1)
    first = torch.cat([prefix, text[0]])  # (T,) the training format

    def text_batch(step: int) -> dict:
        return data.batch(order[step])

    return data, config.vocab_size, text_batch, {"first": first}


def train(
    config: TrainConfig,
    out: Path | None = None,
    *,
    data: LabData | BackcopyData | None = None,
    callback: Callable[[int, float], None] | None = None,
    ranks: Ranks | None = None,
) -> TrainResult:
    """Train, probe each checkpoint, evaluate; write outputs under ``out`` when given.

    ``data`` lets sweeps reuse one tokenizer (text) or bigram table (backcopy); it is rebuilt
    when it does not match ``config``. ``callback(step, loss)`` is called after every step.
    ``ranks``: this process's place in a DDP run (:mod:`sinklab.lab.distributed`, the process
    group already initialised): it trains on its slice of each global batch; only rank 0
    probes, evaluates and writes (the other ranks return their loss curve only).
    """
    if config.device == "cuda" and not torch.cuda.is_available():
        raise SinklabError("--device cuda but no CUDA device is visible; use --device cpu")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI shows its own progress
    t0 = time.perf_counter()
    data, vocab_size, get_batch, probe_in = _prepare(config, data)
    model = build_model(config, vocab_size).to(config.device)
    ranks = ranks or Ranks()
    lead, net = ranks.rank == 0, model
    if ranks.world > 1:
        check_nproc(ranks.world, config.batch_size)
        net = torch.nn.parallel.DistributedDataParallel(model)  # averages gradients over ranks
    opt = _optimizer(model, config)
    probe_ids = probe_in["first"].to(config.device)
    schedule = set(checkpoint_steps(config.steps, config.n_checkpoints))
    losses: list[tuple[int, float]] = []
    checkpoints: list[dict[str, Any]] = []

    def checkpoint(step: int) -> None:
        model.eval()
        row = {"step": step, **probe_summary(model, probe_ids)}
        if config.task == "backcopy":
            row["backcopy"] = backcopy_summary(
                model, probe_in["ids"], probe_in["copied"], data.table
            )
        if out is not None and (config.keep_checkpoints or step == config.steps):
            folder = out / "checkpoints" / f"step-{step}"
            model.save_pretrained(folder)
            data.tokenizer.save_pretrained(folder)
            row["path"] = str(folder.relative_to(out))  # relative: the run folder may move
        checkpoints.append(row)
        model.train()
        log.info("step %d: sink rate %s", step, row["sink_rate"])

    model.train()
    for step in range(config.steps + 1):
        if step in schedule and lead:
            checkpoint(step)
        if step == config.steps:
            break
        rows = ranks.rows(config.batch_size)
        batch = {k: v[rows].to(config.device) for k, v in get_batch(step).items()}
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, config)
        loss = net(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        if ranks.world > 1:  # the whole batch's loss: the mean over equal slices
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            value = total.item() / ranks.world
        losses.append((step + 1, value))
        if callback is not None:
            callback(step + 1, value)
    model.eval()
    if not lead:
        return TrainResult(config, losses, [], {}, {}, None)
    if config.task == "backcopy":
        val = backcopy_validation(model, data, config.eval_windows, config.seed, config.device)
        sizes = {
            "n_train_tokens": config.steps * config.batch_size * config.seq_len,
            "n_sequences": config.steps * config.batch_size,
            "corpus": "bigram-backcopy on the characters of the embedded plays",
            "triggers": [data.table.token(t) for t in data.table.triggers],
        }
    else:
        val = validation(model, data, config.eval_windows, config.device)
        sizes = {
            "n_train_tokens": data.n_train_tokens,
            "n_sequences": int(data.ids.shape[0]),
            "corpus": "shakespeare scenes"
            if config.max_docs is None
            else f"first {config.max_docs} scenes",
        }
    meta = build_meta(
        params=config,
        seconds=time.perf_counter() - t0,
        n_params=sum(p.numel() for p in model.parameters()),
        probe={"q0": 0, "eps": list(EPS), "key": 0, "n_tokens": int(probe_ids.numel())},
        torch_threads=torch.get_num_threads(),
        **sizes,
    )
    result = TrainResult(config, losses, checkpoints, val, meta, out)
    if out is not None:
        write_outputs(result, out)
    return result


def write_outputs(result: TrainResult, out: Path) -> None:
    """``train.json``, ``loss.png`` and ``sinks.png`` under ``out``."""
    from sinklab.lab.plots import plot_loss, plot_sink_emergence

    c = result.config
    title = f"{c.task}: {c.variant} / {c.data}, seed {c.seed}"
    write_json_atomic(out / "train.json", result.to_json())
    plot_loss(result.loss, out / "loss.png", title=title)
    plot_sink_emergence(result.checkpoints, out / "sinks.png", title=title)
